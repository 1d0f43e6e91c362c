"""`ct-mxfp8` (read, not written): compressed-tensors `mxfp8-quantized`, OCP microscaling FP8 weights
(llm-compressor 0.14's MXFP8A16 and MXFP8 presets).

Measured on llm-compressor 0.14's own export (cases/producers/llmcompressor/llama-mxfp8a16): `weight`
float8_e4m3fn [N, K] and `weight_scale` uint8 [N, ceil(K/32)], one E8M0 scale per 32 consecutive
columns of a row: W = e4m3 * 2**(weight_scale - 127) (OCP MX v1.0; 0xFF is NaN there and refused
here). Config: one group of float 8-bit `group` weights, group_size 32, `scale_dtype: torch.uint8`.

Scales are compressed-tensors' `generate_mx_scales` for 8 bits: the group amax rounded to a power
of two as MXFP4's are (harness.formats.ct_mxfp4.round_to_power_of_two: ct rounds with E2M1's
mantissa for both widths), exponent = 127 + log2(that) - 8 (8 = floor(log2(448)), the E4M3
maximum's exponent) clamped to [0, 255]; codes = e4m3(clamp(w / scale, -448, 448)).

Its MXFP8 preset adds dynamic MXFP8 inputs (E8M0 scales per 32 columns of each token), defined in
harness.oracle.activations as compressed-tensors computes them.
"""

from __future__ import annotations

import torch

from harness.core.numerics import encode_e4m3
from harness.formats import ct_mxfp4 as mx
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
from harness.formats.fp8_block import block_amax, expand_block_grid

FORMAT_NAME = "mxfp8-quantized"
#: compressed-tensors' `_MX_ELEM_OFFSET[8]`: floor(log2(448)), the E4M3 maximum's exponent
ELEMENT_EXPONENT = 8
WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "group",
    "group_size": mx.GROUP,
    "symmetric": True,
    "scale_dtype": "torch.uint8",
}


def config_group(config) -> dict | None:
    return single_group(config, FORMAT_NAME)


class CtMxfp8(QuantFormat):
    name = "ct-mxfp8"
    description = "compressed-tensors MXFP8 (e4m3 weight, uint8 E8M0 weight_scale per 32 columns)"
    suffixes = ("weight", "weight_scale")
    marker = "weight_scale"
    knobs = {}

    def matches(self, quantization_config):
        return config_group(quantization_config) is not None

    def quantization_config(self, knobs, ignore):
        """The weights' part of the config (no generator writes this format)."""
        return single_group_config(FORMAT_NAME, {"dynamic": False, **WEIGHTS}, ignore)

    def knobs_from_config(self, quantization_config):
        group = config_group(quantization_config)
        if group is None:
            raise FormatError(f"quantization_config is not compressed-tensors {FORMAT_NAME}")
        weights = group.get("weights") or {}
        wrong = {key: weights.get(key) for key, value in WEIGHTS.items() if weights.get(key) != value}
        if wrong:
            raise FormatError(f"{FORMAT_NAME} weights need {WEIGHTS}, config has {wrong}")
        return {}  # its MXFP8 inputs, where the config quantizes them: harness.oracle.activations

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        """compressed-tensors' MXFP8 codes and scales: the tensors this format stores (the audit's model
        of a module); no generator writes it."""
        if weight.dim() != 2:
            raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
        weight = weight.to(model_dtype)
        rows, cols = weight.shape
        block = (1, mx.GROUP)
        scale = mx.ct_mx_scale(block_amax(weight, block).to(model_dtype), ELEMENT_EXPONENT)
        stored = mx.compress_mx_scale(scale)
        codes = encode_e4m3(weight.to(torch.float64) / expand_block_grid(scale.to(torch.float64), rows, cols, block))
        truth = codes.to(torch.float64) * expand_block_grid(mx.decode_e8m0(stored), rows, cols, block)
        return QuantizedWeight({"weight": codes, "weight_scale": stored}, truth=truth)

    def dequantize(self, tensors, knobs):
        weight = require_tensor(tensors, "weight")
        scale = require_tensor(tensors, "weight_scale")
        require_dtype("weight", weight, (torch.float8_e4m3fn,))
        require_dtype("weight_scale", scale, tuple(mx.SCALE_STORAGES.values()))
        if weight.dim() != 2:
            raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
        rows, cols = weight.shape
        scale = mx.e8m0_codes(scale)
        require_shape(
            "weight_scale", scale, (rows, -(-cols // mx.GROUP)), f"one E8M0 scale per {mx.GROUP} columns of K {cols}"
        )
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        decoded = torch.where(scale == mx.E8M0_NAN, nan, mx.decode_e8m0(scale))
        require_finite("weight_scale", decoded, "E8M0 NaN code 0xFF")
        return weight.to(torch.float64) * expand_block_grid(decoded, rows, cols, (1, mx.GROUP))

    def scale_block(self, knobs, shape):
        return 1, mx.GROUP


FORMAT = CtMxfp8()
