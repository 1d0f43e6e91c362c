"""The harness detects each bug class: proven with deliberately buggy test doubles
(tests/doubles/buggy_engines.py), loaded by import path as a user's own loader would be."""

from __future__ import annotations

import pytest

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.differential.runner import EngineSession, evaluate
from harness.engines.process import Limits

pytest.importorskip("transformers")
DOUBLES = "tests.doubles.buggy_engines"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    engines = [
        "reference",
        f"{DOUBLES}:DroppedScaleEngine",
        f"{DOUBLES}:ClobberedBiasEngine",
        f"{DOUBLES}:SwappedGlobalScaleEngine",
        f"{DOUBLES}:RepackedAfterLoadingEngine",
        f"{DOUBLES}:RefusingEngine",
    ]
    session = EngineSession(engines, tmp_path_factory.mktemp("work"), Limits(timeout_s=300))
    yield session
    session.close()


def checkpoint(tmp_path, fmt, arch, **config):
    directory = tmp_path / f"{fmt}-{arch}"
    generate(Recipe(format=fmt, arch=arch, seed=3, config={"num_hidden_layers": 1, **config}), directory)
    return directory


def kinds(result, engine):
    return {f.kind for f in result.findings if f.engine == engine}


@pytest.mark.parametrize("fmt", ["fp8-block", "unquantized"])
def test_reference_engine_agrees_with_the_truth(session, tmp_path, fmt):
    result = evaluate(checkpoint(tmp_path, fmt, "qwen2"), session, engines=["reference"])
    assert result.outcomes["reference"].status == "loaded"
    assert result.findings == []


def test_weights_changed_after_loading_are_found_where_the_held_ones_are_right(session, tmp_path):
    """The effective-weight probe: the double's loader places every weight exactly (no weight
    finding), its forward applies halved k_proj weights; the basis inputs name k_proj alone, with
    every row and the ratio 0.5 (harness.differential.effective_weights)."""
    engine = f"{DOUBLES}:RepackedAfterLoadingEngine"
    result = evaluate(checkpoint(tmp_path, "ct-fp8-channel", "qwen2"), session, engines=["reference", engine])
    post = [f for f in result.findings if f.engine == engine and f.kind == "post-load"]
    assert len(post) == 1 and not kinds(result, engine) & {"weight-mismatch", "weight-nonfinite"}
    assert post[0].metrics["modules"] == ["model.layers.0.self_attn.k_proj"]
    assert post[0].metrics["worst"]["ratio"] == pytest.approx(0.5, rel=1e-2)
    rows = result.outcomes[engine].effective_weights
    assert rows == "7/8 Linear(s) apply the weights placed", rows


def test_dropped_scale_is_found(session, tmp_path):
    engine = f"{DOUBLES}:DroppedScaleEngine"
    result = evaluate(checkpoint(tmp_path, "fp8-block", "llama"), session, engines=["reference", engine])
    assert {"dropped-scale", "weight-mismatch"} <= kinds(result, engine)
    mismatch = [f for f in result.findings if f.engine == engine and f.kind == "weight-mismatch"]
    assert len(mismatch) == 1 and mismatch[0].module.endswith("weight")
    assert mismatch[0].metrics["bad_block_count"] >= 1
    assert kinds(result, "reference") == set()


@pytest.mark.parametrize("fmt", ["fp8-block", "unquantized"])  # seed 000: an unquantized checkpoint's biases
def test_clobbered_bias_is_found(session, tmp_path, fmt):
    engine = f"{DOUBLES}:ClobberedBiasEngine"
    result = evaluate(checkpoint(tmp_path, fmt, "qwen2"), session, engines=["reference", engine])
    nonfinite = [f for f in result.findings if f.engine == engine and f.kind == "weight-nonfinite"]
    assert {f.module.rsplit(".", 2)[-2] for f in nonfinite} == {"q_proj", "k_proj", "v_proj"}
    assert "nonfinite-logits" in kinds(result, engine)


@pytest.mark.parametrize("fmt, expectation", [("fp8-block", "exact"), ("ct-int4", "exact-or-refuse")])
def test_a_deliberate_refusal_of_a_valid_checkpoint_is_its_own_finding(session, tmp_path, fmt, expectation):
    """An engine that refuses on purpose (EngineRefuses): `refused-valid` where the checkpoint must
    load exactly; where the definition lets a loader refuse it, the refusal is no finding."""
    engine = f"{DOUBLES}:RefusingEngine"
    result = evaluate(checkpoint(tmp_path, fmt, "llama"), session, engines=["reference", engine])
    assert result.expectation == expectation
    outcome = result.outcomes[engine]
    assert outcome.status == "refused" and outcome.detail.startswith("double: every partition"), outcome.detail
    assert kinds(result, engine) == ({"refused-valid"} if expectation == "exact" else set())


def test_swapped_nvfp4_global_scale_is_found(session, tmp_path):
    engine = f"{DOUBLES}:SwappedGlobalScaleEngine"
    result = evaluate(checkpoint(tmp_path, "ct-nvfp4a16", "llama"), session, engines=["reference", engine])
    assert "weight-mismatch" in kinds(result, engine)
    assert kinds(result, engine) & {"logprobs", "topk", "perplexity", "nonfinite-logits"}


@pytest.mark.parametrize(
    "double, kind, limits",
    [
        ("CrashingEngine", "engine-crash", Limits(timeout_s=120)),
        ("HangingEngine", "engine-timeout", Limits(timeout_s=10)),  # the reference answers each request in ~1 s
        ("MemoryHogEngine", "engine-memory", Limits(timeout_s=120, memory_mb=2500)),
    ],
)
def test_worker_failures_are_findings_and_the_run_goes_on(tmp_path, double, kind, limits):
    engine = f"{DOUBLES}:{double}"
    session = EngineSession([engine, "reference"], tmp_path / "work", Limits(timeout_s=120))
    try:
        for name in session.engines:  # started under a start-up limit any machine meets; then `limits` apply
            session.process(name)
        session.limits.timeout_s, session.limits.memory_mb = limits.timeout_s, limits.memory_mb
        result = evaluate(checkpoint(tmp_path, "ct-fp8-channel", "llama"), session)
    finally:
        session.close()
    assert [f.kind for f in result.findings if f.engine == engine] == [kind]
    assert result.outcomes["reference"].status == "loaded"
