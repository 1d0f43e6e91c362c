"""Purpose-built inputs for a quantized Linear: activations whose quantization the checkpoint's
scheme (harness.oracle.activations) decides the same way in every arithmetic, so that an engine's
output for them tells "quantized as specified" from "not quantized" from "wrong scale" far above
rounding noise, even in bfloat16 where whole-model logits cannot (docs/findings.md).

Every element sits a fixed fraction of a grid step above a grid point (1/4 to 7/16 of the step:
never at the tie at 1/2, so no rounding order moves it across), and each group that computes a
dynamic scale holds one element at exactly the scale's amax: for FP8 the scale is a power of two
(amax / 448 exact in any float dtype), for NVFP4 a block scale on the E4M3 grid, for MXFP4 a
power of two (6 * 2**k, whose OCP scale is 2**k); for static int8 (Quark's) every element is
(k + 1/4) * s, k in [0, 31], and one per row 200 * s (beyond the top code: clamped). Quantization then
moves every element by 1/4 to 7/16 of a step (2 to 5% of its value for FP8), while bfloat16
rounds at 2**-9 to 2**-8: no bfloat16 rounding moves a quantized value across a grid point.
"""

from __future__ import annotations

import torch

from harness.core.numerics import E2M1_MAX, E4M3_MAX, NVFP4_GROUP
from harness.oracle.activations import ActivationScheme

#: how far above its grid point each element sits, in grid steps, exact in bfloat16 and float16 (an
#: E4M3 value's 3 mantissa bits plus 7/16 of a step fill bfloat16's 7). An E4M3 step is 16 bfloat16
#: ulps, the tie 8: dynamic FP8 divides by a power of two (exact), so 6 or 7 ulps is safe; a static
#: scale is arbitrary and engines round three times (x itself, the scale cast to the model dtype,
#: the division: up to 2 ulps, measured 216 = the tie from 208 + 7), so there 4 or 5 ulps.
OFFSETS = (0.375, 0.4375)
STATIC_OFFSETS = (0.25, 0.3125)
#: the dynamic FP8 scales the inputs are built for: powers of two, so amax / 448 is exact; each row
#: (per token) or row and group (per group) takes the next one in turn, 2**12 apart at most, so that
#: a scale computed over the wrong extent (one for all tokens) pushes the rows with the smaller ones
#: into E4M3's subnormals (a power-of-two ratio alone would keep their mantissas exact)
DYNAMIC_SCALES = (2.0**-4, 2.0**4, 2.0**-8, 2.0**0)
#: an MXFP8 group's amax, in units of its scale: 1.5 * 2**8, an E4M3 value whose power of two (its
#: mantissa below 1.75) is 2**8, so the MX scale is the probe's own power of two, while FP8's amax / 448
#: would not be one (a kernel that scales MXFP8 inputs as FP8 groups moves them off the grid)
MXFP8_AMAX = 384.0
#: static int8: codes below this (k + 1/4 then needs 7 significant bits, so two bfloat16 roundings of
#: 2**-9 each, the input's and the held scale's, move it 1/16 at most), and the one beyond the range
INT8_CODES = 32
INT8_CLAMPED = 200.0
#: E2M1 values below the largest, each with the distance to the next one up
_E2M1_STEPS = ((0.0, 0.5), (0.5, 0.5), (1.0, 0.5), (1.5, 0.5), (2.0, 1.0), (3.0, 1.0), (4.0, 2.0))


