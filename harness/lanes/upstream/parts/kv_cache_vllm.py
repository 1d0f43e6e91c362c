"""The KV cache: what vLLM's CPU attention writes into its FP8 cache.

The checkpoint declares an FP8 KV cache with static per-tensor scales: what enters the cache is
e4m3(x / scale), rounded to nearest (ties to even) and saturated at 448, as the cache scheme, torch
and CUDA define the conversion. vLLM's CPU backend writes each new key and value with its op
cpu_attn_reshape_and_cache on the ISA it picks for the model's dtype and head size; this calls that
op on random keys and values with the first layer's own k/v scales and compares the cache bytes
with the definition: the value cache holds one row per token and head, the key cache is blocked
for the ISA's dot products, so keys are compared as the multiset each head holds."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from harness.lanes.upstream.parts.checkpoint import KV_SCALE_NAMES, rename
from harness.lanes.upstream.parts.common import MODEL_DTYPE
from harness.lanes.upstream.parts.parameters import CONFIG, LAYOUT

# ---- reproduce.py ----

KV_TOKENS, KV_BLOCK_SIZE = 32, 32


def first_layer_kv_scales(directory) -> list[float]:
    names = [rename(f"model.layers.0.{name}") for name in KV_SCALE_NAMES[LAYOUT["kv_scales"]]]
    found = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            found |= {name: float(handle.get_tensor(name).reshape(-1)[0]) for name in names if name in handle.keys()}
    return [found[name] for name in names]


def e4m3_nearest(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def kv_cache_problems(directory) -> list[str]:
    """How the cache vLLM writes differs from e4m3(x / scale) rounded to nearest, per cache."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    scales = first_layer_kv_scales(directory)
    k_scale, v_scale = scales[0], scales[-1]
    heads = CONFIG["num_key_value_heads"]
    head_size = CONFIG.get("head_dim") or CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    isa = _get_attn_isa(MODEL_DTYPE, KV_BLOCK_SIZE, head_size, "fp8")
    generator = torch.Generator().manual_seed(0)
    key = (torch.randn(KV_TOKENS, heads, head_size, generator=generator) * 200 * k_scale).to(MODEL_DTYPE)
    value = (torch.randn(KV_TOKENS, heads, head_size, generator=generator) * 200 * v_scale).to(MODEL_DTYPE)
    cache = torch.zeros(1, heads, KV_BLOCK_SIZE * 2, head_size, dtype=torch.uint8)
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.arange(KV_TOKENS)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, isa, k_scale=k_scale, v_scale=v_scale, kv_cache_dtype="fp8"
    )
    problems = []
    want_v = e4m3_nearest(value.float().transpose(0, 1) / v_scale)
    held_v = value_cache[0].view(torch.float8_e4m3fn).float()[:, :KV_TOKENS]
    differ = held_v != want_v
    if bool(differ.any()):
        smaller = (held_v.abs() < want_v.abs()) & differ
        problems.append(
            f"value cache ({isa} ISA): {int(differ.sum())} of {differ.numel()} entries differ from "
            f"e4m3(v / v_scale) rounded to nearest, {int(smaller.sum())} of them smaller in magnitude "
            f"(e.g. {held_v[differ][0].item():g} where the definition gives {want_v[differ][0].item():g})"
        )
    want_k = e4m3_nearest(key.float().transpose(0, 1) / k_scale).reshape(heads, -1)
    held_k = key_cache[0].view(torch.float8_e4m3fn).float().reshape(heads, -1)
    for head in range(heads):
        wanted, held = want_k[head], held_k[head]
        if not torch.equal(held[held != 0].sort().values, wanted[wanted != 0].sort().values):
            problems.append(
                f"key cache ({isa} ISA), head {head}: the values held are not e4m3(k / k_scale) rounded to nearest "
                f"(their magnitudes sum to {float(held.abs().sum()):.6g}, the definition's to "
                f"{float(wanted.abs().sum()):.6g})"
            )
            break
    return problems
