"""Logits beyond tolerance are left unjudged only where the model, not the engine, explains them:
x1000 weights (`extreme_amax=huge`), every weight held and applied as placed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.core.findings import Finding
from harness.core.tolerances import load_tolerances
from harness.differential.compare import LogprobDiff
from harness.differential.runner import ill_conditioned

TOL = load_tolerances("gptq", "bfloat16")
BEYOND = LogprobDiff(
    max_abs_delta=4.1, topk_misses=1, positions=69, nonfinite=0, perplexity=424.6, reference_perplexity=411.9
)
WITHIN = LogprobDiff(
    max_abs_delta=0.01, topk_misses=0, positions=69, nonfinite=0, perplexity=412.0, reference_perplexity=411.9
)


def judgement(extreme: str, findings=()):
    recipe = {"perturb": {"extreme_amax": extreme}}
    return SimpleNamespace(manifest={"recipe": recipe}, result=SimpleNamespace(findings=list(findings)))


def post_load(engine: str) -> Finding:
    return Finding(engine=engine, engine_version="1", kind="post-load", format="gptq", message="applies other weights")


@pytest.mark.parametrize(
    "extreme, findings, weights_exact, diff, expected",
    [
        ("huge", (), True, BEYOND, True),
        ("none", (), True, BEYOND, False),  # an ordinary model: the logits are the engine's
        ("huge", (post_load("transformers"),), True, BEYOND, False),  # a Linear applies other weights
        ("huge", (post_load("vllm"),), True, BEYOND, True),  # another engine's finding does not count
        ("huge", (), False, BEYOND, False),  # wrong weights: the logits are their consequence
        ("huge", (), True, WITHIN, False),  # nothing to leave unjudged
    ],
)
def test_only_a_huge_model_with_every_weight_right_goes_unjudged(extreme, findings, weights_exact, diff, expected):
    assert ill_conditioned(judgement(extreme, findings), "transformers", weights_exact, diff, TOL) is expected
