"""Produce per-tensor FP8 checkpoints with AutoFP8 (neuralmagic/AutoFP8), the writer of the 2024 hub `*-FP8` models.

Standalone producer script: it imports only torch, safetensors, transformers, AutoFP8 (``auto_fp8``) and the
standard library, never the harness. It builds a tiny random-weight model in bfloat16 (fixed seed, weights drawn from
a seeded generator), wraps it in ``AutoFP8ForCausalLM(model, BaseQuantizeConfig(...))``, runs AutoFP8's own
``quantize`` (``per_tensor_quantize`` on every Linear but the head; for a static scheme the calibration forwards that
record each input's per-tensor scale; for a KV-cache scheme k_proj's and v_proj's output scales) and its own
``save_quantized_model``: ``quant_method: fp8`` without ``weight_block_size`` (vLLM's per-tensor FP8), 0-D
``weight_scale`` and ``input_scale``.

AutoFP8 is archived and was never on PyPI: its environment installs a checkout named by ``AUTOFP8_SOURCE``
(requirements-autofp8.txt). Bypasses, each recorded in provenance.json: ``AutoFP8ForCausalLM.from_pretrained`` is not
used (it passes loading arguments transformers 5 no longer takes); the model is built as every producer script builds
it and handed to the wrapper's constructor. ``save_quantized_model`` ends by copying the tokenizer from the model's
``_name_or_path``; the base model has none, so that one call is a no-op here. Quantization and saving are AutoFP8's
unchanged code.

Output: ``OUT/autofp8/<case>/`` holding the checkpoint as saved, ``provenance.json`` and
``producer_truth/weights.safetensors`` (each quantized Linear's weight as AutoFP8's own ``fp8_gemm`` applies it:
the codes times ``weight_scale``, here in float32). Failures per case go to ``OUT/autofp8/FAILED.json``.

Usage: python scripts/producers/autofp8_produce.py --out DIR [--only SUBSTRING ...]
"""

from __future__ import annotations

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
from auto_fp8 import quantize as autofp8_quantize  # noqa: E402
from auto_fp8.config import BaseQuantizeConfig  # noqa: E402
from auto_fp8.modeling import AutoFP8ForCausalLM  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

PRODUCER = "autofp8"
SEED = 0
MODEL_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
ARCHES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
#: calibration: this many sequences of this many seeded random token ids
CALIBRATION = (4, 32)

# case -> (scheme label, architecture, BaseQuantizeConfig keyword arguments)
CASES: dict[str, tuple[str, str, dict]] = {
    "fp8_dynamic": ("fp8-e4m3 weight per tensor, dynamic activations", "llama", {"activation_scheme": "dynamic"}),
    "fp8_static": (
        "fp8-e4m3 weight per tensor, static activations per tensor",
        "llama",
        {"activation_scheme": "static"},
    ),
    "qwen2_fp8_static": (
        "fp8-e4m3 weight per tensor, static activations per tensor, q/k/v biases",
        "qwen2",
        {"activation_scheme": "static"},
    ),
    "fp8_static_kv": (
        "fp8-e4m3 weight per tensor, static activations, static FP8 KV cache (k_proj/v_proj output scales)",
        "llama",
        {"activation_scheme": "static", "kv_cache_quant_targets": ("k_proj", "v_proj")},
    ),
}
PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "auto_fp8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class NoTokenizer:
    """Stands in for AutoTokenizer in save_quantized_model: the base model has no tokenizer to copy."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        return NoTokenizer()

    def save_pretrained(self, *args, **kwargs):
        return None


def producer_truth(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each AutoFP8 Linear's weight as its fp8_gemm applies it (codes x weight_scale), float32."""
    truth = {}
    for name, module in model.named_modules():
        if isinstance(module, (autofp8_quantize.FP8DynamicLinear, autofp8_quantize.FP8StaticLinear)):
            weight = module.weight.detach().to(torch.float32) * module.weight_scale.detach().to(torch.float32)
            truth[f"{name}.weight"] = weight.contiguous()
    return truth


def base_model(directory: Path) -> None:
    producing.build_seeded_llama(directory, MODEL_CONFIG, SEED)


def run_case(case: str, llama_dir: Path, out_root: Path) -> None:
    scheme, arch, kwargs = CASES[case]
    case_dir = out_root / PRODUCER / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="autofp8-base-") as scratch:
        base_dir = llama_dir
        if arch != "llama":
            base_dir = Path(scratch) / arch
            producing.build_seeded(base_dir, ARCHES[arch][0], MODEL_CONFIG, SEED)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, device_map="cpu").eval()
    quantize_config = BaseQuantizeConfig(quant_method="fp8", ignore_patterns=["re:.*lm_head"], **kwargs)
    wrapper = AutoFP8ForCausalLM(model, quantize_config)
    generator = torch.Generator().manual_seed(SEED)
    calibration = torch.randint(0, MODEL_CONFIG["vocab_size"], CALIBRATION, generator=generator)
    wrapper.quantize(calibration if kwargs.get("activation_scheme") == "static" else None)
    truth = producer_truth(wrapper.model)
    if not truth:
        raise RuntimeError("no AutoFP8 Linear after quantize")
    autofp8_quantize.AutoTokenizer = NoTokenizer
    wrapper.save_quantized(str(case_dir))
    for name in TOKENIZER_FILES:
        (case_dir / name).unlink(missing_ok=True)
    files = producing.digests(case_dir)
    (case_dir / "producer_truth").mkdir()
    save_file(truth, case_dir / "producer_truth" / "weights.safetensors")
    provenance = {
        "producer": "autofp8",
        "producer_version": importlib.metadata.version("auto_fp8"),
        "packages": producing.package_versions(PACKAGES),
        "case": case,
        "arch": ARCHES[arch][1],
        "scheme": scheme,
        "recipe": {
            "quantize_config": {"quant_method": "fp8", "ignore_patterns": ["re:.*lm_head"], **kwargs},
            "calibration": {"sequences": CALIBRATION[0], "tokens": CALIBRATION[1], "ids": "uniform, seeded"},
            "from_pretrained": {"dtype": "bfloat16", "device_map": "cpu"},
            "model_config": MODEL_CONFIG,
        },
        "command": " ".join([sys.executable, *sys.argv]),
        "seed": SEED,
        "files": files,
        "notes": [
            f"base model: tiny random {arch}, bfloat16, weights ~ N(0, 0.02) from torch.Generator(seed), norms = 1",
            "AutoFP8 at github.com/neuralmagic/AutoFP8 505a7ed (its last commit), installed from AUTOFP8_SOURCE",
            "AutoFP8ForCausalLM built from the loaded model (its from_pretrained passes arguments transformers 5 "
            "refuses); save_quantized_model's tokenizer copy a no-op (no tokenizer in the base model)",
            "producer_truth: codes x weight_scale of each FP8DynamicLinear / FP8StaticLinear after quantize, float32",
            f"elapsed_s={time.time() - started:.2f}",
        ],
    }
    (case_dir / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")


def main() -> int:
    out, cases = producing.chosen_cases(__doc__, PRODUCER, CASES)
    return producing.run_cases(PRODUCER, cases, out, base_model, run_case)


if __name__ == "__main__":
    sys.exit(main())
