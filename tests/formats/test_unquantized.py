"""The `unquantized` format: a checkpoint without quantization_config, read as its stored tensors;
the layouts and perturbations of scales refused for it; a weight stored quantized without a
config refused, never read by value."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoints.reader import Checkpoint, declared_format
from harness.checkpoints.recipe import LAYOUT_CHOICES, LAYOUT_DEFAULTS, SCALE_LAYOUT, SCALE_PERTURBATIONS, Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import CheckpointError, HarnessError
from harness.core.tolerances import load_tolerances
from harness.differential.runner import within_rounding
from harness.oracle.reference import dequantize_checkpoint

TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("unquantized") / "ckpt"
    generate(Recipe("unquantized", "qwen2", seed=2, config=TINY, layout={"shards": 2}), directory)
    return directory


def test_it_is_written_without_a_quantization_config_and_read_as_stored(written):
    config = json.loads((written / "config.json").read_text())
    assert "quantization_config" not in config
    assert declared_format(written)[0].name == "unquantized"
    checkpoint = Checkpoint(written)
    truth = dict(dequantize_checkpoint(written))
    assert sorted(truth) == checkpoint.names()
    for name, value in truth.items():
        stored = checkpoint.tensor(name)
        assert stored.dtype == torch.bfloat16 and torch.equal(value, stored.to(torch.float64)), name
    assert any(name.endswith("q_proj.bias") for name in truth)  # qwen2's biases: what online FP8 once clobbered


@pytest.mark.parametrize("key", SCALE_LAYOUT)
def test_layouts_of_scales_are_refused_in_one_line(key, tmp_path):
    other = next(v for v in LAYOUT_CHOICES.get(key, (True,)) if v != LAYOUT_DEFAULTS[key])
    layout = {"shards": 2, key: other}
    with pytest.raises(HarnessError, match="unquantized stores no scales and no quantization config"):
        generate(Recipe("unquantized", "llama", config=TINY, layout=layout), tmp_path / "c")


@pytest.mark.parametrize(
    "key, value",
    [
        (k, v)
        for k, v in [
            ("zero_block", True),
            ("subnormal_block", True),
            ("nonfinite_scale", "nan"),
            ("disagreement", "missing-scale"),
        ]
    ],
)
def test_perturbations_of_scales_are_refused_and_extreme_weights_are_not(key, value, tmp_path):
    assert key in SCALE_PERTURBATIONS
    with pytest.raises(HarnessError, match="unquantized stores no scales"):
        generate(Recipe("unquantized", "llama", config=TINY, perturb={key: value}), tmp_path / "c")
    generate(Recipe("unquantized", "llama", config=TINY, perturb={"extreme_amax": "huge"}), tmp_path / "huge")


def test_a_weight_stored_quantized_without_a_config_is_refused(written, tmp_path):
    """FP8 codes in a checkpoint that declares no quantization: read by value they would be wrong
    weights; the oracle refuses the checkpoint (so every engine that loads it is `accepted-invalid`)."""
    import shutil

    copy = shutil.copytree(written, tmp_path / "fp8-inside")
    shard = next(copy.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n in tensors if n.endswith("proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="stored as float8_e4m3fn, but config.json has no quantization_config"):
        dict(dequantize_checkpoint(copy))


def test_two_faithful_roundings_are_told_from_a_wrong_forward():
    """An engine beyond the fixed tolerance is within rounding where it lies no further from the
    float32 forward than twice the reference's own bfloat16 rounding does (runner._within_rounding)."""
    tol = load_tolerances("unquantized", "bfloat16")
    assert within_rounding(0.19, 0.15, tol)  # vLLM on the trained tiny-llama (docs/engines.md)
    assert within_rounding(tol.logprob_max_abs_delta, 0.0, tol)
    assert not within_rounding(0.31, 0.15, tol)
    assert not within_rounding(tol.logprob_max_abs_delta * 1.01, 0.04, tol)  # a random model: the fixed bound
