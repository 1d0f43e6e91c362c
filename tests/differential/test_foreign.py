"""Checkpoints the harness did not write are judged like generated ones: the inferred expectation
says why, and known issues match them by the facts read from the checkpoint itself."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import MANIFEST_FILE, TRUTH_DIR, generate
from harness.differential.preconditions import checkpoint_context
from tests.cli import run_cli as cli

pytest.importorskip("transformers")


def foreign(tmp_path, arch="llama", saved_config=None, **recipe) -> str:
    """A generated checkpoint with its manifest (recipe, truth index) removed and no tokenizer:
    nothing but what a producer would ship. `saved_config`: config.json edited as transformers'
    save_pretrained writes it."""
    directory = tmp_path / "ckpt"
    generate(Recipe(arch=arch, config={"num_hidden_layers": 1}, **recipe), directory)
    (directory / MANIFEST_FILE).unlink()
    shutil.rmtree(directory / TRUTH_DIR)
    for tokenizer in directory.glob("tokenizer*"):
        tokenizer.unlink()
    if saved_config:
        config = json.loads((directory / "config.json").read_text())
        saved_config(config)
        (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def compared(tmp_path, directory, engines="reference,transformers"):
    result = cli("compare", directory, "--engines", engines, "--report", tmp_path / "r")
    report = json.loads((tmp_path / "r" / "report.json").read_text()) if (tmp_path / "r").is_dir() else {}
    return result, report.get("findings", [])


def test_a_foreign_nan_scale_is_a_finding_of_the_checkpoint_and_matched_to_the_known_issue(tmp_path):
    directory = foreign(tmp_path, format="fp8-block", perturb={"nonfinite_scale": "nan"})
    assert checkpoint_context(directory)["nonfinite_scale"] == "nan"
    result, findings = compared(tmp_path, directory)
    assert result.returncode == 1, result.stdout + result.stderr  # the checkpoint itself is broken
    assert "expectation refuse: the reference refuses it" in result.stdout
    by_engine = {f["engine"]: f for f in findings}
    assert by_engine["reference"]["kind"] == "invalid-checkpoint" and "non-finite" in by_engine["reference"]["message"]
    assert by_engine["transformers"]["known_issue"] == "transformers-nonfinite-scale-accepted"
    alone = cli("compare", directory, "--engines", "reference")
    assert alone.returncode == 1 and "invalid-checkpoint" in alone.stdout, alone.stdout + alone.stderr


def test_kv_scales_without_a_manifest_are_the_caches_not_missing_weights(tmp_path):
    directory = foreign(tmp_path, format="ct-fp8-tensor", layout={"kv_scales": "self_attn"})
    result, findings = compared(tmp_path, directory, "reference,transformers,compressed-tensors")
    assert result.returncode == 0 and findings == [], result.stdout + result.stderr


def test_kv_scales_without_a_manifest_are_judged(tmp_path):
    """The older `k_proj.output_scale` naming, which transformers drops (a known issue): found
    without the manifest too, so the KV scales are judged, not skipped."""
    directory = foreign(tmp_path, format="ct-fp8-tensor", layout={"kv_scales": "output_scale"})
    result, findings = compared(tmp_path, directory)
    assert result.returncode == 0, result.stdout + result.stderr
    assert findings and all(f["engine"] == "transformers" and f["known_issue"] for f in findings)


def _null_head_dim(config):
    config["head_dim"] = None


def _as_qwen3_moe_saves(config):
    config["num_local_experts"] = config.pop("num_experts")
    config.pop("head_dim")


def test_mixtral_as_transformers_and_llm_compressor_save_it(tmp_path):
    """`"head_dim": null` and experts named gate_proj/up_proj/down_proj: the reference reads them;
    transformers leaves those experts random, a known issue reported as weights missing."""
    directory = foreign(
        tmp_path, "mixtral", _null_head_dim, format="ct-fp8-channel", layout={"expert_naming": "projections"}
    )
    result, findings = compared(tmp_path, directory)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [f for f in findings if f["engine"] == "reference"]
    (finding,) = findings
    assert finding["kind"] == "weights-missing" and "random" in finding["message"]
    assert finding["known_issue"] == "transformers-mixtral-projection-named-experts-left-random"


def test_qwen3_moe_as_transformers_saves_it_is_clean_against_the_reference(tmp_path):
    """`num_experts` saved as `num_local_experts`, no head_dim: the reference reads it (it crashed
    on the raw JSON), and transformers' known activation issue on experts shows through again."""
    directory = foreign(tmp_path, "qwen3_moe", _as_qwen3_moe_saves, format="ct-fp8-tensor")
    result, findings = compared(tmp_path, directory)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [f["known_issue"] for f in findings] == ["transformers-ct-moe-experts-activations-unquantized"]


def test_a_scheme_the_harness_does_not_define_is_unsupported_with_exit_2(tmp_path):
    def per_channel(config):  # int4 weights per channel (strategy channel, no group size)
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None)

    directory = foreign(tmp_path, saved_config=per_channel, format="ct-int4")
    for command in ("compare", "audit"):
        result = cli(command, directory, *(["--engines", "reference"] if command == "compare" else []))
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("unsupported: ") and "channel" in line, line


def test_an_error_inside_layout_detection_is_an_error(monkeypatch):
    """A registered architecture whose config cannot give its layout: `unsupported`, never None
    (which would leave experts unpacked and judge every expert a false finding)."""
    from harness.checkpoints import saved_config
    from harness.checkpoints.model_layout import LayoutError, known_layout

    monkeypatch.setattr(saved_config, "_class_values", lambda *_: {})  # as without transformers
    config = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    with pytest.raises(LayoutError, match="lacks"):
        known_layout(config)
    assert known_layout({"model_type": "not-registered"}) is None


def test_saved_config_reads_fields_as_the_class_does():
    from harness.checkpoints.model_layout import layout_settings

    saved = {"model_type": "qwen3_moe", "hidden_size": 128, "num_attention_heads": 4, "num_local_experts": 3}
    settings = layout_settings(saved)
    assert settings["num_experts"] == 3 and settings["head_dim"] == 32


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


@pytest.mark.parametrize("naming", ["architecture", "projections"])
def test_a_foreign_mixtral_expert_naming_is_read_from_its_names(naming, tmp_path):
    """Only llm-compressor's gate_proj/up_proj/down_proj is `expert_naming = "projections"`: before
    session 43 a Mixtral in its own w1/w3/w2 read as projections too, and a finding on it could be
    attributed to transformers-mixtral-projection-named-experts-left-random."""
    directory = foreign(tmp_path, arch="mixtral", format="ct-fp8-channel", layout={"expert_naming": naming})
    assert checkpoint_context(directory).get("expert_naming") == (naming if naming == "projections" else None)
