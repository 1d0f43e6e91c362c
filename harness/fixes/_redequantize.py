"""Shared by the fixes that rewrite a loaded weight from the checkpoint: read the checkpoint's
quantized modules, dequantize one with the harness's float64 reference, compare a live weight with
a candidate reading under the per-dtype weight tolerance (cases/tolerances.toml), write the
reference rounded once into the live dtype, and defer a repair until compressed-tensors has
decompressed the model at its first forward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from harness.checkpoints.reader import Checkpoint
from harness.core.errors import CheckpointError, first_line
from harness.core.tolerances import load_tolerances
from harness.fixes._shared import FP8_DTYPES, SkipTensor, live_module_name, offload_problem
from harness.fixes.base import FixReport
from harness.formats.base import FormatError, QuantFormat
from harness.oracle.reference import format_and_knobs, group_modules

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass
class QuantizedCheckpoint:
    """A checkpoint's format, its dequantizer's knobs, and its quantized modules (checkpoint module
    name -> suffix -> tensor name) and plain tensors."""

    checkpoint: Checkpoint
    fmt: QuantFormat
    knobs: dict
    modules: dict[str, dict[str, str]]
    plain: list[str]

    @classmethod
    def open(cls, directory: str | Path) -> QuantizedCheckpoint:
        checkpoint = Checkpoint(directory)
        fmt, knobs = format_and_knobs(checkpoint)
        # a module's tensor stored in a shard but left out of the index is found, as the engines
        # that read whole shard files find it (a misreading or a fix must read what they read)
        modules, plain = group_modules(
            checkpoint.names() + sorted(checkpoint.unlisted), fmt, checkpoint.storage_dtypes()
        )
        return cls(checkpoint, fmt, knobs, modules, plain)

    def tensors(self, module: str) -> dict[str, torch.Tensor]:
        return {suffix: self.checkpoint.tensor(name) for suffix, name in self.modules[module].items()}

    def reference(self, module: str, tensors: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The module's weight as the format defines it, float64; a refusal skips the tensor."""
        tensors = dict(tensors if tensors is not None else self.tensors(module))
        with refusal_skips():
            fmt, knobs = self.fmt.for_module(module, self.knobs, tensors)
            return fmt.dequantize(tensors, knobs)

    def narrowed(self, module: str) -> QuantizedCheckpoint:
        """This checkpoint as read for its quantized `module`: in a mixed checkpoint (mixed), with its
        config group's format and knobs; a module no group reads is skipped."""
        with refusal_skips():
            fmt, knobs = self.fmt.for_module(module, self.knobs, self.tensors(module))
        return self if fmt is self.fmt else replace(self, fmt=fmt, knobs=dict(knobs))


@contextmanager
def refusal_skips():
    """The format's refusal of a module's tensors (FormatError, CheckpointError) as SkipTensor."""
    try:
        yield
    except (FormatError, CheckpointError) as error:
        raise SkipTensor(f"the reference refuses the checkpoint's tensors: {error}") from None


class ModuleTarget:
    """One checkpoint module under repair; `key` is what the report calls it: the checkpoint's
    weight name until the live module is found, the live weight's name after."""

    def __init__(self, live_modules: Mapping[str, torch.nn.Module], module: str, key_mapping: Mapping[str, str] | None):
        self.live_modules, self.module, self.key_mapping = live_modules, module, key_mapping
        self.key = f"{module}.weight"

    def live_weight(self) -> tuple[str, torch.nn.Module, torch.Tensor]:
        name, module, weight = live_weight(self.live_modules, self.module, self.key_mapping)
        self.key = f"{name}.weight"
        return name, module, weight


def repair_each_module(
    model: torch.nn.Module,
    source: QuantizedCheckpoint,
    report: FixReport,
    key_mapping: Mapping[str, str] | None,
    repair_one: Callable[[ModuleTarget], str],
) -> FixReport:
    """Run `repair_one` on every quantized module of `source`, in name order. It returns the
    warning that describes its repair, or raises SkipTensor with the reason; any other error
    (a malformed module) skips that module only, so one bad tensor never stops the others; a
    repair writes nothing until its checks have passed (repair_misread decides, then writes)."""
    live_modules = dict(model.named_modules())
    for module in sorted(source.modules):
        target = ModuleTarget(live_modules, module, key_mapping)
        try:
            warning = repair_one(target)
        except SkipTensor as reason:
            report.skipped[target.key] = str(reason)
            continue
        except Exception as error:
            report.skipped[target.key] = f"cannot check it: {type(error).__name__}: {first_line(error)}"
            continue
        report.repaired.append(target.key)
        report.warnings.append(f"{target.key}: {warning}")
    return report


def weight_tolerance(dtype: torch.dtype, format_name: str) -> tuple[float, float]:
    """(rel, abs) of cases/tolerances.toml for weights held in `dtype` (float64 judged as float32)."""
    tolerances = load_tolerances(format_name, DTYPE_NAMES.get(dtype, "float32"))
    return tolerances.weight_rel, tolerances.weight_abs


def mismatches(live: torch.Tensor, want: torch.Tensor, rel: float, abs_: float) -> int:
    """Elements where |live - want_rounded| > abs + rel * |want_rounded|, want rounded once to the
    live dtype (the comparison rule of cases/tolerances.toml); NaN counts as a mismatch. Compared on
    the CPU, wherever the live weight is (a model on CUDA against the checkpoint's reading)."""
    rounded = want.detach().to(device="cpu").to(live.dtype).to(torch.float64)
    delta = (live.detach().to(device="cpu", dtype=torch.float64) - rounded).abs()
    return int((~(delta <= abs_ + rel * rounded.abs())).sum())


