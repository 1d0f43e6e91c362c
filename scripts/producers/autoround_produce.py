"""Produce int4 (and a few low-bit float) checkpoints with Intel AutoRound, exported as auto_round, gptq and awq.

Standalone producer script: it imports only auto-round, torch, safetensors, transformers (with tokenizers) and the
standard library, never the harness. It builds a tiny random-weight Llama in bfloat16 (fixed seed, weights drawn from a
seeded generator so they do not depend on the transformers version's init) and a minimal offline WordLevel tokenizer
(AutoRound refuses a model object without one), then runs ``AutoRound(model, tokenizer, iters=..., dataset=[random
token-id batches], device_map="cpu", seed=0, ...).quantize_and_save(dir, format=...)``. ``iters=0`` is AutoRound's
RTN mode (with its default optimized RTN); one case runs 2 SignRound iterations.

Output: ``OUT/autoround/<case>/`` holding the checkpoint as AutoRound saves it (tokenizer files removed),
``provenance.json`` and ``producer_truth/weights.safetensors``: each quantized Linear's weight as AutoRound holds it
in memory right before packing (its quantize-dequantize result, float32), captured by wrapping
``auto_round.export.formats.base.OutputFormat.immediate_pack`` and the formats' ``save_quantized`` (observation
only; the packing code runs unchanged), where the format's packing path exposes it (the int formats do; the
nvfp4/mxfp4/fp8 auto_round exports do not, and provenance.json says so). Failures per case go to
``OUT/autoround/FAILED.json``.

Usage: python scripts/producers/autoround_produce.py --out DIR [--only SUBSTRING ...]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import producing  # noqa: E402  (beside this script)
import torch  # noqa: E402
from auto_round import AutoRound  # noqa: E402
from auto_round.export.formats.base import OutputFormat  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

PRODUCER = "autoround"
SEED = 0
ARCH = "LlamaForCausalLM"
MODEL_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CALIB_SAMPLES = 8
CALIB_SEQLEN = 32

# case -> (scheme label, export format, AutoRound keyword arguments besides the common ones)
CASES: dict[str, tuple[str, str, dict]] = {
    "w4g128_sym_autoround": ("int4 sym, group 128, RTN", "auto_round", {"iters": 0}),
    "w4g128_asym_autoround": ("int4 asym, group 128, RTN", "auto_round", {"iters": 0, "sym": False}),
    "w4g32_sym_autoround": ("int4 sym, group 32, RTN", "auto_round", {"iters": 0, "group_size": 32}),
    "w4g128_sym_autoround_iters2": ("int4 sym, group 128, SignRound 2 iters", "auto_round", {"iters": 2}),
    "w4g128_sym_plainrtn_autoround": (
        "int4 sym, group 128, plain RTN (opt-RTN off)",
        "auto_round",
        {"iters": 0, "disable_opt_rtn": True},
    ),
    "w4g128_sym_gptq": ("int4 sym, group 128, RTN", "auto_gptq", {"iters": 0}),
    "w4g128_asym_gptq": ("int4 asym, group 128, RTN", "auto_gptq", {"iters": 0, "sym": False}),
    "w4g128_asym_awq": ("int4 asym, group 128, RTN", "auto_awq", {"iters": 0, "sym": False}),
    "nvfp4_autoround": ("nvfp4 (scheme NVFP4), RTN", "auto_round", {"iters": 0, "scheme": "NVFP4"}),
    "mxfp4_autoround": ("mxfp4 (scheme MXFP4), RTN", "auto_round", {"iters": 0, "scheme": "MXFP4"}),
    "fp8_static_autoround": (
        "fp8 weight and static activation (scheme FP8_STATIC), RTN",
        "auto_round",
        {"iters": 0, "scheme": "FP8_STATIC"},
    ),
}


PACKAGES = ("torch", "auto-round", "transformers", "accelerate", "safetensors", "tokenizers", "huggingface-hub")


def save_tokenizer(directory: Path) -> None:
    """A minimal offline WordLevel tokenizer over the model's 512 ids: <unk>, <s>, </s>, then t3..t511."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, MODEL_CONFIG["vocab_size"])})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.save_pretrained(directory)


def calibration_data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    shape = (1, CALIB_SEQLEN)
    return [
        {
            "input_ids": torch.randint(3, MODEL_CONFIG["vocab_size"], shape, generator=generator),
            "attention_mask": torch.ones(shape, dtype=torch.long),
        }
        for _ in range(CALIB_SAMPLES)
    ]


CAPTURED: dict[str, torch.Tensor] = {}


