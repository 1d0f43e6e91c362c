"""Adding a format or an engine is one file: tests/plugins/toy_int8.py registers both from outside
the package (HARNESS_PLUGINS, the same mechanism as a user's own plugin), and `gen` and `compare`
treat them as their own: a correct toy loader agrees, its deliberately buggy variant is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli import run_cli

PLUGIN = Path(__file__).resolve().parent / "plugins" / "toy_int8.py"


def harness(*args: str, plugins: str = str(PLUGIN), **env: str):
    return run_cli(*args, timeout=600, HARNESS_PLUGINS=plugins, **env)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("toy") / "ckpt"
    done = harness(
        "gen",
        "--format",
        "toy-int8",
        "--arch",
        "qwen2",
        "--seed",
        "3",
        "--out",
        str(directory),
        "--set",
        "hidden_size=96",
        "--set",
        "shards=2",
    )
    assert done.returncode == 0, done.stderr
    return directory


def test_the_plugins_format_is_listed_and_generated(toy_checkpoint):
    assert "toy-int8" in harness("gen", "--help").stdout
    manifest = json.loads((toy_checkpoint / "harness_manifest.json").read_text())
    assert manifest["recipe"]["format"] == "toy-int8" and manifest["expectation"] == "exact"


@pytest.mark.slow
def test_compare_runs_the_plugins_engine_against_the_reference(toy_checkpoint, tmp_path):
    done = harness("compare", str(toy_checkpoint), "--engines", "reference,toy", "--report", str(tmp_path / "ok"))
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert "toy" in json.dumps(outcomes) and "no findings" in done.stdout


@pytest.mark.slow
def test_the_buggy_toy_loader_is_caught(toy_checkpoint, tmp_path):
    """Test double: TOY_ENGINE_BUG applies each row's scale to the mirrored row."""
    done = harness("compare", str(toy_checkpoint), "--engines", "reference,toy", TOY_ENGINE_BUG="transpose-scale")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[NEW] toy weight-mismatch" in done.stdout
    assert f"HARNESS_PLUGINS={PLUGIN} python -m harness compare" in done.stdout  # the repro carries the plugin


def test_a_plugin_that_cannot_load_is_one_line_and_exit_2(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    done = harness(
        "gen", "--format", "fp8-block", "--arch", "llama", "--out", str(tmp_path / "out"), plugins=str(broken)
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "cannot load plugin" in done.stderr and "boom" in done.stderr and len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()
