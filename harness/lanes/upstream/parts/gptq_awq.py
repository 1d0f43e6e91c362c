"""GPTQ and AWQ integer weights, as GPTQModel / AutoGPTQ / AutoRound and AutoAWQ export them.

b-bit unsigned codes (GPTQ: b = 4 or 8; AWQ: 4), 32/b per int32 word, the least significant
first. GPTQ packs `qweight` [ceil(K b/32), N] along the inputs, element i of a run in slot i; AWQ
packs `qweight` [K, ceil(N/8)] along the outputs, slot i holding output 8w + (0, 2, 4, 6, 1, 3,
5, 7)[i]. `qzeros` [G, ceil(N b/32)] are packed along the outputs the same way; `scales` [G, N].
GPTQ's zero point is the stored value plus one in `checkpoint_format: gptq` (v1) and the stored
value in `gptq_v2`; `g_idx` [K] names each input's group (act-order: a permutation of groups).

Definitions:
  gptq: W[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n] ({bits}-bit codes, groups of {group_size} inputs, zero point = stored + 1 in checkpoint_format gptq, as stored in gptq_v2; this one: {checkpoint_format})
  awq: W[n, k] = (q[k, n] - z[k // {group_size}, n]) * scales[k // {group_size}, n] (4-bit codes and zero points in AutoAWQ's interleaved GEMM order)
"""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.parameters import FORMAT, KNOBS

# ---- reproduce.py ----

AWQ = FORMAT == "awq"
BITS = 4 if AWQ else KNOBS["bits"]
MAXQ = 2**BITS - 1
PER_WORD = 32 // BITS
#: AutoAWQ's GEMM packing: slot i of each word holds element AWQ_ORDER[i] of its run of eight
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SCALE_DTYPE = getattr(torch, KNOBS.get("scale_storage", "float16"))
V1 = not AWQ and KNOBS["checkpoint_format"] == "gptq"


def group_size(cols: int) -> int:
    return cols if KNOBS["group_size"] == -1 else KNOBS["group_size"]


def scale_block(shape) -> tuple[int, int]:
    return 1, group_size(shape[1])


