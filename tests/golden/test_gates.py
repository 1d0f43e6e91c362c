"""Clean quantized variants of the tiny models pass their golden gates on every engine that
supports their format; every golden on disk is read by a gate here (no orphans)."""

from __future__ import annotations

import pytest

from harness.gate_commands import GOLDEN_FORMATS, loaded_scorer, provenance
from harness.gates import gate
from harness.golden import existing_goldens
from harness.lm import MODEL_NAMES
from harness.pytest_plugin import require_engine

ENGINES = ("reference", "transformers", "compressed-tensors", "vllm")
CT_PRODUCED = ("ct-fp8-tensor", "ct-fp8-channel", "ct-fp8-block", "ct-nvfp4", "ct-nvfp4a16")


@pytest.fixture(scope="session")
def variant(tmp_path_factory):
    """A quantized variant per (model, format, producer), made once per test session."""
    from harness.lm import quantize_model

    made = {}

    def get(model, fmt, producer="harness"):
        key = (model, fmt, producer)
        if key not in made:
            made[key] = quantize_model(model, fmt, tmp_path_factory.mktemp(f"{model}-{fmt}-{producer}"),
                                       producer=producer)
        return made[key]

    return get


def run_gate(engine_session, engine, directory, model, fmt, update, producer="harness"):
    require_engine(engine_session, engine)
    scorer, why = loaded_scorer(engine_session, engine, directory, fmt)
    if scorer is None:
        pytest.skip(f"{engine}: {why}")
    return gate(scorer, model, fmt, engine, update=update,
                provenance=provenance(engine_session, engine, fmt, producer,
                                      f"pytest tests/golden --update-golden -k '{model} and {fmt} and {engine}'"))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", GOLDEN_FORMATS)
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_clean_variant_passes_its_gate(model, fmt, engine, engine_session, variant, update_golden):
    verdict = run_gate(engine_session, engine, variant(model, fmt), model, fmt, update_golden)
    assert verdict.ok, f"\n{verdict}"


@pytest.mark.parametrize("engine", ("transformers", "compressed-tensors"))
@pytest.mark.parametrize("fmt", CT_PRODUCED)
def test_compressed_tensors_produced_variant_passes_the_same_gate(fmt, engine, engine_session, variant):
    """compressed-tensors' own API and the harness's quantizers make variants that pass the same golden."""
    verdict = run_gate(engine_session, engine, variant("tiny-qwen2", fmt, "compressed-tensors"), "tiny-qwen2", fmt,
                       update=False, producer="compressed-tensors")
    assert verdict.ok, f"\n{verdict}"


def test_no_orphaned_goldens():
    gated = {(m, f, e) for m in MODEL_NAMES for f in GOLDEN_FORMATS for e in ENGINES}
    orphans = [str(path) for model, fmt, engine, path in existing_goldens() if (model, fmt, engine) not in gated]
    assert not orphans, f"goldens no gate reads: {orphans}"
