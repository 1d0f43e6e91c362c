"""`awq`: AWQ int4 in AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`), with zero points.

Tensors, for a Linear with N outputs and K inputs, groups of g inputs, G = ceil(K/g):
- `qweight` int32 [K, ceil(N/8)]: codes packed along the *outputs*, eight per word in AutoAWQ's
  interleaved order: the nibble at bits 4i of word w holds output 8w + AWQ_ORDER[i]
  (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7; harness.formats.int_packing), unsigned codes in [0, 15];
- `qzeros` int32 [G, ceil(N/8)]: zero points in [0, 15], packed the same way, stored as they are;
- `scales` [G, N] (float16 as AutoAWQ writes it; bfloat16 and float32 read too).
W[n, k] = (q[k, n] - z[k // g, n]) * scales[k // g, n]. Config: `{"quant_method": "awq", "bits": 4,
"group_size": g, "zero_point": true, "version": "gemm", "modules_to_not_convert": [...]}`.
`zero_point: false` and the GEMV / Marlin / exllama layouts are not defined here. AutoRound's own
format (`quant_method: auto-round`) with `packing_format: auto_round:auto_awq` is this layout
(AutoRound packs it with AutoAWQ's GEMM packer; its config says `sym: false` for the zero points).

Scales follow AutoAWQ's `pseudo_quantize_tensor` (float32, per group, no clamping to zero):
scale = max(hi - lo, 1e-5) / 15 with lo, hi the group's min and max, z = clamp(-round(lo / scale),
0, 15); the stored float16 scale is what the codes are computed against, as AutoAWQ's `pack` does:
q = clamp(round(w / scale) + z, 0, 15). The generator uses no activation-aware search (the
format is the same). An N that is not a multiple of 8 is padded with zero slots, which AWQ's own
loaders do not allocate: such a module is `exact-or-refuse`.
"""

from __future__ import annotations

import torch

from harness.core.errors import UnsupportedFormat
from harness.core.numerics import ceil_div
from harness.formats import int_packing
from harness.formats.auto_round import AUTO_ROUND
from harness.formats.base import (
    FormatError,
    Knob,
    QuantFormat,
    QuantizedWeight,
    require_finite,
    require_shape,
)
from harness.formats.gptq import SCALE_STORAGES, packed_tensors
from harness.formats.int_packing import AWQ_ORDER

QUANT_METHOD = "awq"
AUTO_ROUND_AWQ = "auto_round:auto_awq"
BITS = 4
MAXQ = 2**BITS - 1
PER_WORD = 32 // BITS
GROUP_SIZES = (32, 64, 128)


