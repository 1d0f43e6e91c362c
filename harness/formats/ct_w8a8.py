"""`ct-w8a8`: compressed-tensors `int-quantized` INT8 W8A8 (llm-compressor's W8A8 / INT8 preset).

Tensors: `weight` int8 [N, K] (the code itself, two's complement) and `weight_scale` in the model
dtype [N, 1]; W = code * weight_scale[row]. Symmetric: no zero point. Config:
`quant_method: compressed-tensors`, `format: int-quantized`, one config group with int 8-bit
`channel` weights and dynamic per-token int 8-bit input activations
(harness.oracle.activations: s = amax(row) / 127.5, x -> round(clamp(x / s, -128, 127)) * s).

Scales follow compressed-tensors 0.20's `calculate_qparams` in the model dtype:
scale = amax(row) / ((127 - -128) / 2), a zero scale replaced by finfo(dtype).eps;
code = round(clamp(w / scale, -128, 127)) (round half to even).
"""

from __future__ import annotations

import torch

from harness.core.errors import UnsupportedFormat
from harness.core.numerics import ceil_div
from harness.formats.base import (
    FormatError,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)
from harness.formats.ct_common import single_group, single_group_config
from harness.formats.ct_int4 import SCALE_DTYPES, code_range, ct_int_qparams, group_min_max
from harness.formats.fp8_block import expand_block_grid

FORMAT_NAME = "int-quantized"
BITS = 8
#: the activation args as compressed-tensors 0.20 serializes its W8A8 preset
DYNAMIC_TOKEN_INT8 = {
    "dynamic": True,
    "group_size": None,
    "num_bits": BITS,
    "strategy": "token",
    "symmetric": True,
    "type": "int",
}


def config_group(config, bits: int = BITS) -> dict | None:
    """The single config group of a compressed-tensors int-quantized config of `bits`-bit int weights
    (int8 here; int4 codes one per int8: harness.formats.ct_int_groups), else None."""
    group = single_group(config, FORMAT_NAME)
    weights = (group or {}).get("weights")
    if not isinstance(weights, dict) or (weights.get("type"), weights.get("num_bits")) != ("int", bits):
        return None
    return group


def quantize_codes(weight: torch.Tensor, bits: int, group: int, model_dtype: torch.dtype) -> QuantizedWeight:
    """compressed-tensors' symmetric `bits`-bit codes, one per int8, and their scales per row and
    `group` columns (the whole row: per channel), computed in the model dtype as its observer sees
    the module's weight."""
    weight = weight.to(model_dtype)
    rows, cols = weight.shape
    lo, hi = group_min_max(weight, group)
    scale, _ = ct_int_qparams(lo, hi, bits, True)
    expanded = expand_block_grid(scale, rows, cols, (1, group))
    qmin, qmax = code_range(bits)
    codes = torch.round((weight / expanded).clamp(qmin, qmax)).to(torch.int8)
    truth = codes.to(torch.float64) * expanded.to(torch.float64)
    return QuantizedWeight({"weight": codes, "weight_scale": scale}, truth=truth)


def read_codes(tensors, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` int8 [N, K] and `weight_scale` [N, ceil(K / group)] (group None: one per row), checked;
    the codes' values are the caller's to check."""
    weight = require_tensor(tensors, "weight")
    scale = require_tensor(tensors, "weight_scale")
    require_dtype("weight", weight, (torch.int8,))
    require_dtype("weight_scale", scale, SCALE_DTYPES)
    if weight.dim() != 2:
        raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
    rows, cols = weight.shape
    if group is None:
        require_shape("weight_scale", scale, (rows, 1), "one scale per output row")
    else:
        require_shape("weight_scale", scale, (rows, ceil_div(cols, group)), f"one scale per {group} columns")
    require_finite("weight_scale", scale)
    return weight, scale


class CtW8a8(QuantFormat):
    name = "ct-w8a8"
    description = (
        "compressed-tensors INT8 W8A8 int-quantized (int8 weight, per-channel scale, per-token int8 activations)"
    )
    suffixes = ("weight", "weight_scale")
    marker = "weight_scale"
    knobs = {}

    def matches(self, quantization_config):
        return config_group(quantization_config) is not None

    def quantization_config(self, knobs, ignore):
        weights = {"dynamic": False, "num_bits": BITS, "strategy": "channel", "symmetric": True, "type": "int"}
        config = single_group_config(FORMAT_NAME, weights, ignore)
        config["config_groups"]["group_0"]["input_activations"] = dict(DYNAMIC_TOKEN_INT8)
        return config

    def knobs_from_config(self, quantization_config):
        group = config_group(quantization_config)
        if group is None:
            raise FormatError(f"quantization_config is not compressed-tensors {FORMAT_NAME} int8")
        weights = group["weights"]
        wanted = {"strategy": "channel", "symmetric": True}
        wrong = {key: weights.get(key) for key, value in wanted.items() if weights.get(key, True) != value}
        if wrong:
            raise UnsupportedFormat(
                f"compressed-tensors {FORMAT_NAME} int8 with {wrong} weights (the harness defines {wanted} only)"
            )
        inputs = group.get("input_activations")
        declared = {k: (inputs or {}).get(k) for k in ("type", "num_bits", "strategy", "dynamic", "symmetric")}
        if declared != {k: DYNAMIC_TOKEN_INT8[k] for k in declared}:
            raise UnsupportedFormat(
                f"compressed-tensors {FORMAT_NAME} int8 weights with input activations {declared} (the harness "
                "defines dynamic symmetric per-token int8 only)"
            )
        return {}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        return quantize_codes(weight, BITS, weight.shape[1], model_dtype)

    def dequantize(self, tensors, knobs):
        weight, scale = read_codes(tensors, None)
        return weight.to(torch.float64) * scale.to(torch.float64)

    def scale_block(self, knobs, shape):
        return 1, shape[1]

    def subnormal_amax(self, knobs, weight_amax):
        return 127.5 * 2.0**-130  # scale 2**-130: subnormal in bfloat16 and float32


FORMAT = CtW8a8()
