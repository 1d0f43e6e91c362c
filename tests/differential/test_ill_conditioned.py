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


#: a bfloat16 two-layer DeepSeek-V3 (MLA, routed experts) whose reference lies about 1 nat from its own
#: float32 forward: transformers holds every weight exactly, its logits are two roundings apart, and
#: one of 69 top-1s (a near-tie) falls outside the reference's top 3 (session 39, on the AMD EPYC
#: AVX-512 kind; where the kernels round alike nothing flips and the test holds as well)
ROUNDING_SENSITIVE = {
    "format": "ct-mxfp4",
    "arch": "deepseek_v3",
    "seed": 952,
    "config": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "tie_word_embeddings": True,
        "moe_intermediate_size": 64,
        "q_lora_rank": 64,
    },
    "knobs": {"scale_storage": "uint8"},
}


def test_top1_is_not_judged_where_the_logits_are_two_roundings_apart(tmp_path, engine_session, known_issues):
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate
    from harness.differential.runner import evaluate
    from harness.pytest_plugin import require_engine

    require_engine(engine_session, "transformers")
    generate(Recipe.from_json(ROUNDING_SENSITIVE), tmp_path / "checkpoint")
    result = evaluate(tmp_path / "checkpoint", engine_session, known_issues, ["reference", "transformers"])
    assert result.outcomes["transformers"].status == "loaded"
    assert [f"{f.kind}: {f.message}" for f in result.findings] == []
