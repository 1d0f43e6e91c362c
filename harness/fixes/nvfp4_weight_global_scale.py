"""Re-dequantize compressed-tensors NVFP4 weights whose `weight_global_scale` holds ModelOpt's
multiplier instead of compressed-tensors' divisor (known issues
transformers-nvfp4-global-scale-convention-unchecked and ct-nvfp4-global-scale-convention-unchecked).

The bug: compressed-tensors' NVFP4 weight is W = e2m1 x weight_scale / weight_global_scale, the
global scale a DIVISOR 2688/amax (2688 = 448 x 6). A checkpoint converted from ModelOpt (whose
`weight_scale_2` is the MULTIPLIER amax/2688) may carry the multiplier in the divisor slot. Neither
transformers nor compressed-tensors checks: the weight comes out multiplied by 1/g^2 (~1e8 on
tiny-qwen2). This fix is for the WEIGHT global scale; the activation one (`input_global_scale`),
which cannot be judged statically, is nvfp4_input_global_scale's.

Detection rule, per module, from the checkpoint alone: with g the stored weight_global_scale and
S the largest e4m3 block scale of `weight_scale`, the weight amax each convention implies is
    divisor reading:    6 S / g            multiplier reading:    6 S g
A weight's amax is at most 2688 (the producers refuse larger ones: the convention would no longer
be detectable), so the slot holds a multiplier when g < 1 AND 6 S / g > 2688 (the divisor reading
implies an amax the format cannot hold). Measured on tiny-qwen2 quantized to ct-nvfp4 (all 14
Linears): g = 7744..16060 (amax 0.17..0.35) and S = 448 (the group holding the amax always maps
to e4m3's maximum), so a correct divisor is >= 7744 and its swapped value 6.2e-5..1.3e-4; the
divisor reading of a swapped slot implies amax 2.1e7..4.3e7, four orders of magnitude over 2688,
while a correct scale is 3.8 orders of magnitude above the g < 1 boundary. g < 1 with block
scales so small that 6 S / g <= 2688 fits neither convention cleanly: skipped with a warning.

Repair: the multiplier reading (e2m1 x weight_scale x g, float64, by the harness reference's
NVFP4 decoder), rounded once to the live dtype, written into the dense weight; where the live
module still holds `weight_global_scale` with the stored value, it is set to 1/g (the divisor
compressed-tensors means) so a re-save or re-compression is consistent. Never twice: a live
weight already within the dtype's tolerance of the multiplier reading is skipped; one that is
within neither the divisor reading nor the multiplier reading (bfloat16 tolerance, the precision
compressed-tensors decompresses NVFP4 in) is left alone with the reason.

When: compressed-tensors' own engine decompresses at load (apply after it); through transformers
the decompression runs at the first forward, so the repair runs from a one-shot forward pre-hook
right after compressed-tensors' own (harness.fixes._redequantize.after_decompression), before
anything is computed from the misread weights. On tiny-qwen2 with layer 1's o_proj swapped (the
gate-teeth fault) held-out perplexity through transformers is 515.4 (ct-nvfp4a16; golden 1.44977) and
1.44977 after the fix: the golden gate fails before and passes after (ct-nvfp4 too, measured once).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from harness.core.numerics import decode_e4m3
from harness.fixes._redequantize import (
    DeferredRepair,
    ModuleTarget,
    QuantizedCheckpoint,
    install_deferred_repair,
    repair_each_module,
    repair_misread,
)
from harness.fixes._shared import SkipTensor
from harness.fixes.base import Fix, FixReport
from harness.formats import nvfp4_common as nv

NAME = "nvfp4-weight-global-scale"
FORMATS = ("ct-nvfp4", "ct-nvfp4a16")
KNOWN_ISSUES = ("transformers-nvfp4-global-scale-convention-unchecked", "ct-nvfp4-global-scale-convention-unchecked")


def convention(global_scale: float, largest_block_scale: float) -> str:
    """'divisor' (as compressed-tensors means it), 'multiplier' (swapped) or 'ambiguous' (module docstring)."""
    if global_scale >= 1:
        return "divisor"
    if 6.0 * largest_block_scale / global_scale > nv.FULL_RANGE:
        return "multiplier"
    return "ambiguous"


def slot_convention(tensors: Mapping[str, torch.Tensor]) -> tuple[str, float, float]:
    """(convention, stored weight_global_scale g, largest block scale S) of one module's tensors."""
    stored = nv.read_per_tensor("weight_global_scale", tensors["weight_global_scale"])
    largest = float(decode_e4m3(tensors["weight_scale"]).abs().max())
    return convention(stored, largest), stored, largest


