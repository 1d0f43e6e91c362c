"""MXFP4 (OCP microscaling): compressed-tensors mxfp4-pack-quantized, gpt-oss's release format.

E2M1 codes two per byte, the even column in the low nibble; one E8M0 scale (uint8, a biased
power-of-two exponent) per 32 consecutive columns of a row. gpt-oss stores its experts packed, one
tensor per projection: `experts.{proj}_blocks` [E, N, K/32, 16], `_scales` [E, N, K/32] and
`_bias` [E, N], expert e's slice being its weight_packed, weight_scale and bias. KNOBS
["scale_storage"] = "float8_e8m0fnu" stores the scales typed as torch.float8_e8m0fnu instead of
uint8: the same bytes, the same config, so they are read by their bits either way.

Definitions:
  ct-mxfp4: W = e2m1 * 2**(weight_scale - 127) (E8M0, one per 32 columns)
  mxfp4: W = e2m1 * 2**(scales - 127) (E8M0, one per 32 columns; each expert's slice of _blocks and _scales)
"""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.parameters import KNOBS

# ---- reproduce.py ----

GROUP, E2M1_MAX, E8M0_BIAS = 32, 6.0, 127
#: the dtype the E8M0 scale bytes are stored as (the same bytes either way)
SCALE_STORAGE = getattr(torch, KNOBS.get("scale_storage", "uint8"))
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def scale_block(shape) -> tuple[int, int]:
    return 1, GROUP


def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per group: the smallest power of two 2**e with group amax / 2**e <= 6 (e = 0 for an all-zero
    group), stored as the byte e + 127 (uint8, or the same byte typed float8_e8m0fnu: KNOBS
    ["scale_storage"]); codes = nearest e2m1 of weight / 2**e."""
    rows, cols = weight.shape
    groups = weight.double().reshape(rows, cols // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / E2M1_MAX)), torch.zeros_like(amax))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = (groups / torch.exp2(exponent).unsqueeze(-1)).reshape(rows, cols).clamp(-E2M1_MAX, E2M1_MAX)
    codes = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    codes_e8m0 = (exponent + E8M0_BIAS).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": codes_e8m0.view(SCALE_STORAGE)}


def dequantize_definition(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """W = e2m1 * 2**(weight_scale - 127), in float64; the scale's bytes read as uint8 (by their
    bits: a float8_e8m0fnu byte 130 is 2**3, never the integer 8)."""
    packed = tensors["weight_packed"].long()
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    values = torch.where((codes & 8) != 0, -E2M1[codes & 7], E2M1[codes & 7])
    exponent = tensors["weight_scale"].view(torch.uint8).to(torch.float64) - E8M0_BIAS
    return values * torch.exp2(exponent).repeat_interleave(GROUP, dim=1)[:, : values.shape[1]]


def perturb_storage(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """MXFP4 has no storage perturbation here."""
    return tensors, False


def subnormal_amax(weight_amax: float) -> float:
    """A group amax (1.5 * 2**-125) that gets the smallest scale code, 0: its scale 2**-127 is
    subnormal in bfloat16 and float32 (E8M0 itself has no subnormals)."""
    return 1.5 * 2.0**-125


def pack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's disk layout: every `…experts.E.{proj}.{weight_packed, weight_scale, bias}` stacked
    over E into `…experts.{proj}_blocks` (codes [N, K/32, 16]), `_scales` and `_bias`."""
    suffixes = {"weight_packed": "_blocks", "weight_scale": "_scales", "bias": "_bias"}
    packed, stacks = {}, {}
    for name, tensor in tensors.items():
        parent, _, rest = name.partition(".experts.")
        expert, _, projection_suffix = rest.partition(".")
        projection, _, suffix = projection_suffix.partition(".")
        if not rest or not expert.isdigit() or suffix not in suffixes:
            packed[name] = tensor
            continue
        if suffix == "weight_packed":
            tensor = tensor.reshape(tensor.shape[0], -1, 16)
        stacks.setdefault(f"{parent}.experts.{projection}{suffixes[suffix]}", {})[int(expert)] = tensor
    for name, experts in stacks.items():
        packed[name] = torch.stack([experts[e] for e in range(len(experts))])
    return packed
