"""Re-dequantize compressed-tensors FP8 weights whose float32 scales were cast to float16 before
decompression (known issues ct-fp8-float32-scales-flushed-in-float16 and
transformers-ct-fp8-float32-scales-flushed-in-float16).

The bug: a compressed-tensors FP8 checkpoint (tensor, channel or block strategy) may store its
`weight_scale` in float32 while the model is float16. compressed-tensors lays the scale out as a
parameter in the model dtype, so loading copies the float32 scale into float16 and the
decompression multiplies e4m3 codes by that float16 scale. Scales below float16's normal range
(6.1e-5; tiny weights, amax ~1e-6 gives scales ~1e-8) become subnormals or zero, and the weights
lose their precision or become 0, although the products themselves are representable in float16.
Measured on the known issues' reproducer (weights scaled by 1e-4, scales 3.7e-8..4.3e-8): every
Linear has 7.5k-19k of its elements (about half) off by more than two float16 ulps and 14-76
exact zeros; the live weights are bit for bit codes x float16(scale), in transformers 5.23 and in
compressed-tensors 0.20 alike.

When it applies, per module, decided before the module is touched:
- the checkpoint is compressed-tensors float-quantized FP8 (the harness's ct-fp8-* formats);
- the live weight is dense (decompressed); a still-compressed FP8 weight is not touched;
- the checkpoint's `weight_scale` is not exactly representable in the live weight's dtype (else
  the cast loses nothing and this bug cannot occur);
- the live weight differs from the reference (float64, rounded once to the live dtype) beyond
  the dtype's weight tolerance (cases/tolerances.toml) AND agrees within it with the cast-first
  reading codes x scale.to(live dtype). A weight changed otherwise is left alone with the reason.
Repair: write the reference (the checkpoint's own float32 scale, float64 product) rounded once
to the live dtype, in place.

When to apply it (the hook). With compressed-tensors' own engine (`decompress_model` after
loading) the weights are final after load: apply then. Through transformers (default
`run_compressed`, no `dequantize=True`) the model is still compressed after `from_pretrained`:
compressed-tensors decompresses it from a forward pre-hook at the first forward. Replacing that
decompression would mean re-implementing compressed-tensors' per-format decompressors (and
following their changes); repairing after it needs only the checkpoint and the reference. So
`install_scale_precision_repair` (the FIX's hook, and what `apply` does when decompression is
still pending) registers a one-shot forward pre-hook on the model after compressed-tensors' own:
it runs right after the decompression and before the first forward computes anything, so no
output is ever computed from the flushed weights. transformers' `dequantize=True` path is not
covered by the known issues and not measured here; its weights are dense after load, so `apply`
judges them by the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from harness.fixes._redequantize import (
    DeferredRepair,
    ModuleTarget,
    QuantizedCheckpoint,
    install_deferred_repair,
    refusal_skips,
    repair_each_module,
    repair_misread,
)
from harness.fixes._shared import SkipTensor
from harness.fixes.base import Fix, FixReport
from harness.formats.fp8_block import expand_block_grid

NAME = "ct-fp8-scale-precision"
FORMATS = ("ct-fp8-tensor", "ct-fp8-channel", "ct-fp8-block")
KNOWN_ISSUES = ("ct-fp8-float32-scales-flushed-in-float16", "transformers-ct-fp8-float32-scales-flushed-in-float16")


def cast_first_reading(
    source: QuantizedCheckpoint, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """What the buggy decompression computes: e4m3 codes times the scale rounded to `dtype` first,
    each scale where the format places it (the product is exact in float64; the live weight is it
    rounded once more). A module the format refuses is skipped."""
    with refusal_skips():
        grid = source.fmt.scale_grid(tensors, source.knobs).to(dtype).to(torch.float64)
    codes = tensors["weight"].to(torch.float64)  # every e4m3 value is exact in float64
    rows, cols = codes.shape
    return codes * expand_block_grid(grid, rows, cols, source.fmt.scale_block(source.knobs, (rows, cols)))


def scale_cast_reading(
    source: QuantizedCheckpoint, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """cast_first_reading, or SkipTensor when the stored scale is exact in `dtype` (the cast loses
    nothing: this bug cannot occur). Also harness.differential.misreadings' prediction."""
    scale = tensors["weight_scale"]
    if torch.equal(scale.to(dtype).to(scale.dtype), scale):
        raise SkipTensor(f"its {scale.dtype} weight_scale is exact in {dtype}: not affected")
    return cast_first_reading(source, tensors, dtype)


def repair_modules(
    model: torch.nn.Module, source: QuantizedCheckpoint, report: FixReport, key_mapping: Mapping[str, str] | None = None
) -> None:
    def repair_one(target: ModuleTarget) -> str:
        _, _, weight = target.live_weight()
        tensors = source.tensors(target.module)
        scale = tensors["weight_scale"]
        wrong_now = repair_misread(
            weight,
            source.reference(target.module, tensors),
            scale_cast_reading(source, tensors, weight.dtype),
            source.fmt.name,
            "reference dequantization",
            "scale-cast-first reading",
        )
        return (
            f"decompressed with its {scale.dtype} scale cast to {weight.dtype} first ({wrong_now} elements "
            f"off, min |scale| {scale.abs().min().item():.3g}); re-dequantized"
        )

    repair_each_module(model, source, report, key_mapping, repair_one)


def install_scale_precision_repair(
    model: torch.nn.Module, checkpoint_dir: str | Path, *, key_mapping: Mapping[str, str] | None = None
) -> DeferredRepair:
    """Repair now if the model is decompressed, else right after compressed-tensors' decompression
    at the first forward (module docstring); the returned object's `report` fills in then."""
    return install_deferred_repair(model, checkpoint_dir, NAME, FORMATS, repair_modules, key_mapping)


def repair_ct_fp8_scale_precision(
    model: torch.nn.Module, checkpoint_dir: str | Path, *, key_mapping: Mapping[str, str] | None = None
) -> FixReport:
    """The fix's `apply`: its report is complete on return when the model is already decompressed,
    and fills in at the first forward otherwise (a warning says so until then)."""
    return install_scale_precision_repair(model, checkpoint_dir, key_mapping=key_mapping).report


FIX = Fix(
    name=NAME,
    repairs=(
        "compressed-tensors FP8 weights with float32 scales in a float16 model are decompressed with the "
        "scales cast to float16 first: small scales flush to subnormals or zero and the weights lose "
        "their precision or become 0, silently."
    ),
    engines=("compressed-tensors", "transformers"),
    versions=">=0.12",  # compressed-tensors' range; through transformers >=5.0 (known issues); measured on 0.20 / 5.23
    formats=FORMATS,
    detection=(
        "ct FP8 checkpoint; dense live weight; checkpoint weight_scale not exact in the live dtype; the live "
        "weight differs from the reference beyond the dtype's weight tolerance and equals codes x "
        "scale.to(live dtype) within it. Through transformers the check runs right after compressed-tensors' "
        "decompression at the first forward (one-shot pre-hook)."
    ),
    apply=repair_ct_fp8_scale_precision,
    hook=install_scale_precision_repair,
    known_issues=KNOWN_ISSUES,
    kinds=("weight-mismatch",),
)