def pack(codes: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """Unsigned codes [R, C] -> int32 words along `dim`, zero slots padding the last word."""
    values = codes.to(torch.int64).T if dim == 0 else codes.to(torch.int64)
    rows, cols = values.shape
    padded = torch.zeros(rows, -(-cols // PER_WORD) * PER_WORD, dtype=torch.int64)
    padded[:, :cols] = values
    runs = padded.reshape(rows, -1, PER_WORD)
    if order is not None:
        runs = runs[:, :, order]  # slot i <- element order[i]
    words = (runs << (BITS * torch.arange(PER_WORD))).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.T.contiguous() if dim == 0 else words


def unpack(words: torch.Tensor, extent: int, dim: int, order=None) -> torch.Tensor:
    unsigned = (words.to(torch.int64) & 0xFFFFFFFF).T if dim == 0 else words.to(torch.int64) & 0xFFFFFFFF
    slots = (unsigned.unsqueeze(-1) >> (BITS * torch.arange(PER_WORD))) & MAXQ
    if order is not None:
        elements = torch.empty_like(slots)
        elements[:, :, order] = slots  # element order[i] <- slot i
        slots = elements
    codes = slots.reshape(unsigned.shape[0], -1)[:, :extent]
    return codes.T if dim == 0 else codes


def input_groups(cols: int) -> torch.Tensor:
    """g_idx: each input's group. Under act-order (desc_act) the producer quantizes the inputs in
    decreasing order of importance (GPTQ: the Hessian's diagonal, so Linears reading one input
    share it; here, with no calibration data, a fixed hash of the input's index), and groups are
    runs of that order."""
    if KNOBS["group_size"] == -1:
        return torch.zeros(cols, dtype=torch.int32)
    position = torch.arange(cols)
    if KNOBS["desc_act"]:
        order = torch.argsort((torch.arange(cols, dtype=torch.int64) * 2654435761) % 2**32)
        position = torch.empty(cols, dtype=torch.int64)
        position[order] = torch.arange(cols)
    return (position // KNOBS["group_size"]).to(torch.int32)


def gptq_qparams(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's Quantizer.find_params on one group's columns (float32): (scale as stored, zero point).
    lo = min(min, 0), hi = max(max, 0); symmetric: hi = max(|lo|, hi), and lo = -hi where lo < 0;
    an all-zero group -1, 1; scale = (hi - lo) / (2**b - 1); zero = 2**(b-1) when symmetric, else
    round(-lo / scale), at least 1 in v1 (which stores zero - 1 unsigned)."""
    zero = torch.zeros((), dtype=torch.float32)
    lo, hi = torch.minimum(block.amin(dim=1), zero), torch.maximum(block.amax(dim=1), zero)
    if KNOBS["sym"]:
        hi = torch.maximum(lo.abs(), hi)
        lo = torch.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = (hi - lo) / MAXQ
    if KNOBS["sym"]:
        zeros = torch.full_like(scale, (MAXQ + 1) / 2)
    else:
        zeros = torch.round(-lo / scale).clamp(int(V1), MAXQ)
    return scale.to(SCALE_DTYPE), zeros.to(torch.int64)


def awq_qparams(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's pseudo_quantize_tensor on one group (float32): scale = max(hi - lo, 1e-5) / 15 as
    stored, zero = clamp(-round(lo / scale), 0, 15), lo and hi the group's own min and max."""
    lo, hi = block.amin(dim=1), block.amax(dim=1)
    scale = ((hi - lo).clamp(min=1e-5) / MAXQ).to(SCALE_DTYPE)
    return scale, (-torch.round(lo / scale.to(torch.float32))).clamp(0, MAXQ).to(torch.int64)


def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per group, the producer's qparams; codes = clamp(round(w / stored scale) + zero, 0, 2**b - 1)."""
    weight = weight.to(torch.float32)
    rows, cols = weight.shape
    g_idx = torch.arange(cols, dtype=torch.int32) // group_size(cols) if AWQ else input_groups(cols)
    groups = int(g_idx.max()) + 1
    qparams = awq_qparams if AWQ else gptq_qparams
    scales = torch.empty(groups, rows, dtype=SCALE_DTYPE)
    zeros = torch.empty(groups, rows, dtype=torch.int64)
    for g in range(groups):
        scales[g], zeros[g] = qparams(weight[:, torch.nonzero(g_idx == g).flatten()])
    column = g_idx.long()
    codes = (torch.round(weight / scales.to(torch.float32)[column].T) + zeros[column].T).clamp(0, MAXQ)
    if AWQ:
        return {
            "qweight": pack(codes.T, dim=1, order=AWQ_ORDER),
            "qzeros": pack(zeros, dim=1, order=AWQ_ORDER),
            "scales": scales,
        }
    return {
        "qweight": pack(codes.T, dim=0),
        "qzeros": pack(zeros - 1 if V1 else zeros, dim=1),
        "scales": scales,
        "g_idx": g_idx,
    }


def dequantize_definition(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """W[n, k] = (q[k, n] - z[group of k, n]) * scales[group of k, n], in float64."""
    scales = tensors["scales"]
    rows = scales.shape[1]
    if AWQ:
        cols = tensors["qweight"].shape[0]
        codes = unpack(tensors["qweight"], rows, dim=1, order=AWQ_ORDER)
        zeros = unpack(tensors["qzeros"], rows, dim=1, order=AWQ_ORDER)
        column = torch.arange(cols) // group_size(cols)
    else:
        g_idx = tensors.get("g_idx")
        cols = len(g_idx) if g_idx is not None else tensors["qweight"].shape[0] * PER_WORD
        column = g_idx.long() if g_idx is not None else torch.arange(cols) // group_size(cols)
        codes = unpack(tensors["qweight"], cols, dim=0)
        zeros = unpack(tensors["qzeros"], rows, dim=1) + int(V1)
    return ((codes - zeros[column]).to(torch.float64) * scales.to(torch.float64)[column]).T.contiguous()


def perturb_storage(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """GPTQ and AWQ have no storage perturbation here."""
    return tensors, False


def subnormal_amax(weight_amax: float) -> float:
    """A largest |w| whose group's scale (about 2 amax / (2**b - 1)) is subnormal in its dtype."""
    if AWQ:
        return MAXQ * 2.0**-20  # AutoAWQ's 1e-5 floor: a float16 subnormal, never a bfloat16/float32 one
    return MAXQ / 2 * 2.0 ** (-20 if SCALE_DTYPE == torch.float16 else -130)
