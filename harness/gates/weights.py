"""The gate's weight check: the weights an engine holds against the reference dequantization of
the same checkpoint, judged exactly as `compare` judges them (harness.differential.runner's weight
judge, cases/tolerances.toml for the checkpoint's format and dtype, canonical names).

A tiny model's perplexity can stay within its gate while a module's weights are wrong (one
module's FP8 scale grid read one block row off: 0.19 max relative weight error, perplexity
within 0.5%, the same greedy text); this check sees it and names the module. An engine that cannot give
its weights is reported as not checked, with the reason, never as a pass. An unquantized
checkpoint (a tiny model's bf16 original) is compared with its stored tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import CheckpointError, HarnessError, first_line

#: weight findings listed one per line before the verdict; the rest are counted
LISTED = 8


@dataclass
class WeightCheck:
    #: "ok", "fail" or "not checked"
    status: str
    lines: list[str]
    #: per failing tensor: name, max |error|, max relative error, differing scale blocks
    failures: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    @property
    def short(self) -> str:
        """One phrase for a summary line: `weights ok`, `weights FAIL (N tensors)`, `weights not checked (why)`."""
        if self.status == "fail":
            return (
                f"weights FAIL ({len(self.failures)} tensors)"
                if self.failures
                else "weights FAIL (the reference refuses the checkpoint)"
            )
        if self.status == "ok":
            return "weights ok"
        return "weights " + self.lines[0].removeprefix("weights: ")

    def verdict(self) -> str:
        """What the verdict line says about the weights, when they failed."""
        if self.failures:
            named = [
                f"{f['name']} max |err| {f['max_abs']:.3g}, max rel {f['max_rel']:.3g}"
                + (f", blocks {f['blocks'][:4]}" if f["blocks"] else "")
                for f in self.failures[:3]
            ]
            more = f"; {len(self.failures) - 3} more" if len(self.failures) > 3 else ""
            return f"weights ({'; '.join(named)}{more})"
        return "weights"


def not_checked(why: str) -> WeightCheck:
    return WeightCheck("not checked", [f"weights: not checked ({why})"])


def reference_weights(directory: str | Path):
    """(format, knobs, dtype, canonical name -> float64 tensor) a correct loader holds for
    `directory`: its reference dequantization, or, unquantized, its stored tensors."""
    import torch

    from harness.checkpoints.reader import Checkpoint
    from harness.core.naming import canonical_name
    from harness.formats.unquantized import FORMAT as UNQUANTIZED
    from harness.oracle.reference import dequantize_checkpoint, format_and_knobs

    checkpoint = Checkpoint(directory)
    config = checkpoint.config
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"  # as the runner reads it
    if "quantization_config" not in config:
        truth = {canonical_name(n): t.to(torch.float64) for n, t in checkpoint.tensors()}
        return UNQUANTIZED, {}, dtype, truth  # its stored tensors, the format that stores them as they are
    fmt, knobs = format_and_knobs(checkpoint)
    return fmt, knobs, dtype, {canonical_name(n): t for n, t in dequantize_checkpoint(directory)}


def check_weights(held: dict, directory: str | Path, engine: str, started: float | None = None) -> WeightCheck:
    """Judge `held` (what `engine` holds, float32 under HF names) against the reference weights of
    `directory`, with the runner's own weight judge and tolerances; `started`: when reading the
    engine's weights began (perf_counter), so the time reported is the whole check's."""
    from harness.core.findings import Finding
    from harness.core.naming import canonical_name
    from harness.core.tolerances import load_tolerances
    from harness.differential.runner import _judge_weights

    started = time.perf_counter() if started is None else started
    try:
        fmt, knobs, dtype, truth = reference_weights(directory)
    except CheckpointError as error:  # what the runner calls accepted-invalid: a correct loader refuses
        return WeightCheck(
            "fail",
            [f"weights: FAIL ({engine} loaded a checkpoint the reference dequantizer refuses: {first_line(error)})"],
            seconds=time.perf_counter() - started,
        )
    tolerance = load_tolerances(fmt.name, dtype)
    findings: list[Finding] = []

    def finding(engine, kind, message, **extra):
        item = Finding(
            engine=engine, engine_version="", kind=kind, format=fmt.name, message=message, dtype=dtype, **extra
        )
        findings.append(item)
        return item

    held = {canonical_name(name): tensor for name, tensor in held.items()}
    _judge_weights(engine, held, truth, dtype, tolerance, fmt, knobs, finding, {})
    seconds = time.perf_counter() - started
    reference = "the reference dequantization" if fmt.has_scales else "its stored tensors"
    how = f"({fmt.name}, {dtype}: rel {tolerance.weight_rel:g}, abs {tolerance.weight_abs:g}; {seconds:.2f} s)"
    if not findings:
        return WeightCheck("ok", [f"weights: {len(truth)} tensors match {reference} {how}: ok"], seconds=seconds)
    lines = [f"weights: {len(findings)} of {len(truth)} tensors differ from {reference} {how}: FAIL"]
    failures = []
    for item in findings:
        metrics = item.metrics
        blocks = [tuple(b) for b in metrics.get("bad_blocks", [])]
        failures.append(
            {
                "name": item.module or "?",
                "kind": item.kind,
                "max_abs": metrics.get("max_abs", float("nan")),
                "max_rel": metrics.get("max_rel", float("nan")),
                "blocks": blocks,
            }
        )
        if len(lines) <= LISTED:
            where = f"; scale blocks {blocks[:8]}" if blocks else ""
            lines.append(f"    {item.kind}: {item.message}{where}")
    if len(findings) > LISTED:
        lines.append(f"    ... and {len(findings) - LISTED} more")
    return WeightCheck("fail", lines, failures, seconds)


def scorer_weights(scorer, directory: str | Path | None, engine: str) -> WeightCheck:
    """The weight check of a scorer that loaded `directory`; not checked, saying why, where the
    scorer exposes no weights, the engine says it cannot give them, or no checkpoint is known."""
    if directory is None:
        return not_checked("the gate was given no checkpoint to dequantize")
    read = getattr(scorer, "weights", None)
    if read is None:
        return not_checked(f"{type(scorer).__name__} exposes no weights")
    from harness.engines.process import EngineError, EngineFailure

    started = time.perf_counter()
    try:
        held = read()
    except NotImplementedError:
        return not_checked(f"{engine} does not implement weights()")
    except EngineError as error:
        if error.unsupported:
            return not_checked(f"{engine} says unsupported: {first_line(error)}")
        if first_line(error).startswith("NotImplementedError"):
            return not_checked(f"{engine} does not implement weights()")
        return not_checked(f"{engine} could not give its weights: {first_line(error)}")
    except EngineFailure as failure:
        raise HarnessError(f"{engine}'s worker failed while giving its weights: {failure}") from None
    return check_weights(held, directory, engine, started)
