"""Produce FP8 checkpoints with transformers' own quantize-on-load (``FineGrainedFP8Config``) and ``save_pretrained``.

Standalone producer script: it imports only torch, safetensors, transformers (and accelerate through it) and the
standard library, never the harness. It builds a tiny random-weight Llama in bfloat16 (fixed seed, weights drawn
from a seeded generator so they do not depend on the transformers version's init), loads it back through
``AutoModelForCausalLM.from_pretrained(..., quantization_config=FineGrainedFP8Config(...))`` so transformers itself
quantizes every Linear to float8_e4m3fn with blockwise ``weight_scale_inv``, and saves it with ``save_pretrained``.

CPU note: transformers' ``FineGrainedFP8HfQuantizer.validate_environment`` refuses to quantize without a GPU/XPU
("No GPU or XPU found. A GPU or XPU is needed for FP8 quantization."). Where neither is present this script replaces
that one check with a no-op; the quantization itself (``Fp8Quantize`` through the weight-conversion pipeline) and the
serialization are transformers' unchanged code. Each case's provenance.json says whether the bypass was applied.

Output: ``OUT/transformers_fp8/<case>/`` holding the checkpoint as saved, ``provenance.json`` and
``producer_truth/weights.safetensors`` (each quantized weight dequantized to float32 by transformers' own
``integrations.finegrained_fp8._dequantize_fp8_weight``, applied to the in-memory FP8Linear's weight and scale).
Failures per case go to ``OUT/transformers_fp8/FAILED.json``.

Usage: python scripts/producers/transformers_fp8_produce.py --out DIR [--only SUBSTRING ...]
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import producing  # noqa: E402  (beside this script)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, FineGrainedFP8Config  # noqa: E402
from transformers.integrations import finegrained_fp8  # noqa: E402
from transformers.quantizers import quantizer_finegrained_fp8  # noqa: E402

PRODUCER = "transformers_fp8"
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

# case -> (scheme label, FineGrainedFP8Config keyword arguments)
CASES: dict[str, tuple[str, dict]] = {
    "fp8_block128": ("fp8-e4m3 weight, 128x128 blocks, float scale_inv, dynamic activations", {}),
    "fp8_block64": (
        "fp8-e4m3 weight, 64x64 blocks, float scale_inv, dynamic activations",
        {"weight_block_size": [64, 64]},
    ),
    "fp8_block128_ue8m0": (
        "fp8-e4m3 weight, 128x128 blocks, ue8m0 scale_inv, dynamic activations",
        {"scale_fmt": "ue8m0"},
    ),
    "fp8_per_tensor": ("fp8-e4m3 weight, one scale per tensor (weight_block_size=None)", {"weight_block_size": None}),
}


PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "huggingface-hub")


def bypass_cpu_refusal() -> bool:
    """Skip validate_environment's GPU/XPU requirement when neither exists; return whether it was bypassed."""
    xpu = getattr(torch, "xpu", None)
    if torch.cuda.is_available() or (xpu is not None and xpu.is_available()):
        return False
    quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None
    return True


def producer_truth(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Each FP8Linear's weight as transformers computes with it, float32, under its checkpoint name.

    FP8 weights are dequantized by transformers' own helper. An FP8Linear whose shape does not tile by the block
    size keeps its unquantized bfloat16 weight (Fp8Quantize passes it through, and FP8Linear.forward then runs a
    plain F.linear): its truth is that weight, and its name is returned in the second list.
    """
    truth, unquantized = {}, []
    for name, module in model.named_modules():
        if not isinstance(module, finegrained_fp8.FP8Linear):
            continue
        weight = module.weight.detach().clone()
        if weight.element_size() == 1:
            weight = finegrained_fp8._dequantize_fp8_weight(
                weight, module.weight_scale_inv.detach(), module.block_size, torch.float32
            )
        else:
            unquantized.append(name)
        truth[f"{name}.weight"] = weight.float().contiguous()
    return truth, unquantized


def base_model(directory: Path) -> None:
    producing.build_seeded_llama(directory, MODEL_CONFIG, SEED)


def run_case(case: str, base_dir: Path, out_root: Path, bypassed: bool) -> None:
    scheme, kwargs = CASES[case]
    case_dir = out_root / PRODUCER / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    started = time.time()
    quant_config = FineGrainedFP8Config(**kwargs)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=quant_config, dtype=torch.bfloat16, device_map="cpu"
    )
    truth, unquantized = producer_truth(model)
    if len(truth) == len(unquantized):
        raise RuntimeError("no FP8Linear module holds an FP8 weight after loading")
    model.save_pretrained(case_dir)
    for name in TOKENIZER_FILES:
        (case_dir / name).unlink(missing_ok=True)
    files = producing.digests(case_dir)
    (case_dir / "producer_truth").mkdir()
    save_file(truth, case_dir / "producer_truth" / "weights.safetensors")
    notes = [
        "base model: tiny random Llama, bfloat16, weights ~ N(0, 0.02) from torch.Generator(seed), norms = 1",
        "producer_truth: transformers.integrations.finegrained_fp8._dequantize_fp8_weight(weight, weight_scale_inv, "
        "block_size, float32) on the in-memory FP8Linear modules right after quantize-on-load",
        f"elapsed_s={time.time() - started:.2f}",
    ]
    if unquantized:
        notes.append(
            "left unquantized by transformers (shape does not tile by weight_block_size; saved as bfloat16 weight "
            "next to a weight_scale_inv that the load report calls MISSING, i.e. uninitialized memory, so this "
            "case's file hash is not reproducible): " + ", ".join(unquantized)
        )
    if bypassed:
        notes.append(
            "no GPU/XPU: FineGrainedFP8HfQuantizer.validate_environment (which raises 'No GPU or XPU found. A GPU "
            "or XPU is needed for FP8 quantization.') was replaced by a no-op; quantization code unchanged"
        )
    provenance = {
        "producer": "transformers",
        "producer_version": importlib.metadata.version("transformers"),
        "packages": producing.package_versions(PACKAGES),
        "case": case,
        "arch": ARCH,
        "scheme": scheme,
        "recipe": {
            "quantization_config": quant_config.to_dict(),
            "from_pretrained": {"dtype": "bfloat16", "device_map": "cpu"},
            "model_config": MODEL_CONFIG,
            "validate_environment_bypassed": bypassed,
        },
        "command": " ".join([sys.executable, *sys.argv]),
        "seed": SEED,
        "files": files,
        "notes": notes,
    }
    (case_dir / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")


def main() -> int:
    out, cases = producing.chosen_cases(__doc__, PRODUCER, CASES)
    bypassed = bypass_cpu_refusal()
    return producing.run_cases(
        PRODUCER, cases, out, base_model, lambda case, base, root: run_case(case, base, root, bypassed)
    )


if __name__ == "__main__":
    sys.exit(main())
