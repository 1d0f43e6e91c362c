"""`ct-mxfp4`: compressed-tensors `mxfp4-pack-quantized`, OCP microscaling FP4 weights (W4A16).

Tensors: `weight_packed` uint8 [N, K/2] (E2M1 codes, even column in the low nibble, the NVFP4
packing), `weight_scale` uint8 [N, ceil(K/32)]: one E8M0 scale per 32 consecutive columns of a
row, a biased power-of-two exponent, W = e2m1 * 2**(weight_scale - 127) (OCP MX v1.0; 0xFF is
NaN there and refused here). No global scale, no `weight_shape`: K is 2 x the packed width, so an
odd K cannot be stored (the quantizer refuses it). Config: `quant_method: compressed-tensors`,
`format: mxfp4-pack-quantized`, one group of float 4-bit `group` weights, group_size 32,
`scale_dtype: torch.uint8`, as ct 0.20 writes its `MXFP4A16` preset (its `MXFP4` preset adds
dynamic MXFP4 activations and writes the same tensors; both are read). AutoRound's own config over
these tensors (`packing_format: auto_round:llm_compressor`, `data_type: mx_fp`,
harness.formats.auto_round) is read as the same.

Scales follow llm-compressor's min-max observer and ct 0.20's `calculate_qparams` in the model
dtype: the group amax is rounded to a power of two by its bits (`round_to_power_2`: up when its
mantissa is >= 1.75, i.e. when amax / 2**floor(log2 amax) >= 1.75; a subnormal amax becomes the
smallest normal when >= 0.75 of it, else 0), exponent = 127 + log2(that) - 2 clamped to [0, 255],
the scale parameter 2**(exponent - 127) in the model dtype (0 -> 1, ct's uint8 eps: a float16 model
below 2**-24), stored as 127 + floor(log2(scale)); codes = E2M1(clamp(w / scale, -6, 6)).
A K that is even but not a multiple of 32 has a partial last group: the layout holds it (ct
allocates ceil(K/32) scales, with a warning), ct 0.20's quantize and dequantize raise for it, so
such modules are `exact-or-refuse`, as `ct-int4`'s.

Scale encoding (knob `scale_storage`): the E8M0 bytes are stored as uint8, as every real producer
writes them (llm-compressor / ct, gpt-oss's release), or typed as torch.float8_e8m0fnu, the same
bytes (safetensors F8_E8M0). The config is the same for both: the storage is a property of the
tensors, so the reference reads each scale by its bits whichever of the two dtypes types it. A
loader that converts a float8_e8m0fnu scale to an integer by value (`.to(torch.int32)`: byte 130,
8.0, becomes 8, not 130) reads every exponent wrong.
"""

from __future__ import annotations

import torch

from harness.core.numerics import E2M1_MAX, encode_e2m1, pack_e2m1, unpack_e2m1
from harness.formats import equivalents
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
from harness.formats.nvfp4_common import E2M1_MAGNITUDES

FORMAT_NAME = "mxfp4-pack-quantized"
GROUP = 32
E8M0_BIAS = 127
#: OCP MX: the one E8M0 code that is not a power of two
E8M0_NAN = 0xFF
#: ct's `_MX_ELEM_OFFSET[4]`: floor(log2(6)), the E2M1 maximum's exponent
ELEMENT_EXPONENT = 2
#: ct's `_get_dtype_eps(torch.uint8)`: the scale that replaces one that is 0 in the model dtype
ZERO_SCALE = 1.0
#: the dtypes the E8M0 scale bytes may be stored as, by `scale_storage` (the same bytes either way)
SCALE_STORAGES = {"uint8": torch.uint8, "float8_e8m0fnu": torch.float8_e8m0fnu}
TYPED_STORAGE_NOTE = (
    "E8M0 scales stored as float8_e8m0fnu (the same bytes as uint8, typed): a loader must read them "
    "by their bits; one that converts them to an integer by value (.to(torch.int32): byte 130, 8.0, "
    "becomes 8, not 130) reads every exponent wrong"
)


