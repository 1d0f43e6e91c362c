"""Re-dequantize block-FP8 weights that transformers' CPU fallback scaled with a block grid it
inferred from the shape (known issue transformers-fp8-block-grid-inferred-from-shape).

The bug: without FP8 kernels transformers dequantizes FineGrainedFP8 at load
(`Fp8Dequantize._dequantize_one`) with the block `weight.shape // scale.shape`, ignoring the
declared `weight_block_size`. When a dimension is not a multiple of the block but divides by the
ceil grid, it silently uses another block: 160 rows with blocks of 128 (grid 2) are read as blocks
of 80, so rows 80..127 get the second block's scale. On tiny-qwen2 quantized with blocks of 200
every projection is hit (256 = 2 x 128, 768 = 4 x 192) and held-out perplexity goes from 1.4498 to
1.4765 (the golden gate's limit is 1.4571; repaired: 1.4494, the gate passes). Shapes that divide by neither are refused at load
(another known issue): there is no model to repair.

When it applies, per module, decided before the module is touched:
- the checkpoint is `quant_method: fp8` with a declared block (the harness's fp8-block format);
- the live weight is dense (a converted FP8Linear applies the declared block itself: skipped);
- the inferred block differs from the declared one in effect: rows % grid_rows == 0 and
  cols % grid_cols == 0 (else transformers would have refused) and (rows // grid_rows,
  cols // grid_cols) != (min(bn, rows), min(bk, cols));
- the live weight differs from the reference (the declared grid, float64, rounded once to the live
  dtype) beyond the dtype's weight tolerance (cases/tolerances.toml: two ulps) AND agrees with the
  inferred-grid reading within it. Both, not just "differs and the shape is not a multiple": a
  weight changed by something else (fine-tuning, another fix) matches neither reading and is left
  alone with the reason; a weight already correct (a second application, a fixed transformers)
  matches the reference and is left alone. The inferred reading is computed in float64 here,
  transformers computes it in float32 and rounds to the model dtype: at most one ulp apart, inside
  the tolerance.

The repair writes the reference rounded once to the live dtype, in place (tied parameters keep
their tie). Memory: one module at a time, its float64 reference and inferred readings (24 bytes
per element: 384 MiB for a 4096 x 4096 weight); the fix is for models that fit a CPU fallback.
Version range: measured on transformers 5.23; the same code path since 5.0 (the known issue's
range).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from harness.fixes._redequantize import (
    ModuleTarget,
    QuantizedCheckpoint,
    repair_each_module,
    repair_misread,
)
from harness.fixes._shared import SkipTensor
from harness.fixes.base import Fix, FixReport
from harness.formats.fp8_block import decode_ue8m0, expand_block_grid

NAME = "fp8-block-grid"
KNOWN_ISSUE = "transformers-fp8-block-grid-inferred-from-shape"


def inferred_block(rows: int, cols: int, grid: tuple[int, int]) -> tuple[int, int] | None:
    """The block transformers' CPU fallback uses (shape // scale grid); None where it refuses."""
    if rows % grid[0] or cols % grid[1]:
        return None
    return rows // grid[0], cols // grid[1]


def inferred_grid_reading(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """What transformers' CPU fallback computes for one module, in float64: the e4m3 codes times
    the stored scale grid spread with the block `shape // grid`; SkipTensor where it refuses the
    shape. Also harness.differential.misreadings' prediction for the known issue."""
    rows, cols = codes.shape
    grid = tuple(scale_inv.shape)
    inferred = inferred_block(rows, cols, grid) if len(grid) == 2 else None
    if inferred is None:
        raise SkipTensor(
            f"[{rows}, {cols}] does not divide by the grid {list(grid)}: transformers refuses "
            "this shape at load, so it did not dequantize it"
        )
    # every e4m3 value is exact in float64; UE8M0 scales (typed or bytes) are read by their bits
    if scale_inv.dtype in (torch.float8_e8m0fnu, torch.uint8):
        scale_inv = decode_ue8m0("weight_scale_inv", scale_inv)
    return codes.to(torch.float64) * expand_block_grid(scale_inv.to(torch.float64), rows, cols, inferred)


def repair_fp8_block_grid(
    model: torch.nn.Module, checkpoint_dir: str | Path, *, key_mapping: Mapping[str, str] | None = None
) -> FixReport:
    """Write the declared-grid dequantization into every dense weight that holds transformers'
    inferred-grid one (module docstring). `key_mapping` is the load's, as in transformers."""
    report = FixReport(NAME)
    source = QuantizedCheckpoint.open(checkpoint_dir)
    if source.fmt.name != "fp8-block":
        report.warnings.append(f"not a block-FP8 checkpoint ({source.fmt.name}): nothing to repair")
        return report
    block = (source.knobs["block_rows"], source.knobs["block_cols"])

    def repair_one(target: ModuleTarget) -> str:
        _, _, weight = target.live_weight()
        rows, cols = weight.shape
        grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        effective = (min(block[0], rows), min(block[1], cols))
        inferred = inferred_block(rows, cols, grid)
        if inferred is None:
            raise SkipTensor(
                f"[{rows}, {cols}] does not divide by the grid {list(grid)}: transformers refuses "
                "this shape at load, so it did not dequantize it"
            )
        if inferred == effective:
            raise SkipTensor(f"the inferred block {list(inferred)} is the declared one: not affected")
        tensors = source.tensors(target.module)
        if tuple(tensors["weight_scale_inv"].shape) != grid:
            raise SkipTensor(
                f"weight_scale_inv is {list(tensors['weight_scale_inv'].shape)}, not the grid "
                f"{list(grid)} of block {list(block)}: not this bug's layout"
            )
        misread = inferred_grid_reading(tensors["weight"], tensors["weight_scale_inv"])
        wrong_now = repair_misread(
            weight,
            source.reference(target.module, tensors),
            misread,
            source.fmt.name,
            "declared-grid dequantization",
            "inferred-grid reading",
        )
        return (
            f"scaled with blocks {list(inferred)} inferred from the shape instead of the declared "
            f"{list(block)} ({wrong_now} elements off); re-dequantized"
        )

    return repair_each_module(model, source, report, key_mapping, repair_one)


FIX = Fix(
    name=NAME,
    repairs=(
        "transformers' CPU fallback dequantizes FineGrainedFP8 weights with a block inferred from "
        "shape // scale grid instead of the declared weight_block_size: for shapes that are not a multiple of "
        "the block but divide by the grid (160 rows, blocks of 128), whole row or column ranges get a "
        "neighbouring block's scale, silently."
    ),
    engines=("transformers",),
    versions=">=5.0",
    formats=("fp8-block",),
    detection=(
        "fp8-block checkpoint; dense live weight; shape divisible by the ceil grid with shape // grid "
        "different from the declared block; the live weight differs from the reference (declared grid) "
        "beyond the dtype's weight tolerance and equals the inferred-grid reading within it"
    ),
    apply=repair_fp8_block_grid,
    known_issues=(KNOWN_ISSUE,),
    kinds=("weight-mismatch",),
)
