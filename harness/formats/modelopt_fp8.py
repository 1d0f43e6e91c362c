"""`modelopt-fp8`: NVIDIA ModelOpt FP8 (`quant_method: modelopt`, `quant_algo: FP8`), W8A8 per tensor.

Tensors: `weight` float8_e4m3fn [N, K], `weight_scale` float32 [1], a MULTIPLIER (amax/448):
W = e4m3 * weight_scale; `input_scale` float32 scalar [], the static activation multiplier
amax/448. ModelOpt 0.39 writes the weight scale [1] (`export_amax` unsqueezes a per-tensor amax)
and squeezes the input scale to []; a scale of either shape is read. Config: config.json's
`quantization_config` as ModelOpt's `convert_hf_quant_config_format` writes it (one FP8 config
group, `ignore`, `quant_algo`, `producer`, `quant_method`); vLLM also reads the nested
hf_quant_config.json form (`quantization.quant_algo`, `quantization.exclude_modules`).

Scales follow ModelOpt 0.39 (`TensorQuantizer.export_amax`, `get_scaling_factor`,
`to_quantized_weight`): amax = max |w| in the model dtype, 0 (an all-zero weight) -> 448,
clamped to >= finfo(dtype).tiny; scale = float32(amax) / 448; q = e4m3(w / scale) in float32.
"""

from __future__ import annotations

import torch

from harness.core.numerics import E4M3_MAX, encode_e4m3
from harness.formats import equivalents
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
from harness.formats.modelopt_nvfp4 import quant_algo

QUANT_ALGO = "FP8"
#: ModelOpt's FP8 config group (convert_hf_quant_config_format, quant_algo FP8)
FP8_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}


def modelopt_amax(amax: torch.Tensor) -> torch.Tensor:
    """`export_amax`: a zero amax becomes the format's max bound (scale 1.0), then clamped to the
    dtype's smallest normal, so that `get_scaling_factor`'s `scale > 0` assertion holds."""
    amax = torch.where(amax == 0, torch.tensor(E4M3_MAX, dtype=amax.dtype), amax)
    return amax.clamp(min=torch.finfo(amax.dtype).tiny)


def modelopt_scale(amax: torch.Tensor) -> torch.Tensor:
    """`get_scaling_factor`: float32(amax) / 448."""
    return modelopt_amax(amax).float() / E4M3_MAX


def read_scale(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One positive finite per-tensor scale, [1] or [] (ModelOpt writes both), as a [1, 1] grid."""
    require_dtype(name, tensor, (torch.float32,))
    if tuple(tensor.shape) not in ((), (1,)):
        raise FormatError(f"{name} has shape {list(tensor.shape)}, expected [1] or [] (one per-tensor scale)")
    require_finite(name, tensor)
    if not float(tensor.reshape(())) > 0:
        raise FormatError(f"{name} is {float(tensor.reshape(()))!r}: ModelOpt's per-tensor scale must be positive")
    return tensor.reshape(1, 1)


class ModeloptFp8(QuantFormat):
    name = "modelopt-fp8"
    description = "NVIDIA ModelOpt FP8 (e4m3 weight, float32 per-tensor weight_scale and static input_scale)"
    suffixes = ("weight", "weight_scale", "input_scale")
    marker = "weight_scale"
    knobs = {"producer_version": Knob("0.39.0", help="ModelOpt version named in quantization_config.producer")}

    def matches(self, quantization_config):
        return equivalents.from_modelopt(quantization_config) and quant_algo(quantization_config) == QUANT_ALGO

    def quantization_config(self, knobs, ignore):
        """What ModelOpt's `convert_hf_quant_config_format` writes into config.json for FP8 without
        a KV-cache scheme; vLLM reads `quant_algo` and `ignore` (its exclude list) from it."""
        group = {"input_activations": dict(FP8_ARGS), "weights": dict(FP8_ARGS), "targets": ["Linear"]}
        return {
            "config_groups": {"group_0": group},
            "ignore": list(ignore),
            "quant_algo": QUANT_ALGO,
            "producer": {"name": "modelopt", "version": knobs["producer_version"]},
            "quant_method": "modelopt",
        }

    def knobs_from_config(self, quantization_config):
        if quant_algo(quantization_config) != QUANT_ALGO:
            raise FormatError(f"quant_algo {quant_algo(quantization_config)!r} is not {QUANT_ALGO}")
        for group in (quantization_config.get("config_groups") or {}).values():
            weights = (group.get("weights") or {}) if isinstance(group, dict) else {}
            if weights and (weights.get("num_bits"), weights.get("type")) != (8, "float"):
                raise FormatError(f"ModelOpt FP8 weights must be 8-bit float, config has {weights}")
        return {}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        # ModelOpt quantizes the module's weight, held in the model dtype; amax in that dtype
        weight = weight.to(model_dtype)
        scale = modelopt_scale(weight.abs().amax()).reshape(1)
        quantized = encode_e4m3(weight.to(torch.float32) / scale)
        input_amax = torch.tensor(float(activation_amax), dtype=model_dtype).abs().float()
        tensors = {"weight": quantized, "weight_scale": scale, "input_scale": modelopt_scale(input_amax)}
        return QuantizedWeight(tensors, truth=quantized.to(torch.float64) * scale.to(torch.float64))

    def dequantize(self, tensors, knobs):
        weight = require_tensor(tensors, "weight")
        scale = read_scale("weight_scale", require_tensor(tensors, "weight_scale"))
        read_scale("input_scale", require_tensor(tensors, "input_scale"))
        return dequantize_fp8_blocks(weight, scale, tuple(weight.shape), "weight_scale")  # checks dtype, 2-D

    def scale_block(self, knobs, shape):
        return tuple(shape)

    def subnormal_amax(self, knobs, weight_amax):
        # scale = amax / 448 = 2**-130: subnormal in float32 (normal down to 2**-126); the weight
        # itself (1.75 * 2**-122) is normal in bfloat16 and float32, and underflows in float16
        return E4M3_MAX * 2.0**-130


FORMAT = ModeloptFp8()