def config_group(config) -> dict | None:
    """The single config group of a compressed-tensors MXFP4 config (or of AutoRound's own config
    over these tensors, harness.formats.auto_round), else None."""
    return single_group(equivalents.read_as(config), FORMAT_NAME)


def round_to_power_of_two(amax: torch.Tensor) -> torch.Tensor:
    """ct's `round_to_power_2` for E2M1 (one mantissa bit), from its definition on the bits of a
    floating-point number: add half of the mantissa's top-two-bit step, keep sign and exponent.
    Normal m * 2**E -> 2**E, or 2**(E + 1) when m >= 1.75 (inf past the dtype's largest finite);
    subnormal f * tiny -> tiny when f >= 0.75, else 0. Same dtype as `amax`."""
    info = torch.finfo(amax.dtype)
    values = amax.to(torch.float64)
    mantissa, exponent = torch.frexp(values)  # values = mantissa * 2**exponent, mantissa in [0.5, 1)
    normal = torch.ldexp(torch.ones_like(values), exponent - 1 + (mantissa >= 0.875).to(exponent.dtype))
    subnormal = torch.where(values >= 0.75 * info.tiny, info.tiny, 0.0).to(torch.float64)
    rounded = torch.where(values >= info.tiny, normal, subnormal)
    return torch.where(rounded > info.max, torch.inf, rounded).to(amax.dtype)


def ct_mx_scale(group_amax: torch.Tensor, element_exponent: int = ELEMENT_EXPONENT) -> torch.Tensor:
    """`calculate_qparams` for MX scales: the scale parameter (a power of two) in amax's dtype;
    `element_exponent` the element maximum's (E2M1's 2; E4M3's 8: harness.formats.ct_mxfp8)."""
    power = round_to_power_of_two(group_amax).to(torch.float64)
    exponent = (torch.log2(power) + (E8M0_BIAS - element_exponent)).clamp(0, 255)  # -inf (a zero amax) -> 0
    scale = torch.exp2(exponent - E8M0_BIAS).to(group_amax.dtype)
    return torch.where(scale == 0, torch.tensor(ZERO_SCALE, dtype=scale.dtype), scale)


def compress_mx_scale(scale: torch.Tensor) -> torch.Tensor:
    """ct's `compress_mx_scale`: the biased exponent of a power-of-two scale, uint8."""
    return (torch.floor(torch.log2(scale.to(torch.float64))) + E8M0_BIAS).to(torch.int64).to(torch.uint8)


