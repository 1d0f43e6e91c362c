"""Seed 002: an NVFP4 W4A4 activation global scale stored in the wrong convention.

The bug. compressed-tensors' `input_global_scale` is a DIVISOR, 2688/amax(X); ModelOpt's
`input_scale` is a MULTIPLIER, amax(X)/2688 (2688 = 448 * 6). A checkpoint (or a converter, or
a loader) that puts one where the other belongs makes every activation group scale off by
(2688/amax)^2: on the synthetic checkpoint the scales fall into e4m3's subnormals, whole
activations quantize to 0 and logits move by up to 5.4; on the trained tiny-qwen2, held-out
perplexity goes from 1.45 to 54.8. Nothing warns. The weight's global scale is checked by the harness's reference
(nvfp4_common.require_convention); the input's cannot be checked statically, since real
activations may exceed 2688.

Why a forward pre-hook. Engines rewrite these slots after loading (vLLM's
`process_weights_after_loading` turns the divisor into `input_global_scale_inv` and derives
`input_global_scale` and `alpha` from it; transformers decompresses compressed-tensors modules on
the first forward): a repair made at load time is overwritten. A one-shot forward pre-hook on
every module that holds an input global scale runs after all of that, before the module's own
first forward, sees the real activation x, repairs once and removes itself. The hooks fire in
network order, so each layer decides on an activation that upstream layers, already repaired,
computed correctly.

Detection rule (at the first forward with a finite, non-zero amax(x)):
    t = ln(stored divisor)          a = ln(2688 / amax(x))
A divisor and a multiplier for the same amax are reciprocals, on opposite sides of 1; the
activation says which side the divisor must be on. The stored value is the other convention's
when t and a have opposite signs AND min(|t|, |a|) >= ln(MARGIN), MARGIN = 8: the two
hypotheses are then at least 2 ln 8 = ln 64 apart in log space. A correct scale can only be
flipped when the calibration amax and this activation's amax lie on opposite sides of 2688, each
8x or more away from it (a 64x mismatch). Measured (tests/fixes/test_nvfp4_input_global_scale.py):
on the synthetic ct-nvfp4 Qwen2, |t| = 6.51 and |a| = 6.05-6.69 for every Linear, calibration vs
first-activation mismatch |t - a| <= 0.46 (a factor 1.6): the margin is 6.05 vs the 2.08 needed.
On tiny-qwen2 quantized by harness.lm (calibrated activation scales), min(|t|, |a|) = 3.47 over its
14 Linears (the largest activation amax is ~84) and the calibration vs first-activation mismatch
is <= 0.28 (a factor 1.3); held-out perplexity 1.4506 correct, 54.8 swapped, 1.4506 repaired.
Below the margin (amax within 8x of 2688, where the two conventions differ by less than 64x) the
module is left alone and a warning says so. Static check beside it: a weight global scale below 1
means the weights are in the multiplier convention too (a whole-checkpoint swap, a different bug,
reported as a warning and not repaired here).

Layouts. compressed-tensors / transformers: the divisor is `input_global_scale`. vLLM after
processing (CompressedTensorsW4A4Fp4 and ModelOpt NVFP4 alike): the divisor is
`input_global_scale_inv`, `input_global_scale` its reciprocal, `alpha` = input_global_scale *
weight_global_scale; all are repaired in place, since vLLM 0.32's NVFP4 kernels (cutlass,
flashinfer, fbgemm, b12x, pytorch, emulation) read `input_global_scale_inv` and `alpha` at every
call (humming's `input_scale_2` copy too). The vLLM layout is exercised only on GPU (vLLM has no
CPU NVFP4 kernel) and was not run here; the transformers path is measured on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.fixes.base import Fix, FixReport

NAME = "nvfp4-input-global-scale"
FULL_RANGE = 448.0 * 6.0  # the largest e4m3 times the largest e2m1
#: how far from 1 (as a factor) both the stored scale and 2688/amax(x) must be before the rule decides
MARGIN = 8.0


@dataclass
class Decision:
    """What the rule concluded for one module at its first usable forward."""

    verdict: str  # "swapped", "correct", "ambiguous"
    stored_divisor: float
    activation_amax: float
    log_stored: float  # t
    log_expected: float  # a

    def describe(self) -> str:
        return (
            f"divisor {self.stored_divisor:.6g}, first activation amax {self.activation_amax:.4g} "
            f"(2688/amax = {FULL_RANGE / self.activation_amax:.4g}; ln: stored {self.log_stored:+.2f}, "
            f"expected {self.log_expected:+.2f})"
        )


def decide(stored_divisor: float, activation_amax: float, margin: float = MARGIN) -> Decision | None:
    """The detection rule (module docstring); None when x cannot decide (amax 0 or not finite)."""
    if not (math.isfinite(activation_amax) and activation_amax > 0):
        return None
    t, a = math.log(stored_divisor), math.log(FULL_RANGE / activation_amax)
    if min(abs(t), abs(a)) < math.log(margin):
        verdict = "ambiguous"
    else:
        verdict = "swapped" if t * a < 0 else "correct"
    return Decision(verdict, stored_divisor, activation_amax, t, a)


def divisor_slot(module: torch.nn.Module) -> str | None:
    """The attribute holding the activation divisor in this module's (post-processing) layout."""
    if isinstance(getattr(module, "input_global_scale_inv", None), torch.Tensor):
        return "input_global_scale_inv"  # vLLM after process_weights_after_loading
    if isinstance(getattr(module, "input_global_scale", None), torch.Tensor):
        return "input_global_scale"  # compressed-tensors / transformers
    return None