def probe_input(
    scheme: ActivationScheme, stored: torch.Tensor | None, in_features: int, rows: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """[rows, in_features] in `dtype`: inputs whose quantization under `scheme` (with the module's
    static scale `stored`, where the scheme has one) is decided far from any rounding boundary."""
    generator = torch.Generator().manual_seed(seed)
    if scheme.kind == "nvfp4":
        value = float(stored.to(torch.float64).reshape(()))
        global_scale = 1.0 / value if scheme.multiplier else value
        return _fp4(NVFP4_GROUP, True, global_scale, in_features, rows, generator).to(dtype)
    if scheme.kind == "mxfp4":
        return _fp4(scheme.group_size, False, 1.0, in_features, rows, generator).to(dtype)
    static = scheme.static and stored is not None
    if scheme.kind == "int8" and static:
        return _int8_static(float(stored.to(torch.float64).reshape(())), in_features, rows, generator).to(dtype)
    groups = _scale_groups(scheme, in_features)
    scale = torch.full((rows, in_features), DYNAMIC_SCALES[0], dtype=torch.float64)
    if static:
        scale.fill_(float(stored.to(torch.float64).reshape(())))
    elif scheme.strategy != "tensor":
        for index, columns in enumerate(groups):
            for row in range(rows):
                scale[row, columns.start : columns.stop] = DYNAMIC_SCALES[(row + index) % len(DYNAMIC_SCALES)]
    # E4M3 normal values 2**e * 1.mmm with e in [-3, 7]: the largest, 240 + 3/8 step, stays below 448
    exponent = torch.randint(-3, 8, (rows, in_features), generator=generator).to(torch.float64)
    mantissa = 1 + torch.randint(0, 8, (rows, in_features), generator=generator).to(torch.float64) / 8
    step = torch.exp2(exponent - 3)
    offsets = torch.tensor(STATIC_OFFSETS if static else OFFSETS, dtype=torch.float64)
    offset = offsets[torch.randint(0, 2, (rows, in_features), generator=generator)]
    sign = torch.where(torch.rand(rows, in_features, generator=generator) < 0.5, -1.0, 1.0).to(torch.float64)
    x = sign * (torch.exp2(exponent) * mantissa + offset * step) * scale
    if not static:  # one element of each group that computes a scale sits at its amax, 448 * scale
        top = MXFP8_AMAX if scheme.kind == "mxfp8" else E4M3_MAX
        for columns in groups:
            if scheme.strategy == "tensor":
                x[0, columns.start] = top * scale[0, columns.start]
                break
            pick = columns.start + torch.randint(0, len(columns), (rows,), generator=generator)
            x[torch.arange(rows), pick] = top * scale[torch.arange(rows), pick]
    return x.to(dtype)


def _int8_static(scale: float, in_features: int, rows: int, generator) -> torch.Tensor:
    """(k + 1/4) * scale with random signs and k in [0, INT8_CODES), one element a row at
    INT8_CLAMPED * scale (quantized to the top code, 127 * scale)."""
    codes = torch.randint(0, INT8_CODES, (rows, in_features), generator=generator).to(torch.float64) + 0.25
    codes[torch.arange(rows), torch.randint(0, in_features, (rows,), generator=generator)] = INT8_CLAMPED
    sign = torch.where(torch.rand(rows, in_features, generator=generator) < 0.5, -1.0, 1.0).to(torch.float64)
    return sign * codes * scale


def _scale_groups(scheme: ActivationScheme, in_features: int) -> list[range]:
    size = scheme.group_size if scheme.strategy == "group" else in_features
    return [range(start, min(start + size, in_features)) for start in range(0, in_features, size)]


def _fp4(size: int, mantissas: bool, global_scale: float, in_features: int, rows: int, generator) -> torch.Tensor:
    """E2M1 values (plus an offset) times a group scale b over the global scale G, in groups of
    `size`: b on the E4M3 grid (NVFP4, `mantissas`) or a power of two (MXFP4, G = 1); each group
    holds 6 b / G, its amax, so that its scale comes back to b."""
    groups = -(-in_features // size)
    block = torch.exp2(torch.randint(-2, 5, (rows, groups, 1), generator=generator).to(torch.float64))
    if mantissas:
        block = block * (1 + torch.randint(0, 8, (rows, groups, 1), generator=generator).to(torch.float64) / 8)
    table = torch.tensor(_E2M1_STEPS, dtype=torch.float64)
    picked = table[torch.randint(0, len(_E2M1_STEPS), (rows, groups, size), generator=generator)]
    offset = torch.tensor(OFFSETS, dtype=torch.float64)[torch.randint(0, 2, (rows, groups, size), generator=generator)]
    codes = picked[..., 0] + offset * picked[..., 1]
    position = torch.randint(0, size, (rows, groups, 1), generator=generator)
    codes.scatter_(-1, position, E2M1_MAX)
    sign = torch.where(torch.rand(rows, groups, size, generator=generator) < 0.5, -1.0, 1.0)
    x = (sign * codes * block / global_scale).reshape(rows, groups * size)[:, :in_features]
    if in_features % size:  # the last, partial group: its amax must be among its columns
        last = (groups - 1) * size
        x[:, last] = block[:, -1, 0] * E2M1_MAX / global_scale
    return x