def swapped_readings(tensors: Mapping[str, torch.Tensor], stored: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(multiplier reading: the weight meant, divisor reading: what compressed-tensors computes) of a
    module whose slot holds the multiplier `stored`, float64. The divisor reading is also
    harness.differential.misreadings' prediction for the known issues."""
    intended = nv.dequantize_nvfp4(tensors, "weight_packed", "weight_scale", "weight_global_scale", nv.MULTIPLY, None)
    return intended, intended / stored / stored  # the divisor reading: product / g, and intended = product x g


def repair_modules(
    model: torch.nn.Module, source: QuantizedCheckpoint, report: FixReport, key_mapping: Mapping[str, str] | None = None
) -> None:
    def repair_one(target: ModuleTarget) -> str:
        tensors = source.tensors(target.module)
        verdict, stored, largest = slot_convention(tensors)
        if verdict == "divisor":
            raise SkipTensor(f"weight_global_scale {stored:.6g} >= 1: a divisor, as compressed-tensors means it")
        if verdict == "ambiguous":
            report.warnings.append(
                f"{target.key}: weight_global_scale {stored:.6g} < 1 but the block scales (max "
                f"{largest:.4g}) imply amax {6 * largest / stored:.4g} <= 2688: left alone"
            )
            raise SkipTensor("ambiguous: fits neither convention cleanly")
        _, live_module, weight = target.live_weight()
        intended, misread = swapped_readings(tensors, stored)
        repair_misread(
            weight,
            intended,
            misread,
            source.fmt.name,
            "multiplier reading",
            "divisor reading",
            misread_dtype=torch.bfloat16,
        )
        live_scale = getattr(live_module, "weight_global_scale", None)
        if isinstance(live_scale, torch.Tensor) and live_scale.numel() == 1 and float(live_scale) < 1:
            with torch.no_grad():  # still the stored multiplier: put the divisor it stands for
                live_scale.fill_(1.0 / stored)
        return (
            f"weight_global_scale {stored:.6g} is a multiplier (divisor reading implies amax "
            f"{6 * largest / stored:.3g} > 2688); re-dequantized with divisor {1 / stored:.6g}"
        )

    repair_each_module(model, source, report, key_mapping, repair_one)


def install_weight_global_scale_repair(
    model: torch.nn.Module, checkpoint_dir: str | Path, *, key_mapping: Mapping[str, str] | None = None
) -> DeferredRepair:
    """Repair now if the model is decompressed, else right after compressed-tensors' decompression
    at the first forward; the returned object's `report` fills in then."""
    return install_deferred_repair(model, checkpoint_dir, NAME, FORMATS, repair_modules, key_mapping)


def repair_nvfp4_weight_global_scale(
    model: torch.nn.Module, checkpoint_dir: str | Path, *, key_mapping: Mapping[str, str] | None = None
) -> FixReport:
    """The fix's `apply`: complete on return when the model is decompressed, else filled in at the
    first forward (a warning says so until then)."""
    return install_weight_global_scale_repair(model, checkpoint_dir, key_mapping=key_mapping).report


FIX = Fix(
    name=NAME,
    repairs=(
        "a compressed-tensors NVFP4 weight_global_scale holding ModelOpt's multiplier amax/2688 instead of the "
        "divisor 2688/amax is read as a divisor without a check: the weight comes out scaled by 1/g^2 (~1e8)."
    ),
    engines=("transformers", "compressed-tensors"),
    versions=">=0",  # transformers >=5.0 and compressed-tensors >=0.12 (known issues); measured on 5.23 / 0.20
    formats=FORMATS,
    detection=(
        "from the checkpoint: weight_global_scale g < 1 and 6 x max(weight_scale) / g > 2688 (the divisor "
        "reading implies a weight amax the format cannot hold); the dense live weight matches the divisor "
        "reading, not yet the multiplier one"
    ),
    apply=repair_nvfp4_weight_global_scale,
    hook=install_weight_global_scale_repair,
    known_issues=KNOWN_ISSUES,
    kinds=("weight-mismatch",),
)