def capture(name: str, module: torch.nn.Module) -> None:
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear) and hasattr(module, "scale") and weight is not None:
        if weight.device.type != "meta" and int(getattr(module, "bits", 16)) <= 8:
            CAPTURED[f"{name}.weight"] = weight.detach().float().cpu().clone().contiguous()


def install_truth_hooks() -> None:
    """Record each quantized Linear's in-memory weight just before AutoRound packs it (observation only)."""
    original_pack = OutputFormat.immediate_pack

    @functools.wraps(original_pack)
    def immediate_pack(self, name, model, device, **kwargs):
        capture(name, model.get_submodule(name))
        return original_pack(self, name, model, device, **kwargs)

    OutputFormat.immediate_pack = immediate_pack

    def wrap_save(cls: type) -> None:
        original_save = cls.__dict__.get("save_quantized")
        if original_save is None:
            return

        @functools.wraps(original_save)
        def save_quantized(self, *args, **kwargs):
            model = kwargs.get("model")
            if model is not None:
                for name, module in model.named_modules():
                    capture(name, module)
            return original_save(self, *args, **kwargs)

        cls.save_quantized = save_quantized

    pending = list(OutputFormat.__subclasses__())
    while pending:
        cls = pending.pop()
        wrap_save(cls)
        pending.extend(cls.__subclasses__())


def prepare(directory: Path) -> None:
    """The base model and the offline tokenizer AutoRound's calibration asks for."""
    producing.build_seeded_llama(directory, MODEL_CONFIG, SEED)
    save_tokenizer(directory)


def run_case(case: str, base_dir: Path, out_root: Path) -> None:
    scheme, fmt, kwargs = CASES[case]
    case_dir = out_root / PRODUCER / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    started = time.time()
    CAPTURED.clear()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    common = {
        "dataset": calibration_data(),
        "nsamples": CALIB_SAMPLES,
        "seqlen": CALIB_SEQLEN,
        "batch_size": 4,
        "device_map": "cpu",
        "seed": SEED,
    }
    with tempfile.TemporaryDirectory(prefix="autoround-save-") as tmp:
        autoround = AutoRound(model, tokenizer=tokenizer, **common, **kwargs)
        autoround.quantize_and_save(tmp, format=fmt)
        saved = [p for p in Path(tmp).rglob("config.json")]
        if len(saved) != 1:
            raise RuntimeError(f"expected one saved checkpoint under the output dir, found {len(saved)}")
        shutil.copytree(saved[0].parent, case_dir)
    for name in TOKENIZER_FILES:
        (case_dir / name).unlink(missing_ok=True)
    files = producing.digests(case_dir)
    if CAPTURED:
        (case_dir / "producer_truth").mkdir()
        save_file(dict(sorted(CAPTURED.items())), case_dir / "producer_truth" / "weights.safetensors")
    notes = [
        "base model: tiny random Llama, bfloat16, weights ~ N(0, 0.02) from torch.Generator(seed), norms = 1",
        f"calibration: {CALIB_SAMPLES} random token-id sequences of length {CALIB_SEQLEN} (seed {SEED + 1})",
        "tokenizer: local WordLevel tokenizer (AutoRound requires one); its files are removed from the output",
        "producer_truth: each quantized nn.Linear's in-memory weight (AutoRound's quantize-dequantize result) "
        "captured right before packing, by wrapping OutputFormat.immediate_pack and the formats' save_quantized",
        f"elapsed_s={time.time() - started:.2f}",
    ]
    if not CAPTURED:
        notes.append(
            "no producer_truth: this format's packing path (neither OutputFormat.immediate_pack nor save_quantized "
            "with an nn.Linear carrying a scale) exposed no in-memory quantize-dequantize weight"
        )
    provenance = {
        "producer": "auto-round",
        "producer_version": importlib.metadata.version("auto-round"),
        "packages": producing.package_versions(PACKAGES),
        "case": case,
        "arch": ARCH,
        "scheme": scheme,
        "recipe": {
            "AutoRound": {**{k: v for k, v in common.items() if k != "dataset"}, **kwargs},
            "quantize_and_save": {"format": fmt},
            "calibration": {"samples": CALIB_SAMPLES, "seqlen": CALIB_SEQLEN, "seed": SEED + 1},
            "model_config": MODEL_CONFIG,
        },
        "command": " ".join([sys.executable, *sys.argv]),
        "seed": SEED,
        "files": files,
        "notes": notes,
    }
    (case_dir / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output root; cases go to OUT/autoround/")
    parser.add_argument("--only", nargs="*", default=[], help="run only cases whose name contains one of these")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(s in c for s in args.only)]
    install_truth_hooks()
    return producing.run_cases(PRODUCER, cases, args.out, prepare, run_case)


if __name__ == "__main__":
    sys.exit(main())
