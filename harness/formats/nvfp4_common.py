"""NVFP4 logic shared by `ct-nvfp4`, `ct-nvfp4a16` and `modelopt-nvfp4`.

Both producers store E2M1 codes two per byte (uint8 [N, K/2], the even column in the low
nibble), one float8_e4m3fn scale per 16 consecutive columns of a row ([N, K/16]) and one
float32 per-tensor scale. Only that scale's convention differs: compressed-tensors DIVIDES by
it (2688/amax), ModelOpt MULTIPLIES by it (amax/2688); 2688 = 448 * 6, the largest e4m3 times
the largest e2m1. Neither producer (nor vLLM) accepts a K that is not a multiple of 16.

The convention rule: for any weight with amax <= 2688 (every real one) a correct divisor is
>= 1 and a correct multiplier <= 1, so the reference refuses a per-tensor weight scale on the
wrong side of 1: it is the other convention's value. The quantizers refuse weights with
amax > 2688 for the same reason. Activations can legitimately exceed 2688, so input scales
are only checked for being finite and positive.

Not reproduced here: both producers give the shards of a fused layer (q/k/v, gate/up) one
shared per-tensor scale, and vLLM keeps only the max over the shards; `quantize` sees one weight.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harness.core.numerics import E2M1_MAX, E4M3_MAX, NVFP4_GROUP, decode_e4m3, unpack_e2m1
from harness.formats.base import (
    FormatError,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)

GROUP = NVFP4_GROUP
FULL_RANGE = E4M3_MAX * E2M1_MAX  # 2688.0
DIVIDE, MULTIPLY = "divide", "multiply"
PER_TENSOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the E2M1 magnitudes as both producers list them; the truth path indexes this list
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def require_whole_groups(columns: int) -> None:
    if columns % GROUP:
        raise FormatError(
            f"K={columns} is not a multiple of the NVFP4 group size {GROUP}: compressed-tensors, "
            "ModelOpt and vLLM all refuse a partial last group"
        )


def observe(weight: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """The weight as a producer sees it: loaded in the model's dtype, where its amax is taken."""
    if weight.dim() != 2:
        raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
    require_whole_groups(weight.shape[1])
    observed = weight.to(model_dtype)
    amax = float(observed.abs().amax()) if observed.numel() else 0.0
    if not amax <= FULL_RANGE:
        raise FormatError(
            f"weight amax {amax} is not a finite value <= {FULL_RANGE:g}: the per-tensor scale's "
            "convention would no longer be detectable by magnitude"
        )
    return observed


def groups(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K/16, 16]."""
    return weight.reshape(weight.shape[0], weight.shape[1] // GROUP, GROUP)


def truth_from_codes(
    codes: torch.Tensor, block_scale: torch.Tensor, per_tensor: torch.Tensor, convention: str
) -> torch.Tensor:
    """Ground truth from the quantizer's own int codes, the producers' magnitude list and torch's
    e4m3 cast: independent of `dequantize`'s unpacking and bit-level tables."""
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes & 7]
    values = torch.where((codes & 8) != 0, -magnitude, magnitude)
    product = values * block_scale.to(torch.float64).repeat_interleave(GROUP, dim=1)
    scale = per_tensor.to(torch.float64).reshape(())
    return product / scale if convention == DIVIDE else product * scale


def read_per_tensor(name: str, tensor: torch.Tensor) -> float:
    """One positive finite per-tensor scale; ct writes shape [1], ModelOpt a scalar []."""
    require_dtype(name, tensor, PER_TENSOR_DTYPES)
    if tuple(tensor.shape) not in ((), (1,)):
        raise FormatError(f"{name} has shape {list(tensor.shape)}, expected [1] or [] (one per-tensor scale)")
    require_finite(name, tensor)
    value = float(tensor.to(torch.float64).reshape(()))
    if value <= 0:
        raise FormatError(f"{name} is {value!r}: a per-tensor scale must be positive")
    return value


def require_convention(name: str, value: float, convention: str) -> None:
    """Refuse a weight's per-tensor scale on the wrong side of 1 (see the module docstring)."""
    if convention == DIVIDE and value < 1:
        raise FormatError(
            f"{name} is {value:.6g} < 1: compressed-tensors' global scale is the divisor 2688/amax, "
            ">= 1 for any weight with amax <= 2688; this looks like a ModelOpt multiplier (amax/2688)"
        )
    if convention == MULTIPLY and value > 1:
        raise FormatError(
            f"{name} is {value:.6g} > 1: ModelOpt's weight_scale_2 is the multiplier amax/2688, "
            "<= 1 for any weight with amax <= 2688; this looks like a compressed-tensors divisor (2688/amax)"
        )


def dequantize_nvfp4(
    tensors: Mapping[str, torch.Tensor],
    packed_name: str,
    scale_name: str,
    global_name: str,
    convention: str,
    input_name: str | None,
) -> torch.Tensor:
    """Reference: E2M1 table decode * e4m3 bit decode of the group scale, then the per-tensor
    scale applied in its convention, all in float64 (e2m1 * scale is exact; one rounding)."""
    packed = require_tensor(tensors, packed_name)
    block_scale = require_tensor(tensors, scale_name)
    per_tensor = require_tensor(tensors, global_name)
    require_dtype(packed_name, packed, (torch.uint8,))
    if packed.dim() != 2:
        raise FormatError(f"{packed_name} has {packed.dim()} dimensions, expected 2")
    rows, columns = packed.shape[0], 2 * packed.shape[1]
    require_whole_groups(columns)
    require_dtype(scale_name, block_scale, (torch.float8_e4m3fn,))
    require_shape(
        scale_name,
        block_scale,
        (rows, columns // GROUP),
        f"one scale per {GROUP} columns of {packed_name} [{rows}, {columns // 2}] = K {columns}",
    )
    require_finite(scale_name, block_scale)
    value = read_per_tensor(global_name, per_tensor)
    require_convention(global_name, value, convention)
    if input_name is not None:
        read_per_tensor(input_name, require_tensor(tensors, input_name))
    product = unpack_e2m1(packed, columns) * decode_e4m3(block_scale).repeat_interleave(GROUP, dim=1)
    return product / value if convention == DIVIDE else product * value


def swap_per_tensor(result: QuantizedWeight, weight_name: str, input_name: str | None, slot: str) -> None:
    """Perturbation: store the other convention's value (the reciprocal) in each per-tensor slot.
    `truth` stays the intended weight: a loader must recover it or refuse the module."""
    names = [weight_name] + ([input_name] if input_name else [])
    before = result.tensors[weight_name].clone()
    for name in names:
        result.tensors[name] = (1.0 / result.tensors[name]).to(result.tensors[name].dtype)
    if torch.equal(before, result.tensors[weight_name]):
        result.notes.append(f"{weight_name} is 1, its own reciprocal: the convention swap changes no weight")
        return
    result.expectation = "exact-or-refuse"
    result.notes.append(
        f"{', '.join(names)} hold the reciprocal ({slot}): the other convention's value; detectable "
        "by magnitude, so a loader must refuse the module or recover the intended weight"
    )


def subnormal_group_amax(weight_amax: float) -> float:
    """Group amax whose e4m3 scale lands on 2**-8, subnormal (below 2**-6) with margin on both
    sides: both producers set the scale to about 448 * group_amax / weight_amax."""
    return weight_amax * 2.0**-8 / E4M3_MAX
