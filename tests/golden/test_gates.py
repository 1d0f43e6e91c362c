"""Clean quantized variants of the tiny models pass their golden gates on every engine that
supports their format, their weights checked against the reference dequantization (every engine
here gives its weights: none passes with "weights: not checked"); every golden on disk is read by
a gate here (no orphans)."""

from __future__ import annotations

import pytest

from harness.core.errors import HarnessError
from harness.differential.known_issues import KnownIssues
from harness.differential.preconditions import checkpoint_context
from harness.engines import ENGINE_NAMES
from harness.gates.golden import GOLDEN_FORMATS, OTHER_READERS, existing_goldens
from harness.lm import MODEL_NAMES

ENGINES = ENGINE_NAMES
CT_PRODUCED = ("ct-fp8-tensor", "ct-fp8-channel", "ct-fp8-block", "ct-nvfp4", "ct-nvfp4a16")


def gate_matrix():
    """Every (model, format, engine). CI gates each format on one model, alternating along the list so
    both models and every format meet every engine; the other model's half runs in the nightly lane
    (--run-nightly), as `--update-golden` does (docs/ci.md)."""
    for index, fmt in enumerate(GOLDEN_FORMATS):
        for model in MODEL_NAMES:
            ci = model == MODEL_NAMES[index % len(MODEL_NAMES)]
            for engine in ENGINES:
                yield pytest.param(model, fmt, engine, marks=() if ci else pytest.mark.nightly)


@pytest.mark.parametrize(("model", "fmt", "engine"), list(gate_matrix()))
def test_clean_variant_passes_its_gate(model, fmt, engine, engine_session, variant, run_gate, update_golden):
    directory = variant(model, fmt)
    failure = known_issue(engine, fmt, directory, "load-error")
    if failure is not None:
        # no golden can be recorded from a load a known bug breaks: it must still fail, as recorded
        with pytest.raises(HarnessError, match=failure.message):
            run_gate(engine_session, engine, directory, model, fmt, False, golden_engine="reference")
        return
    bug = known_corruption(engine, fmt, directory)
    if bug is not None:
        # no golden is recorded from a load a known bug corrupts: the variant must fail the
        # reference's golden, weights first, for as long as the bug is there
        verdict = run_gate(engine_session, engine, directory, model, fmt, False, golden_engine="reference")
        assert not verdict.ok and verdict.weights.status != "ok", f"{bug} no longer fails the gate: \n{verdict}"
        return
    verdict = run_gate(engine_session, engine, directory, model, fmt, update_golden)
    assert verdict.ok, f"\n{verdict}"
    assert verdict.weights.status == "ok", f"\n{verdict}"


def known_corruption(engine: str, fmt: str, directory) -> str | None:
    """A known issue of `engine` that corrupts the weights of this clean variant."""
    issue = known_issue(engine, fmt, directory, "weight-mismatch")
    return None if issue is None else issue.id


def known_issue(engine: str, fmt: str, directory, kind: str):
    """A known issue of `engine` of this kind on this clean variant: in scope for its format and
    architecture, every precondition holding on the checkpoint."""
    context = checkpoint_context(directory)
    for issue in KnownIssues.load().issues:
        in_scope = issue.engine == engine and fmt in issue.formats and kind in issue.kinds
        if in_scope and (not issue.archs or context.get("model_type") in issue.archs):
            if all(predicate.holds(context) for predicate in issue.when):
                return issue
    return None


@pytest.mark.parametrize("engine", ("transformers", "compressed-tensors"))
@pytest.mark.parametrize("fmt", CT_PRODUCED)
def test_compressed_tensors_produced_variant_passes_the_same_gate(fmt, engine, engine_session, variant, run_gate):
    """compressed-tensors' own API and the harness's quantizers make variants that pass the same golden."""
    verdict = run_gate(
        engine_session,
        engine,
        variant("tiny-qwen2", fmt, "compressed-tensors"),
        "tiny-qwen2",
        fmt,
        update=False,
        producer="compressed-tensors",
    )
    assert verdict.ok and verdict.weights.status == "ok", f"\n{verdict}"


def test_no_orphaned_goldens():
    gated = {(m, f, e) for m in MODEL_NAMES for f in GOLDEN_FORMATS for e in ENGINES} | set(OTHER_READERS)
    orphans = [str(path) for model, fmt, engine, path in existing_goldens() if (model, fmt, engine) not in gated]
    assert not orphans, f"goldens no gate reads: {orphans}"
