"""transformers on GPTQ and AWQ (through optimum and GPTQModel, whose CPU kernels repack at the
first forward): the tensors its loader placed are read before that forward and judged against the
reference, and what the kernels then apply is judged by the basis probe. A deliberately buggy
double (tests/doubles/buggy_engines.py) that loses the v1 zero-point offset is caught; the real
engine is clean on asymmetric and act-order checkpoints."""

from __future__ import annotations

import importlib.util

import pytest

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.differential.runner import EngineSession, evaluate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gptqmodel") is None or importlib.util.find_spec("optimum") is None,
    reason="transformers loads GPTQ/AWQ through optimum and GPTQModel (the `gptq` extra), not installed here",
)
DOUBLE = "tests.doubles.buggy_engines:GptqV1ZerosNotConvertedEngine"
CASES = {
    "gptq-asym-v1": ("gptq", {"sym": False, "group_size": 32}),
    "gptq-act-order": ("gptq", {"desc_act": True, "group_size": 32}),
    "awq": ("awq", {"group_size": 32}),
}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    session = EngineSession(["reference", "transformers", DOUBLE], tmp_path_factory.mktemp("engines"))
    yield session
    session.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    made = {}
    for name, (fmt, knobs) in CASES.items():
        recipe = Recipe(format=fmt, arch="llama", config={"num_hidden_layers": 1}, knobs=knobs)
        generate(recipe, root / name)
        made[name] = root / name
    return made


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_places_and_applies_what_the_checkpoint_defines(case, checkpoints, session, known_issues):
    result = evaluate(checkpoints[case], session, known_issues, ["reference", "transformers"])
    outcome = result.outcomes["transformers"]
    assert outcome.status == "loaded", outcome.error
    assert not result.findings, [f.message for f in result.findings]
    probed = outcome.effective_weights.split(" ")[0].split("/")
    assert probed[0] == probed[1] and int(probed[1]) >= 7, outcome.effective_weights  # every Linear


def test_a_loader_that_loses_the_v1_zero_offset_is_caught(checkpoints, session, known_issues):
    result = evaluate(checkpoints["gptq-asym-v1"], session, known_issues, ["reference", DOUBLE])
    mismatched = {f.module for f in result.findings if f.kind == "weight-mismatch" and not f.known_issue}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= mismatched, [
        f.message for f in result.findings
    ]