def live_weight(
    model_modules: Mapping[str, torch.nn.Module], checkpoint_module: str, key_mapping: Mapping[str, str] | None = None
) -> tuple[str, torch.nn.Module, torch.Tensor]:
    """(live module name, module, weight) for a checkpoint module, or SkipTensor with the reason:
    not found, no weight, an FP8 weight (a converted module that applies its scales itself),
    meta or offloaded, not 2-D."""
    name = live_module_name(checkpoint_module, model_modules, key_mapping)
    module = model_modules[name]
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise SkipTensor(f"module {type(module).__name__} has no weight tensor")
    problem = offload_problem(module, weight)
    if problem:
        raise SkipTensor(problem.replace("its dropped scale was NOT applied", "NOT repaired"))
    if weight.dtype in FP8_DTYPES or weight.dtype == torch.uint8:
        raise SkipTensor(
            f"live weight is {weight.dtype}: still quantized (not dequantized by the engine yet, or "
            "a converted module that applies its scales itself)"
        )
    if not weight.is_floating_point() or weight.dim() != 2:
        raise SkipTensor(f"live weight is {weight.dtype} with {weight.dim()} dimensions, not a dense 2-D weight")
    return name, module, weight


@torch.no_grad()
def write_rounded_once(weight: torch.Tensor, value: torch.Tensor) -> None:
    """weight <- value (float64) rounded once to the weight's dtype, in place (the Parameter object,
    and so any tie or optimizer reference to it, is kept)."""
    if tuple(weight.shape) != tuple(value.shape):
        raise SkipTensor(f"the checkpoint's weight is {list(value.shape)}, the live one {list(weight.shape)}")
    weight.data.copy_(value.to(device=weight.device, dtype=weight.dtype))


def decompression_pending(model: torch.nn.Module) -> bool:
    """compressed-tensors (also through transformers, run_compressed) decompresses on the model's
    first forward, from a pre-hook it keeps in `model.ct_decompress_hook` and removes once run."""
    handle = getattr(model, "ct_decompress_hook", None)
    hooks_dict = getattr(handle, "hooks_dict_ref", None)
    hooks = hooks_dict() if callable(hooks_dict) else None
    return handle is not None and hooks is not None and getattr(handle, "id", None) in hooks


DEFERRED = (
    "deferred: compressed-tensors decompresses this model at its first forward; the repair runs then, "
    "from a one-shot forward pre-hook right after the decompression, and this report fills in"
)


@dataclass
class DeferredRepair:
    """A repair that runs once, right after compressed-tensors' decompression, into `report`.
    `ran` says whether it has; `remove()` cancels it."""

    report: FixReport
    ran: bool = False
    handle: torch.utils.hooks.RemovableHandle | None = None

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def after_decompression(
    model: torch.nn.Module, report: FixReport, repair: Callable[[FixReport], None]
) -> DeferredRepair:
    """Run `repair(report)` now when the model holds its final weights. When compressed-tensors'
    decompression is still pending, run it from a one-shot forward pre-hook registered after
    compressed-tensors' own: pre-hooks run in registration order, so it sees the decompressed
    weights and repairs them before the first forward computes anything (`report` says so until then)."""
    deferred = DeferredRepair(report)
    if not decompression_pending(model):
        repair(report)
        deferred.ran = True
        return deferred
    report.warnings.append(DEFERRED)

    def repair_after_decompression(module, args):
        deferred.remove()
        report.warnings.remove(DEFERRED)
        repair(report)
        deferred.ran = True

    deferred.handle = model.register_forward_pre_hook(repair_after_decompression)
    return deferred


def install_deferred_repair(
    model: torch.nn.Module,
    checkpoint_dir: str | Path,
    name: str,
    formats: tuple[str, ...],
    repair_modules: Callable,
    key_mapping: Mapping[str, str] | None = None,
) -> DeferredRepair:
    """Open the checkpoint and run `repair_modules(model, source, report, key_mapping)` now when the
    model is decompressed, else right after compressed-tensors' decompression at the first forward."""
    report = FixReport(name)
    source = QuantizedCheckpoint.open(checkpoint_dir)
    if source.fmt.name not in formats:
        report.warnings.append(f"not a {' / '.join(formats)} checkpoint ({source.fmt.name}): nothing to repair")
        return DeferredRepair(report, ran=True)
    return after_decompression(model, report, lambda into: repair_modules(model, source, into, key_mapping))


def repair_misread(
    weight: torch.Tensor,
    correct: torch.Tensor,
    misread: torch.Tensor,
    format_name: str,
    correct_label: str,
    misread_label: str,
    misread_dtype: torch.dtype | None = None,
) -> int:
    """The rule the re-dequantizing fixes share: write `correct` (rounded once) into `weight` only when
    the weight differs from it and equals `misread`, the reading the bug produces (compared at the
    tolerance of `misread_dtype`, default the weight's); otherwise raise SkipTensor saying which.
    Returns how many elements were off."""
    rel, abs_ = weight_tolerance(weight.dtype, format_name)
    wrong_now = mismatches(weight, correct, rel, abs_)
    if not wrong_now:
        raise SkipTensor(f"already equals the {correct_label}")
    if misread_dtype is not None:
        rel, abs_ = weight_tolerance(misread_dtype, format_name)
    off_misread = mismatches(weight, misread, rel, abs_)
    if off_misread:
        raise SkipTensor(
            f"differs from the {correct_label} ({wrong_now} elements) and from the {misread_label} "
            f"({off_misread}): changed by something else; left as is"
        )
    write_rounded_once(weight, correct)
    return wrong_now
