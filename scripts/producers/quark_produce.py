"""Produce FP8, int4, MXFP4 and NVFP4 checkpoints with AMD Quark (``quark.torch``) and its safetensors export.

Standalone producer script: it imports only amd-quark, torch, safetensors, transformers and the standard library,
never the harness. It builds a tiny random-weight Llama in bfloat16 (fixed seed, weights drawn from a seeded
generator so they do not depend on the transformers version's init), takes the scheme's config from Quark's own
``LLMTemplate.get("llama").get_config(scheme=...)``, runs ``ModelQuantizer(config).quantize_model(model, batches)``
with a few random token-id sequences as calibration data (a Qwen3-MoE and a Mixtral of four experts for the MoE
cases, their template's own exclusions: the router), freezes it and writes the checkpoint with
``quark.torch.export_safetensors`` (config.json with quant_method "quark", model.safetensors).

Output: ``OUT/quark/<case>/`` holding the exported checkpoint, ``provenance.json`` and
``producer_truth/weights.safetensors``: each quantized Linear weight as Quark itself reads the exported files back,
float32: ``import_model_from_safetensors`` into a fresh copy of the base model, then each ``QParamsLinear``'s
``_get_qweight(weight)`` (the dequantized weight its forward multiplies by). Failures per case go to
``OUT/quark/FAILED.json``.

Usage: python scripts/producers/quark_produce.py --out DIR [--only SUBSTRING ...]
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
from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors, import_model_from_safetensors  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

PRODUCER = "quark"
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
CALIB_SAMPLES = 4
CALIB_SEQLEN = 32

# case -> (scheme label, LLMTemplate scheme, kv_cache_scheme)
CASES: dict[str, tuple[str, str, str | None]] = {
    "fp8": ("fp8-e4m3 weight and static input, per-tensor scales (bfloat16, 0-D)", "fp8", None),
    "fp8_kv": ("fp8-e4m3 weight and static input per tensor, fp8 KV cache scales", "fp8", "fp8"),
    "ptpc_fp8": ("fp8-e4m3 weight per channel, dynamic per-token fp8 input", "ptpc_fp8", None),
    "int8": ("int8 weight and static input, per-tensor scales and zero points", "int8", None),
    "uint4_wo_128": ("uint4 weight-only, groups of 128, zero points (asymmetric)", "uint4_wo_128", None),
    "int4_wo_128": ("int4 weight-only, groups of 128, symmetric", "int4_wo_128", None),
    "mxfp4": ("OCP MXFP4 weight and dynamic input (e2m1, E8M0 scales per 32)", "mxfp4", None),
    "nvfp4": ("NVFP4 weight and input (e2m1, e4m3 scales per 16, float32 second-level scale)", "nvfp4", None),
    "uint4_wo_per_channel": ("uint4 weight-only, one group per output row, zero points", "uint4_wo_per_channel", None),
    "int4_wo_per_channel": ("int4 weight-only, one group per output row, symmetric", "int4_wo_per_channel", None),
    "int4_fp8": ("int4 weight per group with fp8 input", "int4_fp8", None),
    "mxfp4_fp8": ("OCP MXFP4 weight with fp8 input", "mxfp4_fp8", None),
    "mxfp4_weight_only": ("OCP MXFP4 weight-only (e2m1, E8M0 scales per 32)", "mxfp4_weight_only", None),
    "mxfp4_kv": ("OCP MXFP4 weight and dynamic input, fp8 KV cache scales", "mxfp4", "fp8"),
    "qwen3_moe_fp8": ("fp8-e4m3 weight and static input per tensor; Qwen3-MoE experts", "fp8", None),
    "mixtral_mxfp4": ("OCP MXFP4 weight and dynamic input; Mixtral experts", "mxfp4", None),
}
#: mixtures of 4 experts, top 2
MOE_CONFIG = MODEL_CONFIG | {"num_experts_per_tok": 2}
#: case -> (transformers config class, its model config, LLMTemplate model type) where it is not MODEL_CONFIG's Llama
CASE_MODELS: dict[str, tuple[str, dict, str]] = {
    **{
        f"qwen3_moe_{scheme}": (
            "Qwen3MoeConfig",
            MOE_CONFIG | {"num_experts": 4, "moe_intermediate_size": 128},
            "qwen3_moe",
        )
        for scheme in ("fp8",)
    },
    **{
        f"mixtral_{scheme}": ("MixtralConfig", MOE_CONFIG | {"num_local_experts": 4}, "mixtral")
        for scheme in ("mxfp4",)
    },
}

PACKAGES = ("torch", "amd-quark", "transformers", "accelerate", "safetensors", "huggingface-hub")


def calibration_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        torch.randint(3, MODEL_CONFIG["vocab_size"], (1, CALIB_SEQLEN), generator=generator)
        for _ in range(CALIB_SAMPLES)
    ]


def producer_truth(base_dir: Path, case_dir: Path) -> dict[str, torch.Tensor]:
    """Each quantized Linear's weight as Quark reads the exported files back (float32)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).eval()
    model = import_model_from_safetensors(model, str(case_dir))
    truth = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "_get_qweight") and getattr(module, "weight_quantizer", None) is not None:
                truth[f"{name}.weight"] = module._get_qweight(module.weight).float().contiguous()
    if not truth:
        raise RuntimeError("import_model_from_safetensors left no quantized Linear")
    return truth