@torch.no_grad()
def flip(module: torch.nn.Module, slot: str) -> None:
    """Replace the divisor by its reciprocal, in place (kernels read these tensors at every call),
    and every value vLLM derived from it: the multiplier `input_global_scale`, humming's copy of
    it `input_scale_2`, and `alpha`, rescaled by the same factor (whatever convention the weight
    scale in it is kept in by the kernel)."""
    divisor = getattr(module, slot)
    old = divisor.detach().clone()
    divisor.copy_(1.0 / divisor)
    if slot != "input_global_scale_inv":
        return
    for name in ("input_global_scale", "input_scale_2"):
        multiplier = getattr(module, name, None)
        if isinstance(multiplier, torch.Tensor):
            multiplier.copy_((1.0 / divisor).reshape(multiplier.shape))
    alpha = getattr(module, "alpha", None)
    if isinstance(alpha, torch.Tensor):
        alpha.mul_((old / divisor).reshape(-1)[0])  # alpha carries the multiplier 1/divisor


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


@dataclass
class InputScaleRepair:
    """The installed one-shot pre-hooks and what they found; `report` fills in as they fire."""

    report: FixReport
    margin: float = MARGIN
    decisions: dict[str, Decision] = field(default_factory=dict)
    handles: dict[str, torch.utils.hooks.RemovableHandle] = field(default_factory=dict)

    @property
    def pending(self) -> list[str]:
        """Modules whose hook has not decided yet (no forward, or only all-zero inputs)."""
        return sorted(self.handles)

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    def hook_for(self, name: str):
        def repair_before_first_forward(module, args, kwargs):
            x = _first_tensor(args, kwargs)
            slot = divisor_slot(module)
            if x is None or slot is None:
                return None
            stored = float(getattr(module, slot).detach().float().reshape(-1).max())
            if not (math.isfinite(stored) and stored > 0):
                self.report.skipped[name] = f"{slot} is {stored!r}: not a scale in either convention"
                self.handles.pop(name).remove()
                return None
            decision = decide(stored, float(x.detach().abs().amax().float()), self.margin)
            if decision is None:
                return None  # an all-zero or non-finite input (a profiling run): wait for the next one
            self.decisions[name] = decision
            if decision.verdict == "swapped":
                flip(module, slot)
                self.report.repaired.append(f"{name}.{slot}: {decision.describe()} -> {1.0 / stored:.6g}")
            elif decision.verdict == "ambiguous":
                self.report.warnings.append(
                    f"{name}.{slot}: left alone, too close to 1 to tell the conventions "
                    f"apart (within {self.margin:g}x): {decision.describe()}"
                )
            self.handles.pop(name).remove()
            return None

        return repair_before_first_forward


def install_input_scale_prehooks(
    model: torch.nn.Module, margin: float = MARGIN, report: FixReport | None = None
) -> InputScaleRepair:
    """Register the one-shot pre-hook on every module holding an NVFP4 activation global scale."""
    repair = InputScaleRepair(report or FixReport(NAME), margin)
    for name, module in model.named_modules():
        slot = divisor_slot(module)
        if slot is None:
            continue
        weight = getattr(module, "weight_global_scale", None)
        if slot == "input_global_scale" and isinstance(weight, torch.Tensor) and weight.numel():
            if float(weight.detach().float().reshape(-1).max()) < 1:
                repair.report.warnings.append(
                    f"{name}.weight_global_scale < 1: the weights hold ModelOpt multipliers too (a whole-checkpoint "
                    "convention swap; not repaired by this fix)"
                )
        repair.handles[name] = module.register_forward_pre_hook(repair.hook_for(name), with_kwargs=True)
    if not repair.handles:
        repair.report.skipped["*"] = "no module holds an NVFP4 activation global scale (not W4A4)"
    return repair


def apply(
    model: torch.nn.Module,
    checkpoint_dir: str | Path | None = None,
    *,
    margin: float = MARGIN,
    sample_input_ids: list[int] | None = None,
    **_options,
) -> FixReport:
    """Install the pre-hooks and return their report, which fills in on the model's first forward:
    the live model is judged after the engine's post-load processing (`checkpoint_dir` is not read).
    `sample_input_ids` runs that first forward now (a transformers-style model), so the report is
    complete on return."""
    repair = install_input_scale_prehooks(model, margin)
    if sample_input_ids is not None:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(sample_input_ids)], device=next(model.parameters()).device))
        if repair.pending:
            repair.report.warnings.append(f"no usable activation yet for {', '.join(repair.pending)}")
    return repair.report


FIX = Fix(
    name=NAME,
    repairs=(
        "an NVFP4 W4A4 activation global scale stored in the other convention (ModelOpt's multiplier "
        "amax/2688 in compressed-tensors' divisor slot 2688/amax, or the reverse): activations quantized "
        "with scales off by (2688/amax)^2, garbage output, no warning"
    ),
    engines=("transformers", "compressed-tensors", "vllm"),
    versions=">=0",  # no engine checks the convention (see module docstring); the input scale is not in the
    # harness's known issues, which cover the weight global scale
    formats=("ct-nvfp4", "modelopt-nvfp4"),
    detection=(
        "at a module's first forward with a non-zero input x: t = ln(stored divisor), a = ln(2688/amax(x)); "
        f"swapped when t and a have opposite signs and both |t|, |a| >= ln {MARGIN:g}; left alone and "
        "reported when either is within that margin"
    ),
    apply=apply,
    hook=install_input_scale_prehooks,
    report="002-nvfp4-activation-global-scale",
    kinds=("logprobs", "perplexity", "nonfinite-logits"),
)
