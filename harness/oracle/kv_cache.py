"""KV-cache quantization as the config declares it: an FP8 (E4M3) cache with one static scale per
attention layer for the keys and one for the values (compressed-tensors' `kv_cache_scheme` of
strategy tensor, ModelOpt's `kv_cache_quant_algo: FP8`). What enters the cache is quantized: the
keys after rotary embedding, the values as projected, k -> e4m3(clamp(k / k_scale)) * k_scale (the
same per-tensor rule as a static input scale, harness.oracle.activations).

The scales are read under every naming real checkpoints use (harness.checkpoints.kv_scales):
`self_attn.k_scale`, `k_proj.output_scale`, ModelOpt's `k_proj.k_scale`, and the same for v.

AMD Quark's FP8 KV cache (harness.formats.quark.kv_cache_fp8, `kv_cache_post_rope: false`) is
quantized where Quark's own model quantizes it: the outputs of k_proj and v_proj, before the rotary
embedding (`quantized_at`: "projection"; every other producer's: "cache").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from harness.core.errors import HarnessError
from harness.formats import autofp8, quark
from harness.oracle.activations import ActivationScheme, quantize_activations

#: per naming: (suffix of the key scale, suffix of the value scale), after `<layer>.self_attn.`
NAMINGS = (("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale"), ("k_proj.k_scale", "v_proj.v_scale"))
STATIC_FP8 = ActivationScheme("fp8", "tensor", False, static="kv_scale")
#: the Linears whose outputs a KV cache quantized at its projections quantizes (quantized_at)
PROJECTIONS = ("k_proj", "v_proj")


def declares_fp8_kv_cache(quantization_config: Mapping) -> bool:
    """True when the config quantizes the KV cache; a KV scheme other than static per-tensor FP8
    is a one-line HarnessError."""
    if quark.from_quark(quantization_config):
        return quark.kv_cache_fp8(quantization_config)
    scheme = quantization_config.get("kv_cache_scheme")
    if autofp8.is_autofp8(quantization_config):  # AutoFP8 names its static FP8 per-tensor cache so
        if scheme not in (None, "static"):
            raise HarnessError(f"AutoFP8's kv_cache_scheme {scheme!r} is not defined here (only 'static')")
        return scheme == "static"
    if isinstance(scheme, Mapping):
        if (scheme.get("num_bits"), scheme.get("type"), scheme.get("strategy"), scheme.get("dynamic")) != (
            8,
            "float",
            "tensor",
            False,
        ):
            raise HarnessError(f"kv_cache_scheme {dict(scheme)} is not a static per-tensor FP8 cache")
        return True
    algo = quantization_config.get("kv_cache_quant_algo")
    if algo is not None and algo != "FP8":
        raise HarnessError(f"kv_cache_quant_algo {algo!r} is not defined here")
    return algo == "FP8"


def quantized_at(quantization_config: Mapping) -> str:
    """Where the declared FP8 KV cache quantizes keys and values: "cache" (what enters it, the keys
    after the rotary embedding) or "projection" (k_proj's and v_proj's outputs: Quark's)."""
    return "projection" if quark.from_quark(quantization_config) else "cache"


def kv_scales(attention_modules: list[str], names: set[str]) -> dict[str, tuple[str, str]]:
    """attention module -> (key scale name, value scale name) for each module, or a one-line
    HarnessError naming the first module without a complete pair under one naming."""
    found = {}
    for module in attention_modules:
        pairs = [(f"{module}.{k}", f"{module}.{v}") for k, v in NAMINGS]
        complete = [pair for pair in pairs if pair[0] in names and pair[1] in names]
        if not complete:
            raise HarnessError(f"{module}: no complete k/v scale pair for the FP8 KV cache the config declares")
        found[module] = complete[0]
    return found


def attention_modules(config: Mapping, names: list[str]) -> list[str]:
    """The attention module of every layer the config declares, under the checkpoint's key prefix."""
    layers = int(config.get("num_hidden_layers", 0))
    prefix = next((n.split("layers.")[0] for n in names if ".layers." in n), "model.")
    return [f"{prefix}layers.{layer}.self_attn" for layer in range(layers)]


def stored_kv_scales(checkpoint) -> dict[str, tuple[float | None, float | None]]:
    """attention module -> (k_scale, v_scale) as the checkpoint stores them, None for one it lacks,
    under the first naming that holds either; every attention module of the config is present."""
    names = set(checkpoint.names())
    stored = {}
    for module in attention_modules(checkpoint.config, sorted(names)):
        pairs = [(f"{module}.{k}", f"{module}.{v}") for k, v in NAMINGS]
        pair = next((p for p in pairs if p[0] in names or p[1] in names), pairs[0])
        stored[module] = tuple(
            float(checkpoint.tensor(name).reshape(-1)[0]) if name in names else None for name in pair
        )
    return stored


class _QuantizingCache:
    """Stands in for the model's cache inside one attention forward: quantizes what enters it."""

    def __init__(self, cache, k_scale: torch.Tensor, v_scale: torch.Tensor, scheme: ActivationScheme):
        self.cache, self.k_scale, self.v_scale, self.scheme = cache, k_scale, v_scale, scheme

    def update(self, key_states, value_states, *args, **kwargs):
        key_states = quantize_activations(key_states, self.scheme, self.k_scale)
        value_states = quantize_activations(value_states, self.scheme, self.v_scale)
        if self.cache is None:
            return key_states, value_states
        return self.cache.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.cache, name)


def install(
    model: torch.nn.Module,
    scales: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    arithmetic: str = "float64",
    kind: str = "fp8",
    at: str = "cache",
) -> list:
    """Quantize the KV cache of each named attention module (name -> (k_scale, v_scale)) with
    forward pre-hooks that hand it a quantizing cache, or where `at` is "projection" (quantized_at)
    with forward hooks on its k_proj and v_proj; the handles, to remove them. `arithmetic`: as in
    harness.oracle.activations; `kind`: "fp8" (E4M3, as checkpoints declare it) or "fp8_e5m2" (an
    E5M2 cache, as vLLM's `kv_cache_dtype=fp8_e5m2` keeps it)."""
    scheme = dataclasses.replace(STATIC_FP8, arithmetic=arithmetic, kind=kind)
    modules = dict(model.named_modules())
    absent = sorted(set(scales) - set(modules))
    if absent:
        raise HarnessError(f"no attention module in the model for {absent[0]}")
    if at == "projection":
        return _install_at_projections(modules, scales, scheme)
    handles = []
    for name, (k_scale, v_scale) in scales.items():

        def hook(module, args, kwargs, k_scale=k_scale, v_scale=v_scale):
            key = (
                "past_key_values" if "past_key_values" in kwargs or "past_key_value" not in kwargs else "past_key_value"
            )
            kwargs[key] = _QuantizingCache(kwargs.get(key), k_scale, v_scale, scheme)
            return args, kwargs

        handles.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def _install_at_projections(modules: dict, scales: Mapping, scheme: ActivationScheme) -> list:
    handles = []
    for name, pair in scales.items():
        for projection, scale in zip(PROJECTIONS, pair, strict=True):
            module = modules.get(f"{name}.{projection}")
            if module is None:
                for handle in handles:
                    handle.remove()
                raise HarnessError(f"{name} has no {projection} whose output the KV-cache scale quantizes")

            def hook(module, args, output, scale=scale):
                return quantize_activations(output, scheme, scale)

            handles.append(module.register_forward_hook(hook))
    return handles
