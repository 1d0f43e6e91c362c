"""Produce GPTQ (v1 and v2 checkpoint formats) and AWQ int checkpoints with GPTQModel, quantizing on CPU.

Standalone producer script: it imports only gptqmodel, torch, safetensors, transformers (with tokenizers) and the
standard library, never the harness. It builds the tiny random-weight Llama the other producers use (bfloat16, fixed
seed, weights from a seeded generator) and a minimal offline WordLevel tokenizer (GPTQModel loads one beside the
model), then runs ``GPTQModel.load(base, QuantizeConfig(...), device="cpu").quantize([random token-id sequences],
batch_size=4)`` and ``.save(dir)``. GPTQModel 7.6.0 is the newest release that installs beside torch 2.13 (7.7.0 asks
for torch>=2.14.1); it runs GPTQ's Hessian-based quantization on CPU.

Output: ``OUT/gptqmodel/<case>/`` holding the checkpoint as GPTQModel saves it (tokenizer files and the timing log
``quant_log.csv`` removed), ``provenance.json`` and ``producer_truth/weights.safetensors``: each quantized Linear's
weight as GPTQModel holds it in memory right after quantizing it (the ``Q`` that ``GPTQ.quantize`` returns, which
GPTQModel casts to the module's dtype, bfloat16 here), captured by wrapping ``gptqmodel.quantization.gptq.GPTQ.quantize``
(observation only). The AWQ case has no such truth (its path does not go through ``GPTQ.quantize``). Failures per case
go to ``OUT/gptqmodel/FAILED.json``.

Usage: python scripts/producers/gptqmodel_produce.py --out DIR [--only SUBSTRING ...]
"""

from __future__ import annotations

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
# GPTQModel sizes its CPU worker pool at (cores + 1) // 2 and then asks for 2 loader workers on it: on a 2-core machine
# quantize() fails with "Virtual pool 'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1".
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import producing  # noqa: E402  (beside this script)
import torch  # noqa: E402
from gptqmodel import GPTQModel, QuantizeConfig  # noqa: E402
from gptqmodel.quantization.gptq import GPTQ  # noqa: E402
from gptqmodel.utils.backend import BACKEND  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

PRODUCER = "gptqmodel"
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DROPPED_FILES = ("quant_log.csv",)  # per-module loss and wall time: the time differs run to run
CALIB_SAMPLES = 8
CALIB_SEQLEN = 32

