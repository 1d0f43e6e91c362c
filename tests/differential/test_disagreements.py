"""Config/tensor disagreements (harness.checkpoints.disagreements): for each, a correct loader
(the reference engine) passes and a loader that trusts the config over the tensors (a labelled
test double) is caught."""

from __future__ import annotations

import pytest

from harness.checkpoints.disagreements import DISAGREEMENTS
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.differential.runner import EngineSession, evaluate

pytest.importorskip("transformers")
DOUBLE = "tests.doubles.buggy_engines:ConfigTrustingEngine"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    session = EngineSession(["reference", DOUBLE], tmp_path_factory.mktemp("engines"))
    yield session
    session.close()


@pytest.mark.parametrize("kind", sorted(DISAGREEMENTS))
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_correct_loader_passes_and_a_config_trusting_one_is_caught(kind, arch, session, tmp_path):
    config = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96}
    if arch == "qwen3_moe":
        config["moe_intermediate_size"] = 48
    knobs = {"input_scale": True} if DISAGREEMENTS[kind].needs_static_inputs else {}
    recipe = Recipe(format="ct-fp8-tensor", arch=arch, config=config, knobs=knobs, perturb={"disagreement": kind})
    manifest = generate(recipe, tmp_path / "checkpoint")
    target = next(m for m, info in manifest["modules"].items() if DISAGREEMENTS[kind].note in info["notes"])
    assert (".experts.1." in target) == (arch == "qwen3_moe")  # per expert where there are experts
    result = evaluate(tmp_path / "checkpoint", session)
    by_engine = {e: [f for f in result.findings if f.engine == e] for e in ("reference", DOUBLE)}
    assert by_engine["reference"] == [], [f.message for f in by_engine["reference"]]
    assert by_engine[DOUBLE], f"{kind}: the config-trusting double was not caught"
    assert result.outcomes["reference"].status in ("loaded", "refused")
    if DISAGREEMENTS[kind].expectation == "refuse":
        assert result.outcomes["reference"].status == "refused"
