"""`ct-int4` and `ct-int8`: compressed-tensors `pack-quantized` integer weight-only (W4A16,
W4A16_ASYM, W8A16), per group.

Tensors: `weight_packed` int32 [N, ceil(K*b/32)], `weight_scale` in the model dtype
[N, ceil(K/g)], `weight_shape` int64 [2] = [N, K], and for an asymmetric scheme
`weight_zero_point` int32 [ceil(N*b/32), ceil(K/g)]. Codes are b-bit (b = 4 or 8) integers in
[-2**(b-1), 2**(b-1) - 1] stored offset-binary (code + 2**(b-1)); a word holds 32/b consecutive
columns, column (32/b)w + i in bits b*i.. (least significant first), a last partial word padded
with zero slots (harness.formats.int_packing). Zero points are codes of the same width, packed
the same way but along the rows (compressed-tensors' `packed_dim=0`).
W = (code - zero_point[row, column // g]) * weight_scale[row, column // g]; a symmetric scheme
has no zero point (0). Config: `quant_method: compressed-tensors`, `format: pack-quantized`, one
config group with int b-bit `group` weights of `group_size` g (32, 64 or 128), no activations.

Scales follow llm-compressor's min-max observer and compressed-tensors 0.20's
`calculate_qparams` / compressor, in the model dtype, with lo = min(group min, 0) and
hi = max(group max, 0): symmetric, scale = max(|lo|, hi) / ((qmax - qmin) / 2); asymmetric,
scale = (hi - lo) / (qmax - qmin) and zero_point = round(clamp(qmin - lo / scale, qmin, qmax))
(an all-zero group: zero point 0); a zero scale replaced by finfo(dtype).eps;
code = round(clamp(w / scale + zero_point, qmin, qmax)) (round half to even). A K that is not a
multiple of g has a partial last group: the layout expresses it (ct allocates ceil(K/g) scales,
with a warning) and so does this quantizer, but ct 0.20's quantize and dequantize raise for it,
so such modules are `exact-or-refuse`.
"""

from __future__ import annotations

import torch

from harness.core.errors import UnsupportedFormat
from harness.core.numerics import ceil_div
from harness.formats import int_packing
from harness.formats.base import (
    FormatError,
    Knob,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)
from harness.formats.ct_common import partial_last_group, single_group, single_group_config
from harness.formats.fp8_block import expand_block_grid

FORMAT_NAME = "pack-quantized"
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def code_range(bits: int) -> tuple[int, int]:
    """[qmin, qmax] of a signed b-bit code."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def config_group(config, bits: int) -> dict | None:
    """The single config group of a compressed-tensors pack-quantized `bits`-bit int config, else None."""
    group = single_group(config, FORMAT_NAME)
    weights = (group or {}).get("weights")
    if not isinstance(weights, dict) or (weights.get("type"), weights.get("num_bits")) != ("int", bits):
        return None
    return group


def group_min_max(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """min(group min, 0) and max(group max, 0) per row and group of columns, in the weight's dtype
    (a partial last group padded with zeros, which move neither)."""
    rows, cols = weight.shape
    padded = torch.zeros(rows, ceil_div(cols, group) * group, dtype=weight.dtype)
    padded[:, :cols] = weight
    grouped = padded.reshape(rows, -1, group)
    zero = torch.zeros((), dtype=weight.dtype)
    return torch.minimum(grouped.amin(-1), zero), torch.maximum(grouped.amax(-1), zero)


def ct_int_qparams(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool):
    """compressed-tensors 0.20's `calculate_qparams` for int weights, in lo's dtype: (scale, zero
    point as int8 codes, or None when symmetric)."""
    qmin, qmax = code_range(bits)
    dtype = lo.dtype
    eps = torch.tensor(torch.finfo(dtype).eps, dtype=dtype)
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / torch.tensor((qmax - qmin) / 2, dtype=dtype)
        return torch.where(scale == 0, eps, scale), None
    scale = (hi - lo) / torch.tensor(float(qmax - qmin), dtype=dtype)
    zero = torch.clamp(torch.tensor(float(qmin), dtype=dtype) - lo / scale, qmin, qmax)
    zero = torch.where(scale == 0, torch.zeros_like(zero), zero)  # 0/0: an all-zero group
    return torch.where(scale == 0, eps, scale), torch.round(zero).to(torch.int8)


def pack_codes(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Signed codes -> int32 words along `dim`, offset-binary (compressed-tensors' `pack_to_int32`)."""
    return int_packing.pack(codes.to(torch.int64) + 2 ** (bits - 1), bits, dim)


