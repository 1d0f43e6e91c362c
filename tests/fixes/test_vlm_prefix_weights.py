"""The vlm-prefix-weights fix: a text checkpoint stored under `model.language_model.` loads into
transformers with random weights; the fix loads them. Judged by the golden gate on tiny-qwen2
(fp8-block, the format where transformers builds a model at all) and by the reference on the
known issue's reproducer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.findings import Finding
from harness.core.naming import canonical_name
from harness.differential.known_issues import KnownIssues
from harness.fixes import fix_for_finding, get_fix
from harness.fixes import vlm_prefix_weights as fix
from harness.oracle.reference import dequantize_checkpoint

pytest.importorskip("transformers")


def load(directory):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, output_loading_info=True)
    return model.eval(), info


def add_vlm_prefix(directory) -> None:
    """Rewrite a single-file checkpoint's text-model keys as a VLM pipeline stores them."""
    path = directory / "model.safetensors"
    tensors = {
        ("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
        for k, v in load_file(str(path)).items()
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reproducer(tmp_path_factory):
    issue = next(i for i in KnownIssues.load().issues if i.id == fix.KNOWN_ISSUE)
    directory = tmp_path_factory.mktemp("vlm") / "ckpt"
    generate(Recipe.from_json({"seed": 0, **issue.reproducer}), directory)
    return directory


def test_weight_level_every_tensor_loaded(reproducer):
    model, info = load(reproducer)
    assert any(k.startswith("model.language_model.") for k in info["unexpected_keys"])
    truth = {canonical_name(n): t for n, t in dequantize_checkpoint(reproducer)}
    params = dict(model.named_parameters())
    wrong = [n for n in truth if n in params and not torch.equal(params[n], truth[n].to(params[n].dtype))]
    assert len(wrong) > 7, wrong  # every decoder tensor random

    report = fix.load_prefixed_weights(model, reproducer)

    assert sorted(report.repaired) == sorted(wrong)
    for name, tensor in truth.items():
        if name in params:
            assert torch.equal(params[name], tensor.to(params[name].dtype)), name
    again = fix.load_prefixed_weights(model, reproducer)
    assert again.repaired == [] and all("already holds" in r for r in again.skipped.values()), again.skipped


def test_an_unprefixed_checkpoint_is_left_alone(tmp_path):
    generate(Recipe(format="fp8-block", arch="llama", config={"num_hidden_layers": 1}), tmp_path / "plain")
    model, _ = load(tmp_path / "plain")
    report = fix.load_prefixed_weights(model, tmp_path / "plain")
    assert not report.changed and "nothing to load" in report.warnings[0]


def test_registered_for_the_known_issue():
    assert get_fix("vlm-prefix-weights") is fix.FIX
    finding = Finding(
        engine="transformers",
        engine_version="5.23.0",
        kind="load-report",
        format="fp8-block",
        message="unexpected model.language_model.layers.0",
        known_issue=fix.KNOWN_ISSUE,
    )
    assert fix_for_finding(finding) is fix.FIX


@pytest.mark.slow
def test_golden_gate_fails_before_and_passes_after(tmp_path):
    from harness.core.errors import HarnessError
    from harness.gates.gate import gate_model
    from harness.lm import model_dir, quantize_model

    try:
        model_dir("tiny-qwen2")
    except HarnessError as error:
        pytest.skip(str(error))
    directory = quantize_model("tiny-qwen2", "fp8-block", tmp_path / "prefixed")
    add_vlm_prefix(directory)
    model, _ = load(directory)
    before = gate_model(model, "tiny-qwen2", "fp8-block", "transformers")
    assert not before.ok, "\n".join(before.lines)
    report = fix.load_prefixed_weights(model, directory)
    assert len([k for k in report.repaired if k.endswith("_proj.weight")]) == 14, report.skipped
    after = gate_model(model, "tiny-qwen2", "fp8-block", "transformers")
    assert after.ok, "\n".join(after.lines)
