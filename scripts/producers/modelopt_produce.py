"""Produce FP8 and NVFP4 checkpoints with NVIDIA ModelOpt (``modelopt.torch.quantization``) and its HF export.

Standalone producer script: it imports only nvidia-modelopt, torch, safetensors, transformers and the standard
library, never the harness. It builds a tiny random-weight Llama in bfloat16 (fixed seed, weights drawn from a seeded
generator so they do not depend on the transformers version's init), runs ``mtq.quantize(model, CONFIG,
forward_loop)`` with a few random token-id sequences as calibration data, and writes the checkpoint with
``modelopt.torch.export.export_hf_checkpoint`` (config.json with quant_method "modelopt", hf_quant_config.json,
model.safetensors).

Output: ``OUT/modelopt/<case>/`` holding the exported checkpoint, ``provenance.json`` and
``producer_truth/weights.safetensors``: each quantized Linear weight as ModelOpt itself dequantizes it, float32,
taken from the in-memory calibrated model before export. Where the weight quantizer's fake-quant runs on CPU (FP8
configs) that is ``module.weight_quantizer(module.weight)``; where it needs CUDA (NVFP4's dynamic block fake-quant),
it is ModelOpt's export-side quantization (``NVFP4QTensor.quantize`` with the scales from
``modelopt.torch.export.quant_utils``) followed by ``NVFP4QTensor.dequantize``. provenance.json names the method.
Failures per case go to ``OUT/modelopt/FAILED.json``.

Usage: python scripts/producers/modelopt_produce.py --out DIR [--only SUBSTRING ...]
"""

from __future__ import annotations

import copy
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

import modelopt.torch.quantization as mtq  # noqa: E402
import producing  # noqa: E402  (beside this script)
import torch  # noqa: E402
from modelopt.torch.export import export_hf_checkpoint, quant_utils  # noqa: E402
from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

PRODUCER = "modelopt"
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

