"""Integer weights: compressed-tensors pack-quantized (W4A16, W4A16_ASYM, W8A16) and int-quantized (W8A8).

b-bit codes (b = 4 or 8) in [-2**(b-1), 2**(b-1) - 1], stored offset-binary (code + 2**(b-1)),
32/b consecutive columns per int32 word, column (32/b)w + i in bits b*i.. of word w; one scale per
row and group of columns; an asymmetric scheme adds a zero point per row and group, packed the
same way but along the rows. int-quantized stores the int8 codes themselves as `weight`, one scale
per row (its inputs are quantized too: dynamic per-token int8).

Definitions:
  ct-int4: W = (code - weight_zero_point) * weight_scale of its row and group (zero point 0 when symmetric)
  ct-int8: W = (code - weight_zero_point) * weight_scale of its row and group (zero point 0 when symmetric)
  ct-w8a8: W = weight (int8) * weight_scale of its row
"""

from __future__ import annotations

import math

import torch

from harness.lanes.upstream.parts.common import MODEL_DTYPE
from harness.lanes.upstream.parts.parameters import FORMAT, KNOBS

# ---- reproduce.py ----

BITS = 4 if FORMAT == "ct-int4" else 8
QMIN, QMAX = -(2 ** (BITS - 1)), 2 ** (BITS - 1) - 1
SYMMETRIC = KNOBS.get("symmetric", True)
#: int-quantized W8A8: unpacked int8 codes, one scale per row
UNPACKED = FORMAT == "ct-w8a8"


def group_size(cols: int) -> int:
    return cols if UNPACKED else KNOBS["group_size"]


def scale_block(shape) -> tuple[int, int]:
    return 1, group_size(shape[1])


def pack(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Signed codes -> int32 words along `dim`, offset-binary, zero slots padding the last word."""
    per = 32 // BITS
    values = (codes.to(torch.int64) - QMIN).T if dim == 0 else codes.to(torch.int64) - QMIN
    rows, cols = values.shape
    padded = torch.zeros(rows, math.ceil(cols / per) * per, dtype=torch.int64)
    padded[:, :cols] = values
    words = (padded.reshape(rows, -1, per) << (BITS * torch.arange(per))).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.T.contiguous() if dim == 0 else words


def unpack(words: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    per = 32 // BITS
    unsigned = (words.to(torch.int64) & 0xFFFFFFFF).T if dim == 0 else words.to(torch.int64) & 0xFFFFFFFF
    slots = (unsigned.unsqueeze(-1) >> (BITS * torch.arange(per))) & (2**BITS - 1)
    codes = slots.reshape(unsigned.shape[0], -1)[:, :extent] + QMIN
    return codes.T if dim == 0 else codes


def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' min-max qparams per row and group, in the model dtype: lo = min(min, 0),
    hi = max(max, 0); symmetric scale = max(|lo|, hi) / ((QMAX - QMIN) / 2); asymmetric scale =
    (hi - lo) / (QMAX - QMIN), zero point = round(clamp(QMIN - lo / scale)); code = round(clamp(w / scale + zp))."""
    weight = weight.to(MODEL_DTYPE)
    rows, cols = weight.shape
    group = group_size(cols)
    groups = math.ceil(cols / group)
    padded = torch.zeros(rows, groups * group, dtype=weight.dtype)
    padded[:, :cols] = weight
    zero = torch.zeros((), dtype=weight.dtype)
    lo = torch.minimum(padded.reshape(rows, groups, group).amin(-1), zero)
    hi = torch.maximum(padded.reshape(rows, groups, group).amax(-1), zero)
    eps = torch.finfo(weight.dtype).eps
    column = torch.arange(cols) // group
    if SYMMETRIC:
        scale = torch.maximum(lo.abs(), hi) / ((QMAX - QMIN) / 2)
        zp = torch.zeros(rows, groups, dtype=torch.int64)
    else:
        scale = (hi - lo) / (QMAX - QMIN)
        zp = torch.where(scale == 0, 0, torch.clamp(QMIN - lo / scale, QMIN, QMAX)).round().to(torch.int64)
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
    scaled = weight / scale[:, column] + zp[:, column].to(weight.dtype)
    codes = torch.round(scaled.clamp(QMIN, QMAX)).to(torch.int64)
    if UNPACKED:
        return {"weight": codes.to(torch.int8), "weight_scale": scale}
    tensors = {
        "weight_packed": pack(codes, dim=1),
        "weight_scale": scale,
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }
    if not SYMMETRIC:
        tensors["weight_zero_point"] = pack(zp, dim=0)
    return tensors


def dequantize_definition(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """W = (code - zero point) * scale of its row and group, in float64."""
    if UNPACKED:
        return tensors["weight"].to(torch.float64) * tensors["weight_scale"].to(torch.float64)
    rows, cols = (int(v) for v in tensors["weight_shape"])
    codes = unpack(tensors["weight_packed"], cols, dim=1)
    column = torch.arange(cols) // group_size(cols)
    if "weight_zero_point" in tensors:
        codes = codes - unpack(tensors["weight_zero_point"], rows, dim=0)[:, column]
    return codes.to(torch.float64) * tensors["weight_scale"].to(torch.float64)[:, column]


def perturb_storage(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """Integer formats have no storage perturbation here."""
    return tensors, False


def subnormal_amax(weight_amax: float) -> float:
    return (QMAX - QMIN) / 2 * 2.0**-130