#: every case: no disk offload (its temporary path would land in the saved config)
COMMON_CONFIG = {"offload_to_disk": False}
# case -> (scheme label, QuantizeConfig keyword arguments)
CASES: dict[str, tuple[str, dict]] = {
    "w4g128_sym_gptq": (
        "GPTQ int4 sym, group 128, desc_act False (GPTQModel's default act_group_aware)",
        {"bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    ),
    "w4g128_asym_gptq": (
        "GPTQ int4 asym, group 128, desc_act False",
        {"bits": 4, "group_size": 128, "sym": False, "desc_act": False},
    ),
    "w4g32_sym_descact_gptq": (
        "GPTQ int4 sym, group 32, desc_act True (act-order: g_idx not trivial)",
        {"bits": 4, "group_size": 32, "sym": True, "desc_act": True, "act_group_aware": False},
    ),
    "w8g128_sym_gptq": (
        "GPTQ int8 sym, group 128, desc_act False",
        {"bits": 8, "group_size": 128, "sym": True, "desc_act": False},
    ),
    "w4_perchannel_sym_gptq": (
        "GPTQ int4 sym, per channel (group_size -1), desc_act False",
        # act_group_aware (GPTQModel's default for GPTQ) refuses group_size -1
        {"bits": 4, "group_size": -1, "sym": True, "desc_act": False, "act_group_aware": False},
    ),
    "w4g128_asym_gptq_v2": (
        "GPTQ int4 asym, group 128, saved as checkpoint_format gptq_v2 (zeros stored without the v1 -1 offset)",
        {"bits": 4, "group_size": 128, "sym": False, "desc_act": False, "format": "gptq_v2"},
    ),
    "w4g128_asym_awq_gemm": (
        "AWQ int4 asym (zero point), group 128, GEMM layout",
        {"quant_method": "awq", "bits": 4, "group_size": 128, "sym": False, "format": "gemm"},
    ),
    "qwen3_moe_w4g128_sym_gptq": (
        "GPTQ int4 sym, group 128, desc_act False, of a Qwen3-MoE",
        {"bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    ),
    "qwen3_moe_w4g32_asym_descact_gptq": (
        "GPTQ int4 asym, group 32, desc_act True (each expert its own g_idx), of a Qwen3-MoE",
        {"bits": 4, "group_size": 32, "sym": False, "desc_act": True, "act_group_aware": False},
    ),
    "w4g128_mlp_w8g32_dynamic_gptq": (
        "GPTQ int4 sym group 128, the MLP int8 group 32 by a `dynamic` override (GPTQModel's per-module bits)",
        {
            "bits": 4,
            "group_size": 128,
            "sym": True,
            "desc_act": False,
            "dynamic": {"+:.*\\.mlp\\..*": {"bits": 8, "group_size": 32}},
        },
    ),
    "mixtral_w4g128_sym_gptq": (
        "GPTQ int4 sym, group 128, desc_act False, of a Mixtral",
        {"bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    ),
}
#: mixtures of 4 experts, top 2, one layer: a case whose name starts with one of these keys quantizes
#: that model (transformers' config class, its config), any other the Llama
MOE_MODELS = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            **MODEL_CONFIG,
            "num_hidden_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {**MODEL_CONFIG, "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}

# case -> quantize() keyword arguments: AWQ's automatic backend is the CUDA-only AwqGEMMLinear ("AWQ: CUDA is not
# available."); the portable torch kernel packs the same GEMM layout on CPU
QUANTIZE_KWARGS: dict[str, dict] = {"w4g128_asym_awq_gemm": {"backend": BACKEND.AWQ_TORCH}}

PACKAGES = ("torch", "gptqmodel", "transformers", "accelerate", "safetensors", "tokenizers", "huggingface-hub")


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


def calibration_data() -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        {
            "input_ids": torch.randint(3, MODEL_CONFIG["vocab_size"], (CALIB_SEQLEN,), generator=generator).tolist(),
            "attention_mask": [1] * CALIB_SEQLEN,
        }
        for _ in range(CALIB_SAMPLES)
    ]


CAPTURED: dict[str, torch.Tensor] = {}


def install_truth_hooks() -> None:
    """Record the quantize-dequantize weight GPTQ.quantize returns for each module (observation only)."""
    original = GPTQ.quantize

    @functools.wraps(original)
    def quantize(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        named = getattr(self, "_named_module", None)
        name = getattr(named, "full_name", None)
        if name is not None and isinstance(result, tuple) and isinstance(result[0], torch.Tensor):
            CAPTURED[f"{name}.weight"] = result[0].detach().cpu().clone().contiguous()
        return result

    GPTQ.quantize = quantize


def prepare(directory: Path) -> None:
    """The base model and the offline tokenizer GPTQModel loads beside it."""
    producing.build_seeded_llama(directory, MODEL_CONFIG, SEED)
    save_tokenizer(directory)


def run_case(case: str, base_dir: Path, out_root: Path) -> None:
    arch = next((arch for arch in MOE_MODELS if case.startswith(f"{arch}_")), None)
    if arch is None:
        quantize_case(case, base_dir, out_root, MODEL_CONFIG)
        return
    config_class, model_config = MOE_MODELS[arch]
    with tempfile.TemporaryDirectory(prefix=f"{PRODUCER}-{arch}-") as scratch:
        base = Path(scratch) / "base"
        producing.build_seeded(base, config_class, model_config, SEED)
        save_tokenizer(base)
        quantize_case(case, base, out_root, model_config)


def quantize_case(case: str, base_dir: Path, out_root: Path, model_config: dict) -> None:
    scheme, kwargs = CASES[case]
    architecture = json.loads((base_dir / "config.json").read_text())["architectures"][0]
    case_dir = out_root / PRODUCER / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    started = time.time()
    CAPTURED.clear()
    torch.manual_seed(SEED)
    config = QuantizeConfig(**COMMON_CONFIG, **kwargs)
    quantize_kwargs = QUANTIZE_KWARGS.get(case, {})
    cwd = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="gptqmodel-save-") as tmp:
        os.chdir(tmp)  # GPTQModel writes its per-run logs under ./logs/: keep them out of the repository
        try:
            model = GPTQModel.load(str(base_dir), config, device="cpu")
            model.quantize(calibration_data(), batch_size=4, **quantize_kwargs)
            model.save(str(Path(tmp) / "saved"))
            del model
        finally:
            os.chdir(cwd)
        shutil.copytree(Path(tmp) / "saved", case_dir)
    for name in (*TOKENIZER_FILES, *DROPPED_FILES):
        (case_dir / name).unlink(missing_ok=True)
    files = producing.digests(case_dir)
    if CAPTURED:
        (case_dir / "producer_truth").mkdir()
        save_file(dict(sorted(CAPTURED.items())), case_dir / "producer_truth" / "weights.safetensors")
    notes = [
        f"base model: tiny random {architecture}, bfloat16, weights ~ N(0, 0.02) from torch.Generator(seed), norms = 1",
        f"calibration: {CALIB_SAMPLES} random token-id sequences of length {CALIB_SEQLEN} (seed {SEED + 1})",
        "tokenizer: local WordLevel tokenizer; its files and GPTQModel's quant_log.csv (per-module wall times) are "
        "removed from the output",
        f"GPTQMODEL_CPU_WORKERS={os.environ.get('GPTQMODEL_CPU_WORKERS')} (GPTQModel's pool fails on 2 cores without)",
        f"elapsed_s={time.time() - started:.2f}",
    ]
    if CAPTURED:
        notes.append(
            "producer_truth: the Q that gptqmodel.quantization.gptq.GPTQ.quantize returns for each Linear (computed in "
            "float32, cast by GPTQModel to the module dtype, bfloat16); the saved scales are float16, so a weight may "
            "sit one bfloat16 step from the saved files' dequantization"
        )
    else:
        notes.append("no producer_truth: this method's path does not go through GPTQ.quantize")
    provenance = {
        "producer": "gptqmodel",
        "producer_version": importlib.metadata.version("gptqmodel"),
        "packages": producing.package_versions(PACKAGES),
        "case": case,
        "arch": architecture,
        "scheme": scheme,
        "recipe": {
            "QuantizeConfig": {**COMMON_CONFIG, **kwargs},
            "GPTQModel.load": {"device": "cpu"},
            "quantize": {"batch_size": 4, **{k: str(v) for k, v in quantize_kwargs.items()}},
            "calibration": {"samples": CALIB_SAMPLES, "seqlen": CALIB_SEQLEN, "seed": SEED + 1},
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
    install_truth_hooks()
    return producing.run_cases(PRODUCER, cases, out, prepare, run_case)


if __name__ == "__main__":
    sys.exit(main())
