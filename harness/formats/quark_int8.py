"""`quark-int8` (read, not written): AMD Quark's int8 export (`quant_method: quark`, its `int8`
scheme; harness.formats.quark.int8_per_tensor says which configs).

Measured on amd-quark 0.13's own export (cases/producers/quark/int8): for a Linear with N outputs and
K inputs, `weight` int8 [N, K] (the code itself), `weight_scale` float32 0-D, `weight_zero_point` int8
0-D (0: the scheme is symmetric), and for its static int8 input `input_scale` float32 0-D and
`input_zero_point` int8 0-D (0). W = code * weight_scale. Quark's observer computes each scale as
amax / ((127 - -128) / 2) in float32 (eps where the amax is 0) and the code as
clamp(round(w / scale), -128, 127), round half to even; its inputs the same way with the stored
`input_scale` (harness.oracle.activations).
"""

from __future__ import annotations

import torch

from harness.formats import equivalents, quark
from harness.formats.base import (
    FormatError,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)

#: Quark's symmetric int8 scale divisor, (127 - -128) / 2, and its code range
HALF_RANGE = 127.5
CODES = (-128, 127)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the reading knob: inputs are quantized with a stored static scale
INPUT_SCALE = "input_scale"


def quark_int8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Quark's symmetric int8 scale of an amax, in float32: amax / 127.5, at least float32's eps."""
    scale = amax.to(torch.float32) / HALF_RANGE
    return torch.maximum(scale, torch.tensor(torch.finfo(torch.float32).eps))


class QuarkInt8(QuantFormat):
    name = "quark-int8"
    description = (
        "AMD Quark int8 per tensor (int8 weight, float32 0-D scales, int8 zero points of 0, static int8 input)"
    )
    suffixes = ("weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
    marker = "weight_scale"
    knobs = {}

    def matches(self, quantization_config):
        return quark.int8_per_tensor(quantization_config)

    def quantization_config(self, knobs, ignore):
        return quark.fragment(ignore)

    def knobs_from_config(self, quantization_config):
        if not quark.int8_per_tensor(quantization_config):
            raise FormatError("quantization_config is not Quark's symmetric static int8 per-tensor scheme")
        inputs = quantization_config["global_quant_config"].get("input_tensors")
        return {INPUT_SCALE: inputs is not None, equivalents.SCALAR_SCALES: True}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        """Quark's int8 quantization of a module's weight (held in the model dtype): the tensors this
        format stores, their dtypes and shapes (the audit's model of a module); no generator writes it."""
        weight = weight.to(model_dtype)
        scale = quark_int8_scale(weight.abs().amax())
        codes = torch.round(weight.to(torch.float32) / scale).clamp(*CODES).to(torch.int8)
        zero = torch.zeros((), dtype=torch.int8)
        tensors = {"weight": codes, "weight_scale": scale, "weight_zero_point": zero}
        if knobs.get(INPUT_SCALE):
            amax = torch.tensor(float(activation_amax), dtype=model_dtype).abs()
            tensors |= {"input_scale": quark_int8_scale(amax), "input_zero_point": zero.clone()}
        return QuantizedWeight(tensors, truth=codes.to(torch.float64) * scale.to(torch.float64))

    def dequantize(self, tensors, knobs):
        shape = () if knobs.get(equivalents.SCALAR_SCALES) else (1,)
        weight = require_tensor(tensors, "weight")
        require_dtype("weight", weight, (torch.int8,))
        if weight.dim() != 2:
            raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
        scale = _per_tensor(tensors, "weight_scale", SCALE_DTYPES, shape)
        pairs = [("weight_zero_point", "weight_scale")]
        if knobs.get(INPUT_SCALE):
            _per_tensor(tensors, "input_scale", SCALE_DTYPES, shape)
            pairs.append(("input_zero_point", "input_scale"))
        for zero_point, of in pairs:
            if zero_point in tensors or knobs.get(equivalents.SCALAR_SCALES):
                zero = _per_tensor(tensors, zero_point, (torch.int8, torch.int32), shape, finite=False)
                if bool((zero != 0).any()):
                    raise FormatError(f"{zero_point} is {int(zero.reshape(-1)[0])}: a symmetric {of} has zero point 0")
        return weight.to(torch.float64) * scale.to(torch.float64).reshape(())

    def scale_block(self, knobs, shape):
        return tuple(shape)


def _per_tensor(tensors, name: str, dtypes, shape: tuple, finite: bool = True) -> torch.Tensor:
    tensor = require_tensor(tensors, name)
    require_dtype(name, tensor, dtypes)
    require_shape(name, tensor, shape, "per tensor")
    if finite:
        require_finite(name, tensor)
    return tensor


FORMAT = QuarkInt8()