def unpack_codes(packed: torch.Tensor, bits: int, extent: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> signed int64 codes, `dim` grown to `extent` (the reference, from the bits)."""
    return int_packing.unpack(packed, bits, extent, dim) - 2 ** (bits - 1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> int32 words [N, ceil(K/8)]: offset-binary nibbles, column 8w + i at
    bit 4i of word w, zero nibbles padding the last word."""
    return pack_codes(codes, 4)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 words [N, ceil(K/8)] -> int64 codes [N, K], from the words' bits (the reference)."""
    return unpack_codes(packed, 4, cols)


def read_weight_shape(tensor: torch.Tensor) -> tuple[int, int]:
    """`weight_shape`: the unpacked [N, K], an integer tensor of two positive values."""
    if tensor.dtype not in (torch.int64, torch.int32) or tuple(tensor.shape) != (2,):
        raise FormatError(
            f"weight_shape is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, expected int64 [2]"
        )
    rows, cols = (int(v) for v in tensor.tolist())
    if rows <= 0 or cols <= 0:
        raise FormatError(f"weight_shape {[rows, cols]} is not a positive [rows, columns]")
    return rows, cols


class CtPackQuantized(QuantFormat):
    """One code width of ct's pack-quantized format; the instances differ only in `bits`."""

    suffixes = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
    marker = "weight_packed"

    def __init__(self, bits: int, name: str, description: str):
        self.bits, self.name, self.description = bits, name, description
        self.knobs = {
            "group_size": Knob(128, GROUP_SIZES, "columns that share one weight_scale"),
            "symmetric": Knob(True, (True, False), "False: asymmetric, a packed weight_zero_point per group"),
        }

    def matches(self, quantization_config):
        return config_group(quantization_config, self.bits) is not None

    def quantization_config(self, knobs, ignore):
        weights = {
            "dynamic": False,
            "group_size": knobs["group_size"],
            "num_bits": self.bits,
            "strategy": "group",
            "symmetric": knobs["symmetric"],
            "type": "int",
        }
        return single_group_config(FORMAT_NAME, weights, ignore)

    def knobs_from_config(self, quantization_config):
        group = config_group(quantization_config, self.bits)
        if group is None:
            raise FormatError(f"quantization_config is not compressed-tensors {FORMAT_NAME} int{self.bits}")
        weights = group["weights"]
        if weights.get("strategy") != "group":
            raise UnsupportedFormat(
                f"compressed-tensors {FORMAT_NAME} int{self.bits} with strategy {weights.get('strategy')!r} "
                "weights (the harness defines 'group' only)"
            )
        if weights.get("actorder") == "group":
            raise UnsupportedFormat(f"int{self.bits} weights with actorder 'group' (a weight_g_idx permutation)")
        if group.get("input_activations"):
            raise FormatError(f"int{self.bits} pack-quantized with quantized input activations is not weight-only")
        if not isinstance(weights.get("symmetric", True), bool):
            raise FormatError(f"symmetric {weights.get('symmetric')!r} is not a bool")
        if weights.get("zp_dtype") not in (None, "torch.int8"):  # llm-compressor 0.14 states torch.int8
            raise UnsupportedFormat(f"int{self.bits} zero points of zp_dtype {weights.get('zp_dtype')!r}")
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise FormatError(f"group_size {size!r} is not a positive int")
        return {"group_size": size, "symmetric": weights.get("symmetric", True)}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        # the observer and the compressor see the module's weight, in the model dtype
        weight = weight.to(model_dtype)
        rows, cols = weight.shape
        block = self.scale_block(knobs, (rows, cols))
        lo, hi = group_min_max(weight, block[1])  # a min or max is exact in any dtype
        scale, zero = ct_int_qparams(lo, hi, self.bits, knobs["symmetric"])
        scaled = weight / expand_block_grid(scale, rows, cols, block)
        if zero is not None:
            scaled = scaled + expand_block_grid(zero, rows, cols, block).to(model_dtype)
        qmin, qmax = code_range(self.bits)
        codes = torch.round(scaled.clamp(qmin, qmax)).to(torch.int8)
        tensors = {
            "weight_packed": pack_codes(codes, self.bits),
            "weight_scale": scale,
            "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
        }
        column_group = torch.arange(cols) // block[1]
        offsets = codes.to(torch.float64)
        if zero is not None:
            tensors["weight_zero_point"] = pack_codes(zero, self.bits, dim=0)
            offsets = offsets - zero.to(torch.float64)[:, column_group]
        result = QuantizedWeight(tensors, truth=offsets * scale.to(torch.float64)[:, column_group])
        return partial_last_group(result, cols, block[1], "group_size")

    def dequantize(self, tensors, knobs):
        packed = require_tensor(tensors, "weight_packed")
        scale = require_tensor(tensors, "weight_scale")
        require_dtype("weight_packed", packed, (torch.int32,))
        require_dtype("weight_scale", scale, SCALE_DTYPES)
        rows, cols = read_weight_shape(require_tensor(tensors, "weight_shape"))
        per = int_packing.slots_per_word(self.bits)
        require_shape(
            "weight_packed",
            packed,
            (rows, int_packing.packed_extent(cols, self.bits)),
            f"{per} int{self.bits} per int32",
        )
        group = knobs["group_size"]
        groups = ceil_div(cols, group)
        require_shape("weight_scale", scale, (rows, groups), f"one scale per {group} columns")
        require_finite("weight_scale", scale)
        codes = unpack_codes(packed, self.bits, cols).to(torch.float64)
        column_group = torch.arange(cols) // group
        if knobs.get("symmetric", True):
            if "weight_zero_point" in tensors:
                raise FormatError("weight_zero_point present: the config declares symmetric weights")
        else:
            zero = require_tensor(tensors, "weight_zero_point")
            require_dtype("weight_zero_point", zero, (torch.int32,))
            require_shape(
                "weight_zero_point",
                zero,
                (int_packing.packed_extent(rows, self.bits), groups),
                f"int{self.bits} zero points packed along the rows, one per group",
            )
            codes = codes - unpack_codes(zero, self.bits, rows, dim=0).to(torch.float64)[:, column_group]
        return codes * scale.to(torch.float64)[:, column_group]

    def scale_block(self, knobs, shape):
        return 1, knobs["group_size"]

    def splits_by_rows(self, knobs):
        return not self.packed_across_rows(knobs)

    def packed_across_rows(self, knobs):
        return () if knobs.get("symmetric", True) else ("weight_zero_point",)

    def unpack_rows(self, suffix, tensor, rows, knobs):
        if suffix not in self.packed_across_rows(knobs):
            raise FormatError(f"{suffix} is not packed across rows")
        require_dtype(suffix, tensor, (torch.int32,))
        require_shape(
            suffix,
            tensor,
            (int_packing.packed_extent(rows, self.bits), tensor.shape[1] if tensor.dim() == 2 else 1),
            f"int{self.bits} packed along {rows} rows",
        )
        return unpack_codes(tensor, self.bits, rows, dim=0)

    def subnormal_amax(self, knobs, weight_amax):
        # scale = amax / ((qmax - qmin) / 2) = 2**-130: subnormal in bfloat16 and float32 (normal
        # down to 2**-126); a float16 model's scale underflows to 0 and becomes eps instead.
        # Asymmetric: a one-signed group's span is amax, over (qmax - qmin) steps
        qmin, qmax = code_range(self.bits)
        steps = (qmax - qmin) / (2 if knobs.get("symmetric", True) else 1)
        return steps * 2.0**-130


FORMAT = CtPackQuantized(
    4, "ct-int4", "compressed-tensors int4 pack-quantized W4A16 (int32 weight_packed, per-group weight_scale)"
)
INT8 = CtPackQuantized(
    8, "ct-int8", "compressed-tensors int8 pack-quantized W8A16 (int32 weight_packed, per-group weight_scale)"
)