def e8m0_codes(scale: torch.Tensor) -> torch.Tensor:
    """The E8M0 bytes of a uint8 or float8_e8m0fnu scale, as uint8: by their bits, never by value."""
    return scale.view(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes -> float64 2**(code - 127) (0xFF, NaN, is the caller's to handle)."""
    codes = e8m0_codes(codes)
    return torch.ldexp(torch.ones(codes.shape, dtype=torch.float64), codes.to(torch.int64) - E8M0_BIAS)


def require_whole_bytes(columns: int) -> None:
    if columns % 2:
        raise FormatError(
            f"K={columns} is odd: mxfp4-pack-quantized stores two columns per byte and no weight_shape, "
            "so an odd K cannot be written"
        )


class CtMxfp4(QuantFormat):
    name = "ct-mxfp4"
    description = "compressed-tensors MXFP4 (weight_packed E2M1, uint8 E8M0 weight_scale per 32 columns)"
    suffixes = ("weight_packed", "weight_scale")
    marker = "weight_packed"
    knobs = {
        "scale_storage": Knob(
            "uint8",
            tuple(SCALE_STORAGES),
            "dtype the E8M0 scale bytes are stored as (the same bytes; the config does not change)",
        ),
    }

    def matches(self, quantization_config):
        return config_group(quantization_config) is not None

    def quantization_config(self, knobs, ignore):
        weights = {
            "dynamic": False,
            "group_size": GROUP,
            "num_bits": 4,
            "scale_dtype": "torch.uint8",
            "strategy": "group",
            "symmetric": True,
            "type": "float",
        }
        return single_group_config(FORMAT_NAME, weights, ignore)

    def knobs_from_config(self, quantization_config):
        group = config_group(quantization_config)
        if group is None:
            raise FormatError(f"quantization_config is not compressed-tensors {FORMAT_NAME}")
        weights = group.get("weights") or {}
        wanted = {
            "num_bits": 4,
            "type": "float",
            "strategy": "group",
            "group_size": GROUP,
            "symmetric": True,
            "scale_dtype": "torch.uint8",
        }
        wrong = {key: weights.get(key) for key, value in wanted.items() if weights.get(key) != value}
        if wrong:
            raise FormatError(f"{FORMAT_NAME} weights need {wanted}, config has {wrong}")
        return {}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        if weight.dim() != 2:
            raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
        weight = weight.to(model_dtype)  # the observer and the compressor see the module's weight
        rows, cols = weight.shape
        require_whole_bytes(cols)
        block = (1, GROUP)
        group_amax = block_amax(weight, block).to(model_dtype)  # a max is exact in any dtype
        if torch.isinf(round_to_power_of_two(group_amax)).any():
            raise FormatError(
                f"a group amax of {float(group_amax.max()):g} rounds to a power of two past the largest "
                f"{str(model_dtype).removeprefix('torch.')}: compressed-tensors' scale would be infinite"
            )
        scale = ct_mx_scale(group_amax)
        scaled = (weight / expand_block_grid(scale, rows, cols, block)).clamp(-E2M1_MAX, E2M1_MAX)
        codes = encode_e2m1(scaled)
        stored = compress_mx_scale(scale)
        magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes & 7]
        values = torch.where((codes & 8) != 0, -magnitude, magnitude)
        powers = torch.exp2(stored.to(torch.float64) - E8M0_BIAS)[:, torch.arange(cols) // GROUP]
        storage = knobs.get("scale_storage", "uint8")
        typed = stored.view(SCALE_STORAGES[storage])  # the same bytes
        result = QuantizedWeight({"weight_packed": pack_e2m1(codes), "weight_scale": typed}, truth=values * powers)
        result = partial_last_group(result, cols, GROUP, "the MXFP4 group size")
        if storage != "uint8":
            result.notes.append(TYPED_STORAGE_NOTE)
        return result

    def dequantize(self, tensors, knobs):
        packed = require_tensor(tensors, "weight_packed")
        scale = require_tensor(tensors, "weight_scale")
        require_dtype("weight_packed", packed, (torch.uint8,))
        if packed.dim() != 2:
            raise FormatError(f"weight_packed has {packed.dim()} dimensions, expected 2")
        require_dtype("weight_scale", scale, tuple(SCALE_STORAGES.values()))
        scale = e8m0_codes(scale)  # float8_e8m0fnu: the same bytes, read by their bits
        rows, cols = packed.shape[0], 2 * packed.shape[1]
        groups = -(-cols // GROUP)
        require_shape(
            "weight_scale", scale, (rows, groups), f"one E8M0 scale per {GROUP} columns of K {cols}, the last partial"
        )
        decoded = torch.where(scale == E8M0_NAN, torch.tensor(float("nan"), dtype=torch.float64), decode_e8m0(scale))
        require_finite("weight_scale", decoded, "E8M0 NaN code 0xFF")
        return unpack_e2m1(packed, cols) * expand_block_grid(decoded, rows, cols, (1, GROUP))

    def scale_block(self, knobs, shape):
        return 1, GROUP

    def subnormal_amax(self, knobs, weight_amax):
        # E8M0 has no subnormals: this amax (1.5 * 2**-125) gets the smallest code, 0, whose scale
        # 2**-127 is subnormal in bfloat16 and float32 (a float16 model's weights flush to 0 first)
        return 1.5 * 2.0**-125


FORMAT = CtMxfp4()
