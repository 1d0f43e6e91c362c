"""Integer codes packed into int32 words, the one mechanism every int4/int8 format shares.

A word holds 32/bits codes of `bits` bits each (4 or 8: no code straddles a word); slot i of a
word occupies bits [bits*i, bits*(i+1)), least significant first. Formats differ only in which
axis they pack along and which element of a run of 32/bits consecutive elements sits in slot i:
compressed-tensors and GPTQ put element i in slot i; AWQ's GEMM layout puts element
AWQ_ORDER[i] in slot i. Codes are unsigned here (a format adds its own offset); a last partial
word is padded with zero slots. Words are read as their 32 bits (two's complement int32 on disk).
"""

from __future__ import annotations

import torch

from harness.core.numerics import ceil_div

#: AutoAWQ's GEMM packing: slot i of each word holds the column 8w + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BITS = (4, 8)


def slots_per_word(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"{bits}-bit codes are not packed here (4 or 8 bits)")
    return 32 // bits


def pack(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned integer codes [R, C] -> int32 words, `dim` (0 or 1) shrunk to ceil(extent * bits / 32)."""
    per = slots_per_word(bits)
    values = codes.to(torch.int64)
    if dim == 0:
        values = values.T
    rows, cols = values.shape
    words = ceil_div(cols, per)
    padded = torch.zeros(rows, words * per, dtype=torch.int64)
    padded[:, :cols] = values
    grouped = padded.reshape(rows, words, per)
    if order is not None:
        grouped = grouped[:, :, list(order)]  # slot i <- element order[i]
    shifts = bits * torch.arange(per, dtype=torch.int64)
    unsigned = (grouped << shifts).sum(dim=-1)
    packed = torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32)
    return packed.T.contiguous() if dim == 0 else packed


def unpack(words: torch.Tensor, bits: int, extent: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> unsigned int64 codes, `dim` grown to `extent` (the reference: from the bits)."""
    per = slots_per_word(bits)
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        unsigned = unsigned.T
    shifts = bits * torch.arange(per, dtype=torch.int64, device=words.device)
    slots = (unsigned.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        elements = torch.empty_like(slots)
        elements[:, :, list(order)] = slots  # element order[i] <- slot i
        slots = elements
    codes = slots.reshape(unsigned.shape[0], -1)[:, :extent]
    return codes.T if dim == 0 else codes


def packed_extent(extent: int, bits: int) -> int:
    """Words needed along the packed axis for `extent` codes."""
    return ceil_div(extent, slots_per_word(bits))
