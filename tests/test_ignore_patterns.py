"""The ignore list spelled as llm-compressor recipes spell it (`layout.ignore_style=patterns`)
ignores exactly the modules the full names do, as the engines match entries."""

from __future__ import annotations

import json

import pytest

from harness.checkpoints.ignore_patterns import spell
from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.oracle.audit import audit_checkpoint, matches


def test_a_module_of_every_layer_is_one_pattern_and_any_other_is_anchored():
    ignored = ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.1.mlp.down_proj"]
    assert spell(ignored, "names", 2) == ignored
    entries = spell(ignored, "patterns", 2, "model.language_model.")
    assert entries == ["lm_head", r"re:.*\.mlp\.gate$", r"re:^model\.language_model\.layers\.1\.mlp\.down_proj$"]
    assert not matches("model.language_model.layers.1.mlp.gate_up_proj", entries[1])


@pytest.mark.parametrize(("arch", "perturb"), [("qwen3_moe", {}), ("llama", {"disagreement": "ignored-but-quantized"})])
def test_patterns_and_names_ignore_the_same_modules(arch, perturb, tmp_path):
    ignored = {}
    for style in ("names", "patterns"):
        recipe = Recipe(
            format="ct-fp8-channel",
            arch=arch,
            config={"num_hidden_layers": 2},
            layout={"ignore_style": style},
            perturb=perturb,
        )
        generate(recipe, tmp_path / style)
        entries = json.loads((tmp_path / style / "config.json").read_text())["quantization_config"]["ignore"]
        modules = {n.rpartition(".")[0] for n in Checkpoint(tmp_path / style).names()}
        ignored[style] = {m for m in modules if any(matches(m, e) for e in entries)}
        if style == "patterns":
            assert any(e.startswith("re:") for e in entries)
            findings = [f.check for f in audit_checkpoint(tmp_path / style).findings]
            assert ("ignore-list" in findings) == bool(perturb)
    assert ignored["names"] == ignored["patterns"]
    assert ignored["names"]


def test_patterns_are_compressed_tensors_spelling_only():
    with pytest.raises(HarnessError, match="compressed-tensors' spelling"):
        Recipe(format="fp8-block", arch="llama", layout={"ignore_style": "patterns"}).resolved()
