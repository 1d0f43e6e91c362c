"""The gate's weight check on synthetic checkpoints and stand-in scorers (no engine worker): what an
engine holds against the reference dequantization, judged as `compare` judges it; an engine that
cannot give its weights is 'not checked', never a silent pass; the verdict names the failed check."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoints.recipe import Recipe, apply_settings
from harness.checkpoints.writer import generate
from harness.engines.process import EngineError
from harness.gates.gate import gate
from harness.gates.weights import check_weights, scorer_weights
from harness.oracle.reference import dequantize_checkpoint

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """fp8-block, 64 x 64 blocks: q_proj is 128 x 128, a 2 x 2 grid."""
    directory = tmp_path_factory.mktemp("weights") / "ckpt"
    generate(apply_settings(Recipe(format="fp8-block", arch="qwen2", seed=1), ["block_size=64"]), directory)
    return directory


def reference_held(directory):
    """What a correct loader holds: the reference dequantization, float32 as workers send it."""
    return {name: tensor.float() for name, tensor in dequantize_checkpoint(directory)}


def test_a_correct_load_passes(checkpoint):
    check = check_weights(reference_held(checkpoint), checkpoint, "e")
    assert check.status == "ok" and check.ok and not check.failures
    assert check.lines[0].startswith("weights: 27 tensors match the reference dequantization") and check.lines[
        0
    ].endswith(": ok")


def test_one_scale_block_off_fails_naming_the_module_and_the_block(checkpoint):
    held = reference_held(checkpoint)
    held[Q_PROJ][64:, :64] *= 1.19  # one block of the grid scaled by a neighbour's scale
    check = check_weights(held, checkpoint, "e")
    assert check.status == "fail" and not check.ok
    assert [(f["name"], f["blocks"]) for f in check.failures] == [(Q_PROJ, [(1, 0)])]
    assert check.failures[0]["max_rel"] == pytest.approx(0.19, abs=0.01)
    assert Q_PROJ in check.lines[1] and "scale blocks [(1, 0)]" in check.lines[1]
    assert check.verdict().startswith(f"weights ({Q_PROJ} max |err| ") and "blocks [(1, 0)]" in check.verdict()


def test_a_missing_or_nonfinite_tensor_fails(checkpoint):
    held = reference_held(checkpoint)
    del held["model.layers.1.mlp.down_proj.weight"]
    held["model.layers.0.self_attn.k_proj.bias"][0] = torch.nan
    check = check_weights(held, checkpoint, "e")
    kinds = {f["name"]: f["kind"] for f in check.failures}
    assert kinds == {
        "model.layers.1.mlp.down_proj.weight": "weight-missing",
        "model.layers.0.self_attn.k_proj.bias": "weight-nonfinite",
    }


def test_vlm_prefixed_names_are_canonical(checkpoint):
    held = {name.replace("model.", "model.language_model.", 1): t for name, t in reference_held(checkpoint).items()}
    assert check_weights(held, checkpoint, "e").status == "ok"


def test_a_checkpoint_the_reference_refuses_fails_when_loaded(tmp_path):
    """A correct loader refuses it (a ModelOpt multiplier in compressed-tensors' divisor slot); an
    engine that loaded it fails on weights, as `compare` calls it accepted-invalid."""
    directory = tmp_path / "swapped"
    generate(
        apply_settings(Recipe(format="ct-nvfp4", arch="qwen2", seed=1), ["global_scale_convention=swapped"]), directory
    )
    check = check_weights({}, directory, "e")
    assert check.status == "fail" and "the reference dequantizer refuses" in check.lines[0]
    assert "ModelOpt multiplier" in check.lines[0]


def test_an_unquantized_checkpoint_is_judged_against_its_stored_tensors():
    from safetensors.torch import load_file

    from harness.lm import model_dir

    directory = model_dir("tiny-qwen2")
    held = {name: tensor.float() for name, tensor in load_file(str(directory / "model.safetensors")).items()}
    check = check_weights(held, directory, "e")
    assert check.status == "ok" and "match its stored tensors (unquantized, bfloat16" in check.lines[0]
    held["model.layers.1.self_attn.v_proj.bias"].zero_()  # a stale bias
    assert [f["name"] for f in check_weights(held, directory, "e").failures] == ["model.layers.1.self_attn.v_proj.bias"]


class Scorer:
    """Predicts one token, 5 nat above the rest (a golden written from it passes); its weights are
    `held`, or reading them raises `error`; no `weights` at all with held=None, error=None."""

    def __init__(self, held=None, error=None, checkpoint=None):
        self.held, self.error, self.checkpoint = held, error, checkpoint
        if held is None and error is None:
            self.weights = None

    def logprobs(self, sequences):
        rows = []
        for s in sequences:
            row = torch.zeros(len(s) - 1, 260)
            row[:, 123] = 5.0
            rows.append(torch.log_softmax(row, 1))
        return rows

    def generate(self, prompt, max_new_tokens):
        return [123] * max_new_tokens

    def weights(self):
        if self.error is not None:
            raise self.error
        return self.held


@pytest.mark.parametrize(
    "scorer, why",
    [
        (Scorer(), "Scorer exposes no weights"),
        (Scorer(error=EngineError("EngineUnsupported: no dequantizer", "", unsupported=True)), "e says unsupported"),
        (Scorer(error=EngineError("NotImplementedError: ", "")), "e does not implement weights()"),
        (Scorer(error=NotImplementedError()), "e does not implement weights()"),
        (Scorer(error=EngineError("RuntimeError: no captured weights", "")), "e could not give its weights"),
    ],
)
def test_weights_that_cannot_be_read_are_not_checked_with_the_reason(scorer, why, checkpoint):
    check = scorer_weights(scorer, checkpoint, "e")
    assert check.status == "not checked" and check.ok and why in check.lines[0]
    assert check.lines[0].startswith("weights: not checked (")


def test_no_checkpoint_is_not_checked():
    assert "given no checkpoint" in scorer_weights(Scorer(held={}), None, "e").lines[0]


def test_the_gate_checks_weights_first_and_its_verdict_names_each_failed_check(checkpoint, tmp_path):
    held = reference_held(checkpoint)
    assert not gate(Scorer(held), "m", "fp8-block", "e", update=True, root=tmp_path).ok  # writes the golden

    passed = gate(Scorer(held, checkpoint=checkpoint), "m", "fp8-block", "e", root=tmp_path)
    assert passed.ok and passed.lines[0].startswith("weights: 27 tensors") and passed.lines[-1] == "gate: PASS"

    unread = gate(Scorer(), "m", "fp8-block", "e", root=tmp_path)
    assert unread.ok and unread.lines[0].startswith("weights: not checked (")
    assert unread.lines[-1] == "gate: PASS (weights not checked)"

    held[Q_PROJ][:64, 64:] *= 0.8
    failed = gate(Scorer(held), "m", "fp8-block", "e", root=tmp_path, checkpoint=checkpoint)
    assert not failed.ok and failed.failed == ["weights"]
    assert failed.lines[0].startswith("weights: 1 of 27 tensors differ from the reference") and failed.lines[
        0
    ].endswith("FAIL")
    assert [line.split()[0] for line in failed.lines[2:]] == ["perplexity", *["text"] * 5, "gate:"]
    assert failed.lines[-1].startswith(f"gate: FAIL: weights ({Q_PROJ} max |err| ") and "(0, 1)" in failed.lines[-1]