# case -> (scheme label, name of the mtq config constant)
CASES: dict[str, tuple[str, str]] = {
    "fp8": ("fp8-e4m3 weight and static input, per-tensor scales", "FP8_DEFAULT_CFG"),
    "fp8_pc_pt": ("fp8-e4m3 weight per-channel, dynamic per-token input", "FP8_PER_CHANNEL_PER_TOKEN_CFG"),
    "fp8_pb_wo": ("fp8-e4m3 weight-only, 2D 128x128 blockwise", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"),
    "nvfp4": ("nvfp4 (e2m1, fp8 block-16 scales + fp32 global) weight and input", "NVFP4_DEFAULT_CFG"),
    "w4a16_nvfp4": ("nvfp4 weight-only", "W4A16_NVFP4_CFG"),
    "nvfp4_awq_lite": ("nvfp4 weight and input with AWQ-lite pre-quant scaling", "NVFP4_AWQ_LITE_CFG"),
    "fp8_pb_wo_partial": (
        "fp8-e4m3 weight-only, 2D 128x128 blockwise, widths not multiples of 128",
        "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    ),
    "qwen3_moe_fp8": ("fp8-e4m3 weight and static input, per-tensor scales; Qwen3-MoE experts", "FP8_DEFAULT_CFG"),
    "qwen3_moe_nvfp4": ("nvfp4 weight and input; Qwen3-MoE experts", "NVFP4_DEFAULT_CFG"),
    "mixtral_fp8": ("fp8-e4m3 weight and static input, per-tensor scales; Mixtral experts", "FP8_DEFAULT_CFG"),
    "mixtral_nvfp4": ("nvfp4 weight and input; Mixtral experts", "NVFP4_DEFAULT_CFG"),
    "fp8_attn_nvfp4_mlp": ("MIXED_PRECISION: fp8 attention, nvfp4 MLP (weight and input)", "FP8_DEFAULT_CFG"),
}
#: mixed precision: case -> (module pattern, mtq config whose weight and input quantizers it takes), rules
#: appended to the case's own config (ModelOpt applies them in order: the last that names a quantizer wins)
MIXED_RULES: dict[str, list[tuple[str, str]]] = {"fp8_attn_nvfp4_mlp": [("*mlp*", "NVFP4_DEFAULT_CFG")]}
#: mixtures of 4 experts, top 2 (nvidia's FP4 releases are mostly MoE)
MOE_CONFIG = MODEL_CONFIG | {"num_experts_per_tok": 2}
#: case -> (transformers config class, model) where it is not a Llama of MODEL_CONFIG: widths 192
#: and 320 leave the last 128 x 128 block of every weight partial along its rows, its columns or both
CASE_MODELS: dict[str, tuple[str, dict]] = {
    "fp8_pb_wo_partial": (
        "LlamaConfig",
        MODEL_CONFIG | {"hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 6},
    ),
    **{
        f"qwen3_moe_{scheme}": ("Qwen3MoeConfig", MOE_CONFIG | {"num_experts": 4, "moe_intermediate_size": 128})
        for scheme in ("fp8", "nvfp4")
    },
    **{f"mixtral_{scheme}": ("MixtralConfig", MOE_CONFIG | {"num_local_experts": 4}) for scheme in ("fp8", "nvfp4")},
}


PACKAGES = ("torch", "nvidia-modelopt", "transformers", "accelerate", "safetensors", "huggingface-hub")


def jsonable(value: object) -> object:
    """A JSON-safe copy of a recipe: dict keys as strings (ModelOpt's block_sizes mix int and str keys)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def calibration_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        torch.randint(3, MODEL_CONFIG["vocab_size"], (1, CALIB_SEQLEN), generator=generator)
        for _ in range(CALIB_SAMPLES)
    ]


def nvfp4_export_dequant(module: torch.nn.Module) -> torch.Tensor:
    """ModelOpt's export-side NVFP4 quantization of one weight, dequantized by NVFP4QTensor itself."""
    block = quant_utils.get_weight_block_size(module)
    scale = quant_utils.get_weight_scaling_factor(module)
    scale_2 = quant_utils.get_weight_scaling_factor_2(module)
    qtensor, scale, scale_2 = NVFP4QTensor.quantize(module.weight, block, scale, scale_2)
    return qtensor.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: block})


def dequantized(module: torch.nn.Module) -> tuple[torch.Tensor, str]:
    """A module's `weight` as its `weight_quantizer` gives it (float32), and how."""
    try:
        return module.weight_quantizer(module.weight).float(), "weight_quantizer fake-quant"
    except AssertionError:  # dynamic block (NVFP4) fake-quant asserts CUDA tensors
        return nvfp4_export_dequant(module).float(), "NVFP4QTensor.quantize + dequantize (export path)"


def projection(weight: torch.Tensor, weight_quantizer, input_quantizer) -> torch.nn.Module:
    """One expert's slice of a fused 3-D parameter as a module of ModelOpt's Linear attributes."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    module.weight_quantizer, module.input_quantizer = weight_quantizer, input_quantizer
    return module


def expert_truth(name: str, experts: torch.nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    """transformers 5's fused experts (ModelOpt's _QuantFusedExperts: one weight quantizer per expert
    and projection): each expert's gate/up/down as its quantizer gives it, under the names the
    export splits them into (gate_up_proj rows: gate first, then up)."""
    truth = {}
    rows = experts.gate_up_proj.shape[1] // 2
    for index in range(experts.num_experts):
        gate_up, how = dequantized(
            projection(
                experts.gate_up_proj[index],
                experts.gate_up_proj_weight_quantizers[index],
                experts.gate_up_proj_input_quantizer,
            )
        )
        down = dequantized(
            projection(
                experts.down_proj[index], experts.down_proj_weight_quantizers[index], experts.down_proj_input_quantizer
            )
        )
        truth[f"{name}.{index}.gate_proj.weight"] = (gate_up[:rows], how)
        truth[f"{name}.{index}.up_proj.weight"] = (gate_up[rows:], how)
        truth[f"{name}.{index}.down_proj.weight"] = down
    return truth


def producer_truth(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each quantized Linear's and expert projection's weight as ModelOpt dequantizes it (float32),
    and the method used per weight."""
    found = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "gate_up_proj_weight_quantizers"):
                found |= expert_truth(name, module)
                continue
            quantizer = getattr(module, "weight_quantizer", None)
            if quantizer is not None and quantizer.is_enabled:
                found[f"{name}.weight"] = dequantized(module)
    truth = {key: weight.contiguous() for key, (weight, _) in found.items()}
    return truth, {key.removesuffix(".weight"): how for key, (_, how) in found.items()}