class Awq(QuantFormat):
    name = "awq"
    description = "AWQ int4 GEMM (qweight packed along outputs in AWQ order, qzeros, float16 scales)"
    suffixes = ("qweight", "qzeros", "scales")
    marker = "qweight"
    knobs = {
        "group_size": Knob(128, GROUP_SIZES, "inputs per group"),
        "scale_storage": Knob("float16", tuple(SCALE_STORAGES), "dtype of scales (AutoAWQ writes float16)"),
    }

    def matches(self, quantization_config):
        method = quantization_config.get("quant_method")
        if method == AUTO_ROUND:
            return quantization_config.get("packing_format") == AUTO_ROUND_AWQ
        return method == QUANT_METHOD

    def quantization_config(self, knobs, ignore):
        return {
            "bits": BITS,
            "group_size": knobs["group_size"],
            "modules_to_not_convert": list(ignore),
            "quant_method": QUANT_METHOD,
            "version": "gemm",
            "zero_point": True,
        }

    def knobs_from_config(self, quantization_config):
        if not self.matches(quantization_config):
            raise FormatError(f"quantization_config is not quant_method {QUANT_METHOD}")
        get = quantization_config.get
        if get("bits", BITS) != BITS:
            raise UnsupportedFormat(f"AWQ with bits={get('bits')!r} (the harness defines 4)")
        version = str(get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedFormat(f"AWQ version {get('version')!r} (the harness defines the GEMM layout only)")
        if get("quant_method") == AUTO_ROUND and (get("sym") is not False or get("data_type", "int") != "int"):
            raise UnsupportedFormat(
                f"auto-round {AUTO_ROUND_AWQ} with sym={get('sym')!r}, data_type={get('data_type')!r}"
            )
        if get("zero_point", True) is not True:
            raise UnsupportedFormat(f"AWQ with zero_point={get('zero_point')!r} (the harness defines zero points)")
        group = get("group_size", 128)
        if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
            raise FormatError(f"group_size {group!r} is not a positive int")
        return {"group_size": group}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        weight = weight.to(model_dtype).to(torch.float32)  # the producer quantizes the model's weight
        rows, cols = weight.shape
        group = knobs["group_size"]
        groups = ceil_div(cols, group)
        # per group of columns (a partial last group: its own columns only)
        lo = torch.stack([weight[:, g * group : (g + 1) * group].amin(dim=1) for g in range(groups)], dim=1)
        hi = torch.stack([weight[:, g * group : (g + 1) * group].amax(dim=1) for g in range(groups)], dim=1)
        scale = ((hi - lo).clamp(min=1e-5) / MAXQ).to(SCALE_STORAGES[knobs.get("scale_storage", "float16")])
        zero = (-torch.round(lo / scale.to(torch.float32))).clamp(0, MAXQ).to(torch.int64)
        column = torch.arange(cols) // group
        row_scale, row_zero = scale.to(torch.float32)[:, column], zero[:, column]
        codes = (torch.round(weight / row_scale) + row_zero).clamp(0, MAXQ).to(torch.int64)
        tensors = {
            "qweight": int_packing.pack(codes.T, BITS, dim=1, order=AWQ_ORDER),
            "qzeros": int_packing.pack(zero.T, BITS, dim=1, order=AWQ_ORDER),
            "scales": scale.T.contiguous(),
        }
        truth = (codes - row_zero).to(torch.float64) * row_scale.to(torch.float64)
        result = QuantizedWeight(tensors, truth=truth)
        if rows % PER_WORD:
            result.expectation = "exact-or-refuse"
            result.notes.append(
                f"N={rows} is not a multiple of {PER_WORD}: qweight/qzeros carry zero-padded words, which "
                "AWQ's own loaders do not allocate"
            )
        return result

    def dequantize(self, tensors, knobs):
        codes, zeros, scales = self.affine_parts(tensors, knobs)
        return (codes - zeros) * scales

    def affine_parts(self, tensors, knobs):
        qweight, qzeros, scales = packed_tensors(tensors)
        group = knobs["group_size"]
        cols, rows = qweight.shape[0], scales.shape[1]
        groups = ceil_div(cols, group)
        require_shape("qweight", qweight, (cols, ceil_div(rows, PER_WORD)), "8 int4 outputs per int32 word")
        require_shape("scales", scales, (groups, rows), f"one scale per {group} inputs and output")
        require_shape("qzeros", qzeros, (groups, ceil_div(rows, PER_WORD)), "8 int4 zero points per int32 word")
        require_finite("scales", scales)
        codes = int_packing.unpack(qweight, BITS, rows, dim=1, order=AWQ_ORDER)  # [K, N]
        zeros = int_packing.unpack(qzeros, BITS, rows, dim=1, order=AWQ_ORDER)  # [G, N]
        column = torch.arange(cols) // group
        return tuple(t.to(torch.float64).T.contiguous() for t in (codes, zeros[column], scales[column]))

    def scale_block(self, knobs, shape):
        return 1, knobs["group_size"]

    def splits_by_rows(self, knobs):
        return False  # outputs lie along dim 1 (qweight, scales), packed in qzeros

    def subnormal_amax(self, knobs, weight_amax):
        # a one-signed group's scale = amax / 15, float16 subnormal below 2**-14; AutoAWQ clamps the
        # range at 1e-5, so bfloat16 and float32 scales cannot be subnormal: this is their smallest
        return MAXQ * 2.0**-20


FORMAT = Awq()
