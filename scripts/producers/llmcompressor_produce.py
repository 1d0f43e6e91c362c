"""The llm-compressor producer of the corpus (cases/producers/llmcompressor/): tiny random-weight models
built from configs exactly as transformers saves them, quantized on CPU, offline, by llm-compressor's
own `oneshot` with its preset schemes, saved as it saves them (no tokenizer: engines must cope).

    python scripts/producers/llmcompressor_produce.py --out DIR [--only SUBSTRING ...] [--list]

Each case DIR/llmcompressor/<case>/ holds the checkpoint, provenance.json and
producer_truth/weights.safetensors: every quantized weight as compressed-tensors' own fake_quantize
gives it from the in-memory scales right after oneshot (before saving compresses anything), stored
in the model dtype it computes in (bfloat16), and the static k/v scales it holds (float32). Standalone:
imports torch, safetensors, transformers, compressed-tensors, llm-compressor and the stdlib only.
What fails on CPU is written to DIR/llmcompressor/FAILED.json, one line per case.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from importlib.metadata import version  # noqa: E402
from pathlib import Path  # noqa: E402

import producing  # noqa: E402  (beside this script)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SEED = 0
SIZES = {
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
#: per architecture: the transformers config class and its own fields (MoE: 4 experts, top 2); one
#: layer each keeps the corpus small
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
        },
    ),
    "phi3": ("Phi3Config", {}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 64,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "num_key_value_heads": 4,
        },
    ),
    "llama4_text": (
        "Llama4TextConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128, "head_dim": 32},
    ),
}
#: DeepSeek-V3's low-rank q/kv widths (64, 32 in ARCHITECTURES) as whole int4 groups of 128: llm-compressor
#: cannot group the inputs of q_b_proj and kv_b_proj otherwise ("unflatten: Provided sizes [-1, 128]")
MLA_WHOLE_GROUPS = {"q_lora_rank": 128, "kv_lora_rank": 128}
#: the routed experts' Linears (a case that quantizes nothing else)
EXPERTS = ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"]
#: attention's projections and a dense model's MLP (the targets of a mixed-precision case's groups)
ATTENTION = ["re:.*self_attn\\.(q|k|v|o)_proj$"]
DENSE_MLP = ["re:.*mlp\\.(gate|up|down)_proj$"]
#: mixed precision: several config groups, preset -> targets (llm-compressor's `scheme` as a dict); one
#: compression format each (top-level format "mixed-precision") or one for all (int4 beside int8)
MIXED = {
    "qwen3_moe-fp8-dynamic-attn-w4a16-experts": ("qwen3_moe", {"FP8_DYNAMIC": ATTENTION, "W4A16": EXPERTS}),
    "qwen3_moe-fp8-block-attn-nvfp4a16-experts": ("qwen3_moe", {"FP8_BLOCK": ATTENTION, "NVFP4A16": EXPERTS}),
    "llama-fp8-attn-nvfp4-mlp": ("llama", {"FP8": ATTENTION, "NVFP4": DENSE_MLP}),
    "llama-w8a16-attn-w4a16-mlp": ("llama", {"W8A16": ATTENTION, "W4A16": DENSE_MLP}),
    "llama-w4a16-attn-w4a16-asym-mlp": ("llama", {"W4A16": ATTENTION, "W4A16_ASYM": DENSE_MLP}),
    # Unsloth's NVFP4 layout: the FP8 group also names the last layer's MLP, which the NVFP4 group's
    # pattern matches too (compressed-tensors orders regex targets as strings: NVFP4's comes first)
    "llama-fp8-dynamic-attn-last-mlp-nvfp4a16-mlp": (
        "llama",
        {"FP8_DYNAMIC": [*ATTENTION, "re:model\\.layers\\.1\\.mlp\\.(gate|up|down)_proj$"], "NVFP4A16": DENSE_MLP},
        {"num_hidden_layers": 2},
    ),
    "llama-fp8-dynamic-attn-last-mlp-w4a16-mlp": (
        "llama",
        {"FP8_DYNAMIC": [*ATTENTION, "re:model\\.layers\\.1\\.mlp\\.(gate|up|down)_proj$"], "W4A16": DENSE_MLP},
        {"num_hidden_layers": 2},
    ),
}
#: routers and the head stay unquantized (llm-compressor's examples ignore them the same way)
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$", "re:.*router$"]
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
#: preset schemes whose scales need activations seen (calibration)
CALIBRATED = ("FP8", "NVFP4", "W8A8", "INT8_W8A8", "MXFP4")
LLAMA_SCHEMES = (
    "FP8_DYNAMIC",
    "FP8",
    "FP8_BLOCK",
    "W8A16",
    "W4A16",
    "W4A16_ASYM",
    "W8A8",
    "NVFP4A16",
    "NVFP4",
    "MXFP4A16",
    "MXFP4",
    "MXFP8A16",
    "MXFP8",
    "W4AFP8",
    "W4A8",
)


def cases() -> dict[str, dict]:
    """case name -> what it is: architecture, scheme, KV scheme, head quantized, sizes over SIZES."""
    table = {}
    for scheme in LLAMA_SCHEMES:
        table[f"llama-{slug(scheme)}"] = {"arch": "llama", "scheme": scheme}
    table["llama-fp8-kv"] = {"arch": "llama", "scheme": "FP8", "kv": True}
    table["llama-fp8-dynamic-head"] = {"arch": "llama", "scheme": "FP8_DYNAMIC", "head": True}
    table["llama-w4a16-gptq"] = {"arch": "llama", "scheme": "W4A16", "gptq": True}
    for scheme in ("FP8_DYNAMIC", "W4A16", "NVFP4A16"):
        table[f"qwen2-{slug(scheme)}"] = {"arch": "qwen2", "scheme": scheme}
    for arch in ("mixtral", "qwen3_moe"):
        for scheme in ("FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "NVFP4A16"):
            table[f"{arch}-{slug(scheme)}"] = {"arch": arch, "scheme": scheme}
    for arch in ("mixtral", "qwen3_moe"):  # int8 experts (int-quantized), zero points, FP4 activations
        for scheme in ("W8A8", "W4A16_ASYM", "NVFP4"):
            table[f"{arch}-{slug(scheme)}"] = {"arch": arch, "scheme": scheme}
    for arch in ("qwen2_moe", "phi3", "deepseek_v3", "llama4_text"):
        table[f"{arch}-fp8-dynamic"] = {"arch": arch, "scheme": "FP8_DYNAMIC"}
    # multi-head latent attention, a shared expert; int4 groups of 128 need the low-rank widths whole groups
    table["deepseek_v3-w4a16"] = {"arch": "deepseek_v3", "scheme": "W4A16", "sizes": MLA_WHOLE_GROUPS}
    table["deepseek_v3-nvfp4a16"] = {"arch": "deepseek_v3", "scheme": "NVFP4A16"}
    table["qwen2_moe-w4a16"] = {"arch": "qwen2_moe", "scheme": "W4A16"}
    # only the routed experts int4, everything else bfloat16: how Kimi-K2-Thinking ships
    table["deepseek_v3-w4a16-experts"] = {"arch": "deepseek_v3", "scheme": "W4A16", "targets": EXPERTS}
    table["qwen3_moe-fp8-block-h256"] = {"arch": "qwen3_moe", "scheme": "FP8_BLOCK", "sizes": {"hidden_size": 256}}
    for name, (arch, groups, *sizes) in MIXED.items():
        table[name] = {"arch": arch, "scheme": groups, "sizes": sizes[0] if sizes else {}}
    return table


def slug(scheme: str) -> str:
    return scheme.lower().replace("_", "-")


def base_model(arch: str, sizes: dict, directory: Path) -> Path:
    """A random-weight bf16 model saved by transformers' save_pretrained (its config.json as saved)."""
    import transformers

    class_name, fields = ARCHITECTURES[arch]
    config = getattr(transformers, class_name)(**{**SIZES, **fields, **sizes}, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def calibration(samples: int = 8, length: int = 32):
    """Random token-id sequences, already tokenized (no tokenizer, no download)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, SIZES["vocab_size"], (samples, length), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def local_tokenizer():
    """A word-level tokenizer over the vocabulary, built here: oneshot wants a processor beside a
    dataset, and nothing may come from a hub. It is not saved with the checkpoint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"t{i}": i for i in range(SIZES["vocab_size"])}
    tokenizer = Tokenizer(WordLevel(vocabulary, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", eos_token="t2")


def recipe_for(case: dict):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ignore = [entry for entry in IGNORE if not (case.get("head") and entry == "lm_head")]
    arguments = {"targets": case.get("targets", "Linear"), "scheme": case["scheme"], "ignore": ignore}
    if case.get("kv"):
        arguments["kv_cache_scheme"] = KV_SCHEME
    modifier = GPTQModifier if case.get("gptq") else QuantizationModifier
    return modifier(**arguments), {"modifier": modifier.__name__, **arguments}


def producer_truth(model) -> dict[str, torch.Tensor]:
    """Each quantized Linear's weight fake-quantized by compressed-tensors from the scales the model
    holds now (in the dtype it computes in), and each attention's static k/v scale (float32), under
    checkpoint names."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    truth = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.weights is not None and hasattr(module, "weight_scale"):
            with torch.no_grad():
                value = fake_quantize(
                    module.weight,
                    module.weight_scale,
                    getattr(module, "weight_zero_point", None),
                    scheme.weights,
                    global_scale=getattr(module, "weight_global_scale", None),
                )
            truth[f"{name}.weight"] = value.detach().contiguous()
        for kv in ("k_scale", "v_scale"):
            if isinstance(getattr(module, kv, None), torch.Tensor):
                truth[f"{name}.{kv}"] = getattr(module, kv).detach().float().reshape(-1).contiguous()
    return truth


def produce(name: str, case: dict, out: Path, scratch: Path) -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    started = time.time()
    base = base_model(case["arch"], case.get("sizes", {}), scratch / name)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    recipe, recorded = recipe_for(case)
    presets = case["scheme"] if isinstance(case["scheme"], dict) else [case["scheme"]]
    calibrated = case.get("kv") or case.get("gptq") or any(preset in CALIBRATED for preset in presets)
    options = {"dataset": calibration(), "num_calibration_samples": 8, "max_seq_length": 32}
    options = {**options, "processor": local_tokenizer()} if calibrated else {}
    oneshot(model=model, recipe=recipe, **options)
    truth = producer_truth(model)
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, save_compressed=True)
    for tokenizer in directory.glob("tokenizer*"):
        tokenizer.unlink()
    (directory / "producer_truth").mkdir()
    save_file(
        producing.saved_names(truth, directory, producing.MIXTRAL_SAVED),
        str(directory / "producer_truth" / "weights.safetensors"),
    )
    provenance = {
        "producer": "llmcompressor",
        "producer_version": version("llmcompressor"),
        "packages": producing.package_versions(("torch", "transformers", "compressed-tensors", "llmcompressor")),
        "case": name,
        "arch": case["arch"],
        "scheme": case["scheme"],
        "recipe": recorded,
        "kv_cache_scheme": KV_SCHEME if case.get("kv") else None,
        "lm_head_quantized": bool(case.get("head")),
        "calibration": "8 random token-id sequences of 32 (seed 0)" if calibrated else None,
        "command": f"python scripts/producers/llmcompressor_produce.py --out DIR --only {name}",
        "seed": SEED,
        "files": producing.digests(directory),
        "notes": [],
    }
    (directory / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    print(f"llmcompressor: {name}: produced in {time.time() - started:.1f} s", flush=True)  # not in provenance


def main() -> int:
    parser = argparse.ArgumentParser(description="llm-compressor's cases of the producers' corpus")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=[], help="cases whose name contains any of these")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    table = {n: c for n, c in cases().items() if not args.only or any(s in n for s in args.only)}
    if args.list:
        print("\n".join(table))
        return 0
    torch.set_num_threads(min(2, torch.get_num_threads()))
    out = args.out / "llmcompressor"
    out.mkdir(parents=True, exist_ok=True)
    failed = {}
    with tempfile.TemporaryDirectory(prefix="llmcompressor-") as scratch:
        for name, case in table.items():
            try:
                produce(name, case, out, Path(scratch))
            except Exception as error:  # a case this machine cannot produce: recorded with its message
                failed[name] = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
                shutil.rmtree(out / name, ignore_errors=True)
                print(f"llmcompressor: {name}: FAILED {failed[name]}", flush=True)
                traceback.print_exc(limit=3, file=sys.stderr)
    (out / "FAILED.json").write_text(json.dumps(failed, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
