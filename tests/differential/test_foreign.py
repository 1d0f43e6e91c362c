"""Checkpoints the harness did not write are judged like generated ones: the inferred expectation
says why, and known issues match them by the facts read from the checkpoint itself."""

from __future__ import annotations

import json

import pytest

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import MANIFEST_FILE, generate
from harness.differential.preconditions import checkpoint_context
from tests.cli import run_cli as cli

pytest.importorskip("transformers")


def foreign(tmp_path, **recipe) -> str:
    """A generated checkpoint with its manifest (recipe, truth index) removed: nothing but what a
    producer would ship."""
    directory = tmp_path / "ckpt"
    generate(Recipe(arch="llama", config={"num_hidden_layers": 1}, **recipe), directory)
    (directory / MANIFEST_FILE).unlink()
    return str(directory)


def test_a_foreign_nan_scale_is_refused_with_its_reason_and_matched_to_the_known_issue(tmp_path):
    directory = foreign(tmp_path, format="fp8-block", perturb={"nonfinite_scale": "nan"})
    assert checkpoint_context(directory)["nonfinite_scale"] == "nan"
    result = cli("compare", directory, "--engines", "reference,transformers", "--report", tmp_path / "r")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "expectation refuse: the reference refuses it" in result.stdout
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    (finding,) = report["findings"]
    assert finding["known_issue"] == "transformers-nonfinite-scale-accepted"
    assert "non-finite" in finding["message"]


@pytest.mark.parametrize(
    "recipe, facts",
    [
        (
            {"format": "ct-nvfp4a16", "knobs": {"global_scale_convention": "swapped"}},
            {"global_scale_convention": "swapped"},
        ),
        (
            {"format": "ct-fp8-channel", "layout": {"key_prefix": "model.language_model."}},
            {"key_prefix": "model.language_model."},
        ),
        ({"format": "ct-fp8-channel", "perturb": {"nonfinite_scale": "inf"}}, {"nonfinite_scale": "inf"}),
        ({"format": "ct-fp8-channel"}, {}),
    ],
)
def test_facts_read_from_a_foreign_checkpoint(tmp_path, recipe, facts):
    context = checkpoint_context(foreign(tmp_path, **recipe))
    for key in ("global_scale_convention", "key_prefix", "nonfinite_scale"):
        assert context.get(key) == facts.get(key), key
