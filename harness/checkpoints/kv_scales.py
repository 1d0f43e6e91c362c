"""KV-cache scales (the recipe's `layout.kv_scales`): FP8 per-tensor k/v scales under the names
real checkpoints use, and the config fragment that declares them.

- `self_attn`: `self_attn.k_scale` / `self_attn.v_scale` (compressed-tensors' kv_cache_scheme today);
- `output_scale`: `self_attn.k_proj.output_scale` / `v_proj.output_scale` (older compressed-tensors);
- `proj`: `self_attn.k_proj.k_scale` / `v_proj.v_scale` (ModelOpt);
- `k-only`: `self_attn.k_scale` without its `v_scale`: half of the pair (exact-or-refuse);
- `v-only`: `self_attn.v_scale` without its `k_scale`: the other half (exact-or-refuse);
- `declared-only`: the config declares the FP8 cache, no layer stores a scale (exact-or-refuse).

A scale is kv_amax / 448 (the FP8 e4m3 maximum), typed and shaped as its producer writes it: [1]
in the model dtype (a compressed-tensors parameter), float32 [] (ModelOpt's export, AutoFP8's). `proj` goes with
ModelOpt formats, `output_scale` with compressed-tensors ones; AutoFP8 (`autofp8`, `kv_cache_scheme: "static"`)
writes `self_attn` only. The
reference engine's weight-only forward leaves its KV cache unquantized; its activation candidate
quantizes the cache with them (harness.oracle.kv_cache); weights are judged exactly either way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harness.core.errors import HarnessError
from harness.formats.autofp8 import is_autofp8
from harness.formats.ct_common import CT_KV_SCHEME

CHOICES = ("none", "self_attn", "output_scale", "proj", "k-only", "v-only", "declared-only")
FP8_MAX = 448.0
#: tensor-name endings that are KV-cache scales, under every naming above
SUFFIXES = (
    "self_attn.k_scale",
    "self_attn.v_scale",
    "k_proj.output_scale",
    "v_proj.output_scale",
    "k_proj.k_scale",
    "v_proj.v_scale",
)


def is_kv_scale(name: str) -> bool:
    return name.endswith(SUFFIXES)


def check(kind: str, arch, quantization_config: Mapping) -> None:
    """Refuse (one line) a KV naming the checkpoint cannot carry."""
    if kind == "none":
        return
    method = quantization_config.get("quant_method")
    if method not in ("compressed-tensors", "modelopt") and not is_autofp8(quantization_config):
        raise HarnessError(
            f"kv_scales={kind} needs a compressed-tensors, ModelOpt or AutoFP8 format (a config that declares them)"
        )
    if (kind, method) in (
        ("proj", "compressed-tensors"),
        ("output_scale", "modelopt"),
        ("proj", "fp8"),
        ("output_scale", "fp8"),
    ):
        raise HarnessError(f"kv_scales={kind} is not a naming {method} producers write")
    if arch.attention == "mla":
        raise HarnessError(f"kv_scales={kind}: {arch.name}'s latent attention has no k/v projections")
    if arch.attention == "fused" and kind in ("output_scale", "proj"):
        raise HarnessError(f"kv_scales={kind} names k_proj/v_proj, which {arch.name} fuses into qkv_proj")


def tensors(
    kind: str, settings: Mapping, amax: float, model_dtype: torch.dtype, quant_method: str = "compressed-tensors"
) -> dict[str, torch.Tensor]:
    """The KV scales of every layer, distinct per layer and between k and v: ModelOpt's and AutoFP8's
    float32 [], compressed-tensors' [1] parameters in the model dtype (llm-compressor 0.14 writes them so)."""
    exported = kind == "proj" or quant_method == "fp8"
    shape = () if exported else (1,)
    dtype = torch.float32 if exported else model_dtype
    names = {
        "self_attn": ("self_attn.k_scale", "self_attn.v_scale"),
        "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
        "proj": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
        "k-only": ("self_attn.k_scale",),
        "v-only": ("self_attn.v_scale",),
    }.get(kind, ())
    result = {}
    for layer in range(settings["num_hidden_layers"]):
        for index, name in enumerate(names):
            value = amax * (1 + 0.25 * layer + 0.5 * index) / FP8_MAX
            result[f"model.layers.{layer}.{name}"] = torch.full(shape, value, dtype=dtype)
    return result


def declare(kind: str, quantization_config: dict) -> None:
    """Add the KV-cache declaration to a format's quantization_config, as its producer writes it."""
    if kind == "none":
        return
    if quantization_config["quant_method"] == "compressed-tensors":
        quantization_config["kv_cache_scheme"] = dict(CT_KV_SCHEME)
    elif quantization_config["quant_method"] == "fp8":  # AutoFP8
        quantization_config["kv_cache_scheme"] = "static"
    else:
        quantization_config["kv_cache_quant_algo"] = "FP8"


NOTES = {
    "k-only": ("exact-or-refuse", "only k_scale of the KV pair is present: refuse, never run v with a default scale"),
    "v-only": ("exact-or-refuse", "only v_scale of the KV pair is present: refuse, never run k with a default scale"),
    "declared-only": (
        "exact-or-refuse",
        "the config declares an FP8 KV cache and no k/v scale is stored: refuse, never run it with default scales",
    ),
}
