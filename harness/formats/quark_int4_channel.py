"""`quark-int4-channel` (read, not written): AMD Quark's int4 and uint4 weight-only exports with one
scale per output row (`quant_method: quark`, its `int4_wo_per_channel` and `uint4_wo_per_channel`
schemes; harness.formats.quark.int4_per_channel says which configs).

Measured on amd-quark 0.13's own export (cases/producers/quark/uint4_wo_per_channel): for a Linear with
N outputs and K inputs, `weight` int32 [N, K/8] (codes packed along the inputs, not the outputs as
its grouped schemes pack them, in its `reorder` order: AutoAWQ's, slot i of a word holding element
AWQ_ORDER[i]), `weight_scale` [N] (bfloat16 for a bfloat16 model), `weight_zero_point` int32 [N/8] (the
row's zero points packed the same way along N). Quark stores no K: it is 8 x the words of a row.
- uint4 (`symmetric: false`): unsigned codes q in [0, 15], W = (q - z[row]) * scale[row].
- int4 (`symmetric: true`): each nibble a two's-complement code in [-8, 7], zero points 0.
"""

from __future__ import annotations

import torch

from harness.core.numerics import ceil_div
from harness.formats import int_packing, quark
from harness.formats.base import (
    FormatError,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)
from harness.formats.int_packing import AWQ_ORDER
from harness.formats.quark_int4 import SIGNED, signed_codes

BITS = 4
PER_WORD = 8
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _unpack_rows(words: torch.Tensor, rows: int) -> torch.Tensor:
    """A 1-D run of packed int4 (one per output row) -> [rows] unsigned codes."""
    return int_packing.unpack(words.reshape(1, -1), BITS, rows, dim=1, order=AWQ_ORDER)[0]


class QuarkInt4Channel(QuantFormat):
    name = "quark-int4-channel"
    description = "AMD Quark int4/uint4 weight-only per output row (codes packed along the inputs, AWQ's order)"
    suffixes = ("weight", "weight_scale", "weight_zero_point")
    marker = "weight_scale"
    knobs = {}

    def matches(self, quantization_config):
        return quark.int4_per_channel(quantization_config) is not None

    def quantization_config(self, knobs, ignore):
        return quark.fragment(ignore)

    def knobs_from_config(self, quantization_config):
        weight = quark.int4_per_channel(quantization_config)
        if weight is None:
            raise FormatError("quantization_config is not Quark's int4 or uint4 weight-only scheme per channel")
        return {SIGNED: signed_codes(weight)}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        """Quark's per-row int4 quantization (its observer: symmetric amax / 7.5 over [-8, 7], else
        (max - min) / 15 with an integer zero point over [0, 15]): the tensors this format stores, their
        dtypes and shapes (the audit's model of a module); no generator writes this format."""
        weight = weight.to(model_dtype).to(torch.float32)
        rows = weight.shape[0]
        low, high = weight.amin(dim=1).clamp(max=0), weight.amax(dim=1).clamp(min=0)
        eps = torch.finfo(torch.float32).eps
        if knobs.get(SIGNED):
            scale = (torch.maximum(-low, high) / 7.5).clamp(min=eps)
            zeros = torch.zeros(rows, dtype=torch.int64)
            codes = torch.round(weight / scale[:, None]).clamp(-8, 7).to(torch.int64)
            stored = codes & 0xF
        else:
            scale = ((high - low) / 15).clamp(min=eps)
            zeros = (-torch.round(low / scale)).clamp(0, 15).to(torch.int64)
            codes = (torch.round(weight / scale[:, None]) + zeros[:, None]).clamp(0, 15).to(torch.int64)
            stored = codes
        tensors = {
            "weight": int_packing.pack(stored, BITS, dim=1, order=AWQ_ORDER),
            "weight_scale": scale.to(model_dtype),
            "weight_zero_point": int_packing.pack(zeros.reshape(1, -1), BITS, dim=1, order=AWQ_ORDER)[0],
        }
        truth = (codes - zeros[:, None]).to(torch.float64) * scale.to(model_dtype).to(torch.float64)[:, None]
        return QuantizedWeight(tensors, truth=truth)

    def affine_parts(self, tensors, knobs):
        packed = require_tensor(tensors, "weight")
        scale = require_tensor(tensors, "weight_scale")
        zero_point = require_tensor(tensors, "weight_zero_point")
        require_dtype("weight", packed, (torch.int32,))
        require_dtype("weight_scale", scale, SCALE_DTYPES)
        require_dtype("weight_zero_point", zero_point, (torch.int32,))
        if packed.dim() != 2:
            raise FormatError(f"weight has {packed.dim()} dimensions, expected 2")
        rows, cols = packed.shape[0], packed.shape[1] * PER_WORD
        require_shape("weight_scale", scale, (rows,), "one scale per output row")
        require_shape("weight_zero_point", zero_point, (ceil_div(rows, PER_WORD),), "8 int4 zero points per int32 word")
        require_finite("weight_scale", scale)
        codes = int_packing.unpack(packed, BITS, cols, dim=1, order=AWQ_ORDER)  # [N, K]
        zeros = _unpack_rows(zero_point, rows)
        if knobs.get(SIGNED):
            if bool((zeros != 0).any()):
                raise FormatError(
                    "symmetric int4 (signed codes) stores zero points of 0; weight_zero_point holds others"
                )
            codes = torch.where(codes >= 8, codes - 16, codes)
        expand = (rows, cols)
        return (
            codes.to(torch.float64),
            zeros.to(torch.float64)[:, None].expand(expand).contiguous(),
            scale.to(torch.float64)[:, None].expand(expand).contiguous(),
        )

    def dequantize(self, tensors, knobs):
        codes, zeros, scales = self.affine_parts(tensors, knobs)
        return (codes - zeros) * scales

    def scale_block(self, knobs, shape):
        return 1, shape[1]

    def packed_across_rows(self, knobs):
        return ("weight_zero_point",)

    def unpack_rows(self, suffix, tensor, rows, knobs):
        if suffix != "weight_zero_point":
            raise NotImplementedError(f"{self.name} packs no {suffix} across rows")
        return _unpack_rows(tensor, rows).reshape(rows, 1)


FORMAT = QuarkInt4Channel()
