"""Fixtures of the golden-gate tests: quantized variants made once per session, and a gate runner."""

from __future__ import annotations

import pytest

from harness.gates.gate import gate
from harness.gates.scoring import loaded_scorer, provenance
from harness.pytest_plugin import require_engine


@pytest.fixture(scope="session")
def variant(tmp_path_factory):
    """A quantized variant per (model, format, producer), made once per test session."""
    from harness.lm import quantize_model

    made = {}

    def get(model, fmt, producer="harness"):
        key = (model, fmt, producer)
        if key not in made:
            made[key] = quantize_model(
                model, fmt, tmp_path_factory.mktemp(f"{model}-{fmt}-{producer}"), producer=producer
            )
        return made[key]

    return get


def _run_gate(
    engine_session, engine, directory, model, fmt, update, producer="harness", checkpoint=None, golden_engine=None
):
    """`checkpoint`: the one whose reference dequantization the engine's weights are judged against
    (default: `directory`, the one it loaded); `golden_engine`: whose golden it is gated against
    (default: its own)."""
    require_engine(engine_session, engine)
    scorer, why = loaded_scorer(engine_session, engine, directory, fmt)
    if scorer is None:
        pytest.skip(f"{engine}: {why}")
    verdict = gate(
        scorer,
        model,
        fmt,
        golden_engine or engine,
        update=update,
        provenance=provenance(
            engine_session, engine, producer, f"pytest tests/golden --update-golden -k '{model} and {fmt} and {engine}'"
        ),
        checkpoint=checkpoint,
    )
    if verdict.skipped:
        pytest.skip(verdict.skipped)
    return verdict


@pytest.fixture(scope="session")
def run_gate():
    """Load a checkpoint in an engine (skip with the reason when it cannot) and gate it."""
    return _run_gate
