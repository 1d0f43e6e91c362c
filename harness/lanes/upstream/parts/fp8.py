"""FP8 with a grid of scales: FineGrainedFP8, compressed-tensors float-quantized, ModelOpt FP8.

KNOBS["scale_fmt"] (fp8-block): "ue8m0*" round each scale up to a power of two before quantizing
(config `scale_fmt: ue8m0`), stored in the scale dtype, typed float8_e8m0fnu ("ue8m0-e8m0fnu") or
as E8M0 bytes in uint8 ("ue8m0-uint8"), read by their bits; "ue8m0-unrounded" declares ue8m0 and
stores amax / 448 unrounded.

Definitions:
  fp8-block: W = fp8 * weight_scale_inv of its [{block_rows}, {block_cols}] block (edge blocks partial);
    with weight_block_size null one weight_scale_inv [1, 1] per tensor
  ct-fp8-tensor: W = fp8 * weight_scale (one per tensor)
  ct-fp8-channel: W = fp8 * weight_scale of its row
  ct-fp8-block: W = fp8 * weight_scale of its [{block_rows}, {block_cols}] block (edge blocks partial)
  modelopt-fp8: W = fp8 * weight_scale (one per tensor; input_scale the static activation multiplier)
  autofp8: W = fp8 * weight_scale (one per tensor, 0-D; input_scale where activation_scheme is static)
"""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.common import MODEL_DTYPE
from harness.lanes.upstream.parts.parameters import FORMAT, KNOBS, LAYOUT

# ---- reproduce.py ----

E4M3_MAX = 448.0
#: tensor, channel or block (FineGrainedFP8 with weight_block_size null: one [1, 1] grid per tensor)
STRATEGY = {"fp8-block": "block", "modelopt-fp8": "tensor", "autofp8": "tensor"}.get(FORMAT, FORMAT.rpartition("-")[2])
STRATEGY = "tensor" if KNOBS.get("granularity") == "tensor" else STRATEGY
SCALE_NAME = "weight_scale_inv" if FORMAT == "fp8-block" else "weight_scale"
SCALE_FMT = KNOBS.get("scale_fmt", "float")
#: UE8M0 scales stored as their E8M0 bytes (2**e -> e + 127)
E8M0_STORAGE = {"ue8m0-e8m0fnu": torch.float8_e8m0fnu, "ue8m0-uint8": torch.uint8}.get(SCALE_FMT)


def scale_block(shape) -> tuple[int, int]:
    """The [rows, cols] one scale covers."""
    if STRATEGY == "tensor":
        return tuple(shape)
    if STRATEGY == "channel":
        return 1, shape[1]
    return KNOBS["block_rows"], KNOBS["block_cols"]


def scale_dtype() -> torch.dtype:
    """The recipe's scale dtype; float32 for ModelOpt, which has no other."""
    named = KNOBS.get("scale_dtype", "float32")
    return MODEL_DTYPE if named == "model" else getattr(torch, named)


def expand(grid: torch.Tensor, rows: int, cols: int, block) -> torch.Tensor:
    """A [ceil(rows/bn), ceil(cols/bk)] grid repeated over [rows, cols], edge blocks cut."""
    bn, bk = min(block[0], rows), min(block[1], cols)
    return grid.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """scale = amax / 448 per block (1 where that is 0), fp8 = e4m3(weight / scale)."""
    rows, cols = weight.shape
    bn, bk = scale_block((rows, cols))
    grid_rows, grid_cols = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(grid_rows * bn, grid_cols * bk)
    padded[:rows, :cols] = weight.float().abs()
    amax = padded.reshape(grid_rows, bn, grid_cols, bk).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if SCALE_FMT not in ("float", "ue8m0-unrounded"):  # UE8M0: rounded up to a power of two
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.to(scale_dtype())
    quantized = (weight.float() / expand(scale.float(), rows, cols, (bn, bk))).clamp(-E4M3_MAX, E4M3_MAX)
    stored = (torch.log2(scale.double()).round() + 127).to(torch.uint8).view(E8M0_STORAGE) if E8M0_STORAGE else scale
    tensors = {
        "weight": quantized.to(torch.float8_e4m3fn),
        SCALE_NAME: stored.reshape(1) if STRATEGY == "tensor" and FORMAT != "fp8-block" else stored,
    }
    if FORMAT == "autofp8" and KNOBS.get("scale_shape", "scalar") == "scalar":  # 0-D, as AutoFP8 saves it
        tensors[SCALE_NAME] = tensors[SCALE_NAME].reshape(())
    if KNOBS.get("input_scale"):  # a static per-tensor activation scale
        tensors["input_scale"] = torch.tensor([LAYOUT["activation_amax"] / E4M3_MAX]).to(scale_dtype())
        if FORMAT == "autofp8":
            tensors["input_scale"] = tensors["input_scale"].reshape(tensors[SCALE_NAME].shape)
    if FORMAT == "modelopt-fp8":  # always static, a scalar as ModelOpt exports it; amax in the model dtype
        amax = torch.tensor(LAYOUT["activation_amax"], dtype=MODEL_DTYPE).float()
        tensors["input_scale"] = amax / E4M3_MAX
    return tensors


def dequantize_definition(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """W = fp8 * scale of its block, in float64."""
    weight = tensors["weight"]
    rows, cols = weight.shape
    scale = tensors[SCALE_NAME]
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):  # E8M0 bytes, read by their bits
        scale = torch.exp2(scale.view(torch.uint8).double() - 127)
    scale = scale.to(torch.float64)
    scale = scale.reshape(1, 1) if STRATEGY == "tensor" else scale
    return weight.to(torch.float64) * expand(scale, rows, cols, scale_block((rows, cols)))


def perturb_storage(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """The recipe's storage perturbation: the scale grid stored transposed. True when the result
    cannot be told apart from a valid checkpoint (a square grid): it then means what it says."""
    if KNOBS.get("scale_layout") != "transposed":
        return tensors, False
    grid = tensors[SCALE_NAME]
    tensors[SCALE_NAME] = grid.t().contiguous()
    return tensors, tensors[SCALE_NAME].shape == grid.shape


def subnormal_amax(weight_amax: float) -> float:
    """A block amax whose scale (amax / 448 = 2**-130) is subnormal in float32 and bfloat16."""
    return E4M3_MAX * 2.0**-130
