"""The two small float formats, decoded from their definitions (not from any engine).

FP8 E4M3 ("fn" variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
S.1111.111 is NaN; largest finite 448. FP4 E2M1: 1 sign (bit 3), 2 exponent (bias 1),
1 mantissa bit; values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. NVFP4 packs two E2M1 codes per
byte, the even column in the low nibble.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
#: FP8 E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like (infinities, NaNs); largest
#: finite 57344. Only an FP8 KV cache uses it here (vLLM's `kv_cache_dtype=fp8_e5m2`).
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
NVFP4_GROUP = 16


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * (mantissa / 8.0) * 2.0**-6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


def _e2m1_value(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exponent = (code >> 1) & 0x3
    mantissa = code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1.0 + mantissa / 2.0) * 2.0 ** (exponent - 1)


E4M3_TABLE = torch.tensor([_e4m3_value(c) for c in range(256)], dtype=torch.float64)
E2M1_TABLE = torch.tensor([_e2m1_value(c) for c in range(16)], dtype=torch.float64)


def decode_e4m3(tensor: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn tensor -> float64, through the bit-level definition."""
    if tensor.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn, got {tensor.dtype}")
    codes = tensor.view(torch.uint8).to(torch.int64)
    return E4M3_TABLE.to(tensor.device)[codes]


def encode_e4m3(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest E4M3 with saturation at +-448, as producers do (clamp, then cast)."""
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def encode_e5m2(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest E5M2 (ties to even) with saturation at +-57344 (clamp, then cast)."""
    return values.clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def unpack_e2m1(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """uint8 [N, ceil(K/2)] -> float64 [N, K]; the even column sits in the low nibble."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"expected uint8, got {packed.dtype}")
    codes = packed.to(torch.int64)
    low, high = codes & 0xF, (codes >> 4) & 0xF
    interleaved = torch.stack([low, high], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])
    return E2M1_TABLE.to(packed.device)[interleaved[:, :columns]]


E2M1_POSITIVE = E2M1_TABLE[:8]


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 code, ties to the even code, saturating at 6; int64 codes.

    Counts the midpoints between neighbouring magnitudes that |x| passes: a value exactly on a
    midpoint goes up only when the upper code is even. The sign bit is set for every x < 0, even
    when |x| rounds to 0: compressed-tensors and ModelOpt both write such values as -0 (code 8).
    NaN encodes as 0.
    """
    magnitude = values.abs()
    codes = torch.zeros(values.shape, dtype=torch.int64, device=values.device)
    for upper in range(1, 8):
        midpoint = float(E2M1_POSITIVE[upper - 1] + E2M1_POSITIVE[upper]) / 2
        passed = magnitude >= midpoint if upper % 2 == 0 else magnitude > midpoint
        codes += passed.to(torch.int64)
    return codes | ((values < 0).to(torch.int64) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """int64 codes [N, K] -> uint8 [N, ceil(K/2)], padding an odd last column with zero."""
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
