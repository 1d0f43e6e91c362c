"""NVFP4: compressed-tensors and ModelOpt.

compressed-tensors' weight_global_scale is a DIVISOR (2688/amax), ModelOpt's weight_scale_2 a
MULTIPLIER (amax/2688). E2M1 codes two per byte, the even column in the low nibble.

Definitions:
  ct-nvfp4: W = e2m1 * weight_scale (e4m3, one per 16 columns) / weight_global_scale
  ct-nvfp4a16: W = e2m1 * weight_scale (e4m3, one per 16 columns) / weight_global_scale
  modelopt-nvfp4: W = e2m1 * weight_scale (e4m3, one per 16 columns) * weight_scale_2
"""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.parameters import FORMAT, KNOBS, LAYOUT

# ---- reproduce.py ----

GROUP, E4M3_MAX, E2M1_MAX = 16, 448.0, 6.0
FULL_RANGE = E4M3_MAX * E2M1_MAX  # 2688
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
MODELOPT = FORMAT == "modelopt-nvfp4"
ACTIVATIONS = FORMAT != "ct-nvfp4a16"  # W4A4 stores an activation scale too
PACKED, GLOBAL, INPUT = (
    ("weight", "weight_scale_2", "input_scale")
    if MODELOPT
    else ("weight_packed", "weight_global_scale", "input_global_scale")
)


def scale_block(shape) -> tuple[int, int]:
    return 1, GROUP


def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """divisor = 2688 / amax; group scale = e4m3(group amax / 6 * divisor); codes = nearest e2m1
    of weight / (scale / divisor), two per byte, the even column in the low nibble."""
    rows, cols = weight.shape
    divisor = FULL_RANGE / weight.float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1) / E2M1_MAX * divisor).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.where(scale.float() > 0, scale.float(), 0.125).to(torch.float8_e4m3fn)
    scaled = (groups / (scale.float() / divisor).unsqueeze(-1)).reshape(rows, cols)
    codes = (scaled.abs().unsqueeze(-1) - E2M1.float()).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    activation = torch.tensor(LAYOUT["activation_amax"] / FULL_RANGE)  # ModelOpt's multiplier
    if MODELOPT:
        tensors = {"weight": packed, "weight_scale": scale, "weight_scale_2": (1 / divisor).reshape(())}
        return tensors | ({"input_scale": activation} if ACTIVATIONS else {})
    tensors = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": divisor.reshape(1)}
    return tensors | ({"input_global_scale": (1 / activation).reshape(1)} if ACTIVATIONS else {})


def dequantize_definition(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """W = e2m1 * weight_scale, divided by the ct global scale (times ModelOpt's), in float64."""
    packed = tensors[PACKED].long()
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    values = torch.where((codes & 8) != 0, -E2M1[codes & 7], E2M1[codes & 7])
    product = values * tensors["weight_scale"].to(torch.float64).repeat_interleave(GROUP, dim=1)
    per_tensor = tensors[GLOBAL].to(torch.float64).reshape(())
    return product * per_tensor if MODELOPT else product / per_tensor


def perturb_storage(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """The recipe's storage perturbation: the per-tensor scales in the other convention (their
    reciprocals). Detectable by magnitude: a divisor is >= 1 and a multiplier <= 1 for any weight
    with amax <= 2688."""
    if KNOBS.get("global_scale_convention") == "swapped":
        for name in [GLOBAL] + ([INPUT] if ACTIVATIONS else []):
            tensors[name] = 1 / tensors[name]
    return tensors, False


def subnormal_amax(weight_amax: float) -> float:
    """A group amax whose e4m3 scale lands on 2**-8 (subnormal in e4m3)."""
    return weight_amax * 2.0**-8 / E4M3_MAX
