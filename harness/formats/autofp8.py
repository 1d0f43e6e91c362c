"""`autofp8`: vLLM's own serialized FP8, as AutoFP8 (neuralmagic/AutoFP8) writes it: one scale per
weight, the 2024 hub FP8 checkpoints (`*-FP8` before compressed-tensors).

Config: `{"quant_method": "fp8", "activation_scheme": "static" | "dynamic", "ignored_layers": [...]}`
with no `weight_block_size` (vLLM's Fp8Config: absent means per tensor; transformers' FineGrainedFP8
writes the key always, null for its own per-tensor scheme: harness.formats.fp8_block).
Tensors: `weight` float8_e4m3fn [N, K], `weight_scale` float32 0-D (AutoFP8; [1] read too), a
MULTIPLIER: W = e4m3 * weight_scale; a static scheme adds `input_scale` float32 0-D, the
activations' multiplier. Inputs: static per tensor, or dynamic per tensor (AutoFP8's
FP8DynamicLinear, vLLM without CUTLASS; vLLM with CUTLASS quantizes per token instead, for speed).

Scales follow AutoFP8 (`per_tensor_quantize`): amax = max |w|, s = 448 / max(amax, 1e-12),
q = e4m3(clamp(w * s, +-448)), stored weight_scale = 1 / s, in float32 here (AutoFP8 computes in the
model dtype, which rounds w * s once more and in float16 turns an all-zero weight into NaN codes).

`kv_cache_scheme: "static"` declares a static FP8 KV cache per tensor, its scales `self_attn.k_scale` /
`v_scale` float32 0-D (AutoFP8 calibrates them on k_proj's and v_proj's outputs; vLLM quantizes what
enters its cache with them: harness.oracle.kv_cache).
"""

from __future__ import annotations

import torch

from harness.core.numerics import E4M3_MAX, encode_e4m3
from harness.formats.base import (
    FormatError,
    Knob,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_tensor,
)
from harness.formats.fp8_block import dequantize_fp8_blocks

QUANT_METHOD = "fp8"
SCALE_SHAPES = {"scalar": (), "one-element": (1,)}
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_autofp8(quantization_config) -> bool:
    """vLLM's per-tensor FP8 config: quant_method fp8 without the key `weight_block_size`."""
    return quantization_config.get("quant_method") == QUANT_METHOD and "weight_block_size" not in quantization_config


def autofp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """AutoFP8's quantizing multiplier 448 / max(amax, 1e-12), in amax's dtype."""
    return E4M3_MAX / amax.clamp(min=1e-12)


def read_scale(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One finite per-tensor scale, 0-D or [1], as a [1, 1] grid."""
    require_dtype(name, tensor, SCALE_DTYPES)
    if tuple(tensor.shape) not in SCALE_SHAPES.values():
        raise FormatError(f"{name} has shape {list(tensor.shape)}, expected [] or [1] (one per-tensor scale)")
    require_finite(name, tensor)
    return tensor.reshape(1, 1)


class AutoFp8(QuantFormat):
    name = "autofp8"
    description = (
        "vLLM / AutoFP8 per-tensor FP8 (quant_method fp8 without weight_block_size: weight_scale, input_scale)"
    )
    suffixes = ("weight", "weight_scale", "input_scale")
    marker = "weight_scale"
    knobs = {
        "input_scale": Knob(False, (False, True), "static per-tensor input activations (activation_scheme static)"),
        "scale_shape": Knob("scalar", tuple(SCALE_SHAPES), "per-tensor scales stored 0-D (AutoFP8) or [1]"),
    }

    def matches(self, quantization_config):
        return is_autofp8(quantization_config)

    def quantization_config(self, knobs, ignore):
        """What AutoFP8's `save_quantized_model` writes into config.json."""
        return {
            "quant_method": QUANT_METHOD,
            "activation_scheme": "static" if knobs["input_scale"] else "dynamic",
            "ignored_layers": list(ignore),
        }

    def knobs_from_config(self, quantization_config):
        scheme = quantization_config.get("activation_scheme")
        if scheme not in ("static", "dynamic"):
            raise FormatError(f"activation_scheme {scheme!r} is not 'static' or 'dynamic'")
        if quantization_config.get("kv_cache_scheme") not in (None, "static"):
            raise FormatError(f"kv_cache_scheme {quantization_config['kv_cache_scheme']!r} is not 'static'")
        return {"input_scale": scheme == "static"}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        # the module's weight, held in the model dtype; the arithmetic in float32, not in the model
        # dtype as AutoFP8's: in float16 its clamp to 1e-12 underflows, and an all-zero weight
        # becomes 0 x inf = NaN codes (a producer's accident, not the format)
        weight = weight.to(model_dtype).to(torch.float32)
        multiplier = autofp8_scale(weight.abs().amax())
        quantized = encode_e4m3(weight * multiplier)
        scale = multiplier.reciprocal()
        shape = SCALE_SHAPES[knobs["scale_shape"]]
        tensors = {"weight": quantized, "weight_scale": scale.reshape(shape)}
        if knobs["input_scale"]:
            amax = torch.tensor(float(activation_amax), dtype=model_dtype).abs().float()
            tensors["input_scale"] = autofp8_scale(amax).reciprocal().reshape(shape)
        return QuantizedWeight(tensors, truth=quantized.to(torch.float64) * scale.to(torch.float64))

    def dequantize(self, tensors, knobs):
        weight = require_tensor(tensors, "weight")
        scale = read_scale("weight_scale", require_tensor(tensors, "weight_scale"))
        if knobs.get("input_scale"):
            read_scale("input_scale", require_tensor(tensors, "input_scale"))
        return dequantize_fp8_blocks(weight, scale, tuple(weight.shape), "weight_scale")  # checks dtype, 2-D

    def scale_block(self, knobs, shape):
        return tuple(shape)

    def subnormal_amax(self, knobs, weight_amax):
        # 448 / amax = 2**127 (finite in bfloat16, which tops out below 2**128): the stored
        # 1 / 2**127 is subnormal in float32 (normal down to 2**-126)
        return E4M3_MAX * 2.0**-127


FORMAT = AutoFp8()