def base_model(directory: Path) -> None:
    producing.build_seeded_llama(directory, MODEL_CONFIG, SEED)


def run_case(case: str, base_dir: Path, out_root: Path) -> None:
    if case not in CASE_MODELS:
        quantize_case(case, base_dir, out_root, MODEL_CONFIG, "llama")
        return
    config_class, model_config, model_type = CASE_MODELS[case]
    with tempfile.TemporaryDirectory(prefix=f"{PRODUCER}-{case}-") as scratch:
        producing.build_seeded(Path(scratch) / "base", config_class, model_config, SEED)
        quantize_case(case, Path(scratch) / "base", out_root, model_config, model_type)


def quantize_case(case: str, base_dir: Path, out_root: Path, model_config: dict, model_type: str) -> None:
    scheme, template_scheme, kv_scheme = CASES[case]
    case_dir = out_root / PRODUCER / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    started = time.time()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).eval()
    config = LLMTemplate.get(model_type).get_config(scheme=template_scheme, kv_cache_scheme=kv_scheme)
    quantizer = ModelQuantizer(config)
    model = quantizer.quantize_model(model, calibration_batches())
    model = quantizer.freeze(model)
    export_safetensors(model, output_dir=str(case_dir))
    files = producing.digests(case_dir)
    try:
        truth = producer_truth(base_dir, case_dir)
    except ValueError as error:  # Quark cannot read its own export back: the case has no producer truth
        truth = None
        unreadable = str(error).splitlines()[0][:300]
    if truth is not None:
        (case_dir / "producer_truth").mkdir()
        save_file(truth, case_dir / "producer_truth" / "weights.safetensors")
    notes = [
        f"base model: tiny random {model.config.architectures[0]}, bfloat16, weights ~ N(0, 0.02) from torch.Generator(seed), norms = 1",
        f"calibration: {CALIB_SAMPLES} random token-id sequences of length {CALIB_SEQLEN} (seed {SEED + 1})",
        "producer_truth: import_model_from_safetensors(fresh base model, case_dir), then each QParamsLinear's "
        "_get_qweight(weight): Quark's own reading of the exported files"
        if truth is not None
        else f"no producer_truth: import_model_from_safetensors refuses Quark's own export: {unreadable}",
        f"elapsed_s={time.time() - started:.2f}",
    ]
    provenance = {
        "producer": "amd-quark",
        "producer_version": importlib.metadata.version("amd-quark"),
        "packages": producing.package_versions(PACKAGES),
        "case": case,
        "arch": model.config.architectures[0],
        "scheme": scheme,
        "recipe": {
            "template": f"quark.torch.LLMTemplate.get({model_type!r}).get_config(scheme={template_scheme!r}, "
            f"kv_cache_scheme={kv_scheme!r})",
            "calibration": {"samples": CALIB_SAMPLES, "seqlen": CALIB_SEQLEN, "seed": SEED + 1},
            "export": "quark.torch.export_safetensors(quantizer.freeze(model), output_dir=case_dir)",
            "model_config": model_config,
        },
        "command": " ".join([sys.executable, *sys.argv]),
        "seed": SEED,
        "files": files,
        "notes": notes,
    }
    (case_dir / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")


def main() -> int:
    out, cases = producing.chosen_cases(__doc__, PRODUCER, CASES)
    return producing.run_cases(PRODUCER, cases, out, base_model, run_case)


if __name__ == "__main__":
    sys.exit(main())