def base_model(directory: Path) -> None:
    producing.build_seeded_llama(directory, MODEL_CONFIG, SEED)


def run_case(case: str, base_dir: Path, out_root: Path) -> None:
    if case not in CASE_MODELS:
        quantize_case(case, base_dir, out_root, MODEL_CONFIG)
        return
    config_class, model_config = CASE_MODELS[case]
    with tempfile.TemporaryDirectory(prefix=f"{PRODUCER}-{case}-") as scratch:
        producing.build_seeded(Path(scratch) / "base", config_class, model_config, SEED)
        quantize_case(case, Path(scratch) / "base", out_root, model_config)


def mixed(case: str, quant_cfg: dict) -> dict:
    """`quant_cfg` with the case's MIXED_RULES appended: each pattern's weight and input quantizers as
    another config sets them."""
    for pattern, config_name in MIXED_RULES.get(case, []):
        for rule in getattr(mtq, config_name)["quant_cfg"]:
            name = rule.get("quantizer_name", "")
            if name in ("*weight_quantizer", "*input_quantizer") and "cfg" in rule:
                quant_cfg["quant_cfg"].append({**copy.deepcopy(rule), "quantizer_name": pattern + name[1:]})
    return quant_cfg


def quantize_case(case: str, base_dir: Path, out_root: Path, model_config: dict) -> None:
    scheme, config_name = CASES[case]
    case_dir = out_root / PRODUCER / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    started = time.time()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    model.eval()
    quant_cfg = mixed(case, copy.deepcopy(getattr(mtq, config_name)))
    batches = calibration_batches()

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for batch in batches:
                m(batch)

    model = mtq.quantize(model, copy.deepcopy(quant_cfg), forward_loop=forward_loop)
    truth, methods = producer_truth(model)
    if not truth:
        raise RuntimeError("mtq.quantize left no enabled weight quantizer")
    export_hf_checkpoint(model, export_dir=case_dir)
    files = producing.digests(case_dir)
    (case_dir / "producer_truth").mkdir()
    save_file(
        producing.saved_names(truth, case_dir, producing.MIXTRAL_SAVED_PARTS),
        case_dir / "producer_truth" / "weights.safetensors",
    )
    method_names = sorted(set(methods.values()))
    notes = [
        f"base model: tiny random {model.config.architectures[0]}, bfloat16, weights ~ N(0, 0.02) from torch.Generator(seed), norms = 1",
        f"calibration: {CALIB_SAMPLES} random token-id sequences of length {CALIB_SEQLEN} (seed {SEED + 1})",
        "producer_truth (from the in-memory quantized model, before export): " + "; ".join(method_names),
        "caveat: producer_truth is ModelOpt's pre-export view; export_hf_checkpoint re-derives the quantized "
        "weights (nvfp4: one weight_scale_2 shared by q/k/v and by gate/up; fp8: division in float32 where the "
        "fake-quant rounds in bfloat16), so the checkpoint decodes to values one quantization step away from it "
        "on part of the elements (about 3% for fp8, 27% for nvfp4 on this model); the export also turns the "
        "in-memory weights into the packed format, so no post-export view exists",
        f"elapsed_s={time.time() - started:.2f}",
    ]
    provenance = {
        "producer": "nvidia-modelopt",
        "producer_version": importlib.metadata.version("nvidia-modelopt"),
        "packages": producing.package_versions(PACKAGES),
        "case": case,
        "arch": model.config.architectures[0],
        "scheme": scheme,
        "recipe": {
            "config_name": f"modelopt.torch.quantization.{config_name}",
            "quant_cfg": jsonable(quant_cfg),
            "calibration": {"samples": CALIB_SAMPLES, "seqlen": CALIB_SEQLEN, "seed": SEED + 1},
            "export": "modelopt.torch.export.export_hf_checkpoint(model, export_dir=case_dir)",
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
