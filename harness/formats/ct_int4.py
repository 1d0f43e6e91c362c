"""`ct-int4`: compressed-tensors `pack-quantized` int4 weight-only (W4A16), symmetric, per group.

Tensors: `weight_packed` int32 [N, ceil(K/8)], `weight_scale` in the model dtype
[N, ceil(K/g)], `weight_shape` int64 [2] = [N, K]. Each int32 word holds 8 consecutive
columns, column 8w + i in bits 4i..4i+3 (least significant first), each stored offset-binary
(code + 8, so code = nibble - 8 in [-8, 7]); a last partial word is padded with zero nibbles.
W = code * weight_scale[row, column // g]. Symmetric: no `weight_zero_point` (an asymmetric
config is refused). Config: `quant_method: compressed-tensors`, `format: pack-quantized`, one
config group with int 4-bit `group` weights of `group_size` g (32, 64 or 128), no activations.

Scales follow llm-compressor's min-max observer and compressed-tensors 0.20's
`calculate_qparams` / compressor, in the model dtype: scale = amax / 7.5 per group of g
columns, a zero scale replaced by finfo(dtype).eps; code = round(clamp(w / scale, -8, 7))
(round half to even). A K that is not a multiple of g has a partial last group: the layout
expresses it (ct allocates ceil(K/g) scales, with a warning) and so does this quantizer, but
ct 0.20's quantize and dequantize raise for it, so such modules are `exact-or-refuse`.
"""

from __future__ import annotations

import torch

from harness.core.errors import UnsupportedFormat
from harness.core.numerics import ceil_div
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
from harness.formats.fp8_block import block_amax, expand_block_grid

FORMAT_NAME = "pack-quantized"
GROUP_SIZES = (32, 64, 128)
NIBBLES_PER_WORD = 8
CODE_MIN, CODE_MAX = -8, 7
#: offset-binary: the nibble stores code + 8
CODE_OFFSET = 8
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def config_group(config) -> dict | None:
    """The single config group of a compressed-tensors pack-quantized int4 config, else None."""
    group = single_group(config, FORMAT_NAME)
    weights = (group or {}).get("weights")
    if not isinstance(weights, dict) or (weights.get("type"), weights.get("num_bits")) != ("int", 4):
        return None
    return group


def ct_int4_scale(group_amax: torch.Tensor) -> torch.Tensor:
    """`calculate_qparams`, symmetric int4: amax / ((7 - -8) / 2) in amax's dtype; 0 -> finfo.eps."""
    scale = group_amax / torch.tensor((CODE_MAX - CODE_MIN) / 2, dtype=group_amax.dtype)
    return torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype), scale)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> int32 words [N, ceil(K/8)]: offset-binary nibbles, column 8w + i at
    bit 4i of word w, zero nibbles padding the last word."""
    rows, cols = codes.shape
    words = ceil_div(cols, NIBBLES_PER_WORD)
    nibbles = torch.zeros(rows, words * NIBBLES_PER_WORD, dtype=torch.int64)
    nibbles[:, :cols] = codes.to(torch.int64) + CODE_OFFSET
    shifts = 4 * torch.arange(NIBBLES_PER_WORD, dtype=torch.int64)
    unsigned = (nibbles.reshape(rows, words, NIBBLES_PER_WORD) << shifts).sum(dim=-1)
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 words [N, ceil(K/8)] -> int64 codes [N, K], from the words' bits (the reference)."""
    unsigned = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.arange(NIBBLES_PER_WORD, dtype=torch.int64, device=packed.device)
    nibbles = (unsigned.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0], -1)[:, :cols] - CODE_OFFSET


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


class CtInt4(QuantFormat):
    name = "ct-int4"
    description = "compressed-tensors int4 pack-quantized W4A16 (int32 weight_packed, per-group weight_scale)"
    suffixes = ("weight_packed", "weight_scale", "weight_shape")
    marker = "weight_packed"
    knobs = {"group_size": Knob(128, GROUP_SIZES, "columns that share one weight_scale")}

    def matches(self, quantization_config):
        return config_group(quantization_config) is not None

    def quantization_config(self, knobs, ignore):
        weights = {
            "dynamic": False,
            "group_size": knobs["group_size"],
            "num_bits": 4,
            "strategy": "group",
            "symmetric": True,
            "type": "int",
        }
        return single_group_config(FORMAT_NAME, weights, ignore)

    def knobs_from_config(self, quantization_config):
        group = config_group(quantization_config)
        if group is None:
            raise FormatError(f"quantization_config is not compressed-tensors {FORMAT_NAME} int4")
        weights = group["weights"]
        wanted = {"strategy": "group", "symmetric": True}
        wrong = {key: weights.get(key) for key, value in wanted.items() if weights.get(key) != value}
        if wrong:
            raise UnsupportedFormat(
                f"compressed-tensors {FORMAT_NAME} int4 with {wrong} weights (the harness defines {wanted} only)"
            )
        if weights.get("actorder") == "group":
            raise UnsupportedFormat("int4 weights with actorder 'group' (a weight_g_idx permutation)")
        if group.get("input_activations"):
            raise FormatError("int4 pack-quantized with quantized input activations is not W4A16")
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise FormatError(f"group_size {size!r} is not a positive int")
        return {"group_size": size}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        # the observer and the compressor see the module's weight, in the model dtype
        weight = weight.to(model_dtype)
        rows, cols = weight.shape
        block = self.scale_block(knobs, (rows, cols))
        scale = ct_int4_scale(block_amax(weight, block).to(model_dtype))  # a max is exact in any dtype
        scaled = weight / expand_block_grid(scale, rows, cols, block)
        codes = torch.round(scaled.clamp(CODE_MIN, CODE_MAX)).to(torch.int8)
        tensors = {
            "weight_packed": pack_int4(codes),
            "weight_scale": scale,
            "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
        }
        column_group = torch.arange(cols) // block[1]
        result = QuantizedWeight(tensors, truth=codes.to(torch.float64) * scale.to(torch.float64)[:, column_group])
        return partial_last_group(result, cols, block[1], "group_size")

    def dequantize(self, tensors, knobs):
        packed = require_tensor(tensors, "weight_packed")
        scale = require_tensor(tensors, "weight_scale")
        require_dtype("weight_packed", packed, (torch.int32,))
        require_dtype("weight_scale", scale, SCALE_DTYPES)
        if "weight_zero_point" in tensors:
            raise FormatError("weight_zero_point present: this int4 format is symmetric")
        rows, cols = read_weight_shape(require_tensor(tensors, "weight_shape"))
        require_shape("weight_packed", packed, (rows, ceil_div(cols, NIBBLES_PER_WORD)), "8 int4 per int32 word")
        group = knobs["group_size"]
        require_shape("weight_scale", scale, (rows, ceil_div(cols, group)), f"one scale per {group} columns")
        require_finite("weight_scale", scale)
        codes = unpack_int4(packed, cols).to(torch.float64)
        return codes * expand_block_grid(scale.to(torch.float64), rows, cols, (1, group))

    def scale_block(self, knobs, shape):
        return 1, knobs["group_size"]

    def subnormal_amax(self, knobs, weight_amax):
        # scale = amax / 7.5 = 2**-130: subnormal in bfloat16 and float32 (normal down to 2**-126);
        # a float16 model's scale underflows to 0 and becomes eps instead
        return 7.5 * 2.0**-130


FORMAT = CtInt4()
