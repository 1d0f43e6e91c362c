"""Quantized variants of a tiny model, made on demand.

The harness's own quantizers (harness.formats, the same code the generators use) or, for the
compressed-tensors formats, compressed-tensors' own API (harness.lm.ct_producer). Activation
scales come from calibration: the largest |input| each Linear sees on training text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness.core.errors import HarnessError
from harness.lm import corpus
from harness.lm.models import model_dir

PROVENANCE_FILE = "harness_lm.json"
PRODUCERS = ("harness", "compressed-tensors")
CALIBRATION_SEQUENCES, CALIBRATION_LENGTH = 8, 128
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def calibrate(directory: Path) -> dict[str, float]:
    """Max |input| per Linear module (module name -> amax) over calibration text, in float32."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()
    amax: dict[str, float] = {}

    def recorder(name):
        def hook(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().item())

        return hook

    handles = [
        m.register_forward_pre_hook(recorder(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    ]
    ids = corpus.encode(corpus.text(corpus.TRAIN_SEED + 100, CALIBRATION_SEQUENCES * CALIBRATION_LENGTH))
    with torch.no_grad():
        for i in range(CALIBRATION_SEQUENCES):
            model(input_ids=torch.tensor([ids[i * CALIBRATION_LENGTH : (i + 1) * CALIBRATION_LENGTH]]))
    for handle in handles:
        handle.remove()
    return amax


def quantize_model(
    name: str, fmt_name: str, out: str | Path, producer: str = "harness", knobs: dict | None = None
) -> Path:
    """Write tiny model `name` quantized in harness format `fmt_name` into `out` (created; must be empty)."""
    import torch
    from safetensors.torch import load_file, save_file

    from harness.formats import get_format, require_formats

    source = model_dir(name)
    out = Path(out)
    require_formats(fmt_name)
    if producer not in PRODUCERS:
        raise HarnessError(f"unknown producer '{producer}' (known: {', '.join(PRODUCERS)})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HarnessError(f"{out}: output directory exists and is not empty")
    if producer == "compressed-tensors" and not fmt_name.startswith("ct-"):
        raise HarnessError(f"compressed-tensors does not produce {fmt_name}")
    fmt = get_format(fmt_name)
    try:
        resolved = fmt.resolve_knobs(knobs or {})
    except (KeyError, ValueError) as error:
        raise HarnessError(f"{fmt_name}: bad knob ({error})") from None
    amax = calibrate(source)
    out.mkdir(parents=True, exist_ok=True)
    if producer == "compressed-tensors":
        from harness.lm.ct_producer import produce_with_compressed_tensors

        produce_with_compressed_tensors(source, fmt_name, out, amax, knobs or {})
    else:
        weights = load_file(str(source / "model.safetensors"))
        tensors = {}
        for key, tensor in weights.items():
            module = key.removesuffix(".weight")
            if key.endswith("_proj.weight") and module in amax:
                quantized = fmt.quantize(tensor, resolved, model_dtype=torch.bfloat16, activation_amax=amax[module])
                tensors.update({f"{module}.{suffix}": t.contiguous() for suffix, t in quantized.tensors.items()})
            else:
                tensors[key] = tensor
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"] = fmt.quantization_config(resolved, ["lm_head"])
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in COPIED_FILES:
            if (source / file).is_file():
                shutil.copy(source / file, out / file)
    provenance = {
        "model": name,
        "format": fmt_name,
        "producer": producer,
        "knobs": resolved,
        "command": f"python -m harness quantize {name} --format {fmt_name} --producer {producer}",
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return out


def model_and_format(directory: str | Path) -> tuple[str, str]:
    """Which tiny model and format a checkpoint directory holds: its harness_lm.json, or the
    training record of a committed model (format "bf16")."""
    directory = Path(directory)
    for file, fmt_key in ((PROVENANCE_FILE, "format"), ("training.json", None)):
        path = directory / file
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                return data["model"], (data[fmt_key] if fmt_key else "bf16")
            except (ValueError, KeyError) as error:
                raise HarnessError(f"{path}: unreadable ({error})") from None
    raise HarnessError(f"{directory}: not made from a tiny model (no {PROVENANCE_FILE} or training.json)")
