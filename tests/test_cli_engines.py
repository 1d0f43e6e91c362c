"""compare / run / sweep end to end through the real CLI: exit codes, reports, reproductions."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from tests.cli import run_cli as cli

pytest.importorskip("transformers")
DROPPED = "tests.doubles.buggy_engines:DroppedScaleEngine"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt") / "fp8"
    result = cli(
        "gen",
        "--format",
        "fp8-block",
        "--arch",
        "llama",
        "--out",
        directory,
        "--set",
        "num_hidden_layers=1",
        "--set",
        "intermediate_size=256",
    )
    assert result.returncode == 0, result.stderr
    return directory


def test_compare_clean_checkpoint_exits_0_with_no_new_finding(checkpoint, tmp_path):
    result = cli("compare", checkpoint, "--engines", "reference,transformers", "--report", tmp_path / "r")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    # weights and load report clean; on CPU transformers leaves FineGrainedFP8's activations unquantized
    known = {"transformers-fp8-block-cpu-activations-unquantized"}
    assert {f["known_issue"] for f in report["findings"]} <= known, report["findings"]
    assert {"reference", "transformers"} <= set(report["checkpoints"][0]["outcomes"])
    assert (tmp_path / "r" / "report.md").is_file()


def test_compare_finding_exits_1_with_heatmap_and_a_command_that_reproduces_it(checkpoint, tmp_path):
    result = cli("compare", checkpoint, "--engines", f"reference,{DROPPED}", "--report", tmp_path / "r")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    kinds = {f["kind"] for f in report["findings"]}
    assert {"dropped-scale", "weight-mismatch"} <= kinds
    mismatch = next(f for f in report["findings"] if f["kind"] == "weight-mismatch")
    assert mismatch["module"] and mismatch["format"] == "fp8-block" and mismatch["engine"] == DROPPED
    assert (tmp_path / "r" / mismatch["heatmap"]).read_bytes().startswith(b"\x89PNG")
    command = shlex.split(mismatch["command"])
    assert command[:4] == ["python", "-m", "harness", "compare"]
    again = cli(*command[3:])
    assert again.returncode == 1 and "weight-mismatch" in again.stdout


def test_compare_refuses_bad_engine_names_in_one_line(checkpoint):
    """Through the real entry point, `python -m harness` in a new interpreter (the other calls fork
    a server that has imported the CLI: tests/cli.py)."""
    result = cli("compare", checkpoint, "--engines", "nope", fresh=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_run_campaign_shrinks_a_new_finding_and_leaves_its_reproduction(tmp_path):
    result = cli(
        "run",
        "--engines",
        f"reference,{DROPPED}",
        "--formats",
        "fp8-block",
        "--archs",
        "llama",
        "--max-examples",
        "3",
        "--report",
        tmp_path / "r",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    repro = {f["reproduction"] for f in report["findings"] if f["kind"] == "dropped-scale"}
    assert len(repro) == 1
    manifest = json.loads(
        (tmp_path / "r" / "repro").joinpath(next(iter(repro)).rsplit("/", 1)[-1], "harness_manifest.json").read_text()
    )
    assert manifest["recipe"]["format"] == "fp8-block"
    assert "reproduce: python -m harness compare" in result.stdout


def test_run_with_agreeing_engines_exits_0(tmp_path):
    result = cli("run", "--engines", "reference", "--formats", "ct-fp8-channel", "--max-examples", "2", "--no-shrink")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 new" in result.stdout


def test_sweep_gen_then_dequant_every_format_and_arch_at_odd_sizes(tmp_path):
    result = cli("sweep", "--out", tmp_path / "sweep")
    assert result.returncode == 0, result.stdout + result.stderr
    from harness.checkpoints.architectures import ARCHITECTURES
    from harness.checkpoints.recipe import pairing_refusal
    from harness.formats import FORMAT_NAMES, get_format

    pairs = [(f, a) for f in FORMAT_NAMES for a in ARCHITECTURES.values() if not pairing_refusal(get_format(f), a)]
    assert len(pairs) > len(FORMAT_NAMES)
    assert f"{len(pairs)} passed, 0 failed" in result.stdout


def test_an_engine_that_cannot_run_is_exit_2_not_a_silent_pass(checkpoint, tmp_path):
    """A user's loader that does not import (or an engine not installed) stops compare and run with one
    line; named in --optional-engines, the run goes on and says the engine was skipped."""
    missing = "tests.doubles.buggy_engines:NoSuchClass"
    for command in (("compare", checkpoint), ("run", "--formats", "fp8-block", "--max-examples", "1", "--no-shrink")):
        result = cli(*command, "--engines", f"reference,{missing}")
        assert result.returncode == 2, result.stdout + result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and f"engine {missing} cannot run" in result.stderr
    optional = cli("compare", checkpoint, "--engines", f"reference,{missing}", "--optional-engines", missing)
    assert optional.returncode == 0 and "unavailable" in optional.stdout, optional.stdout + optional.stderr
    stray = cli("compare", checkpoint, "--engines", "reference", "--optional-engines", "vllm")
    assert stray.returncode == 2 and "does not list" in stray.stderr


def test_run_says_when_an_engine_ran_on_nothing():
    """compressed-tensors reads its own formats only: on fp8-block alone it runs on nothing, and says so."""
    result = cli(
        "run",
        "--engines",
        "reference,compressed-tensors",
        "--formats",
        "fp8-block",
        "--max-examples",
        "2",
        "--no-shrink",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = next((x for x in result.stdout.splitlines() if x.startswith("engine compressed-tensors ran on nothing")), "")
    assert line.endswith(" unsupported") and "loaded" not in line, result.stdout
    assert "engine reference ran on nothing" not in result.stdout


def test_run_keeps_a_reproduction_for_known_findings_too(tmp_path):
    """Every finding in the report, known or new, names a checkpoint that exists and a command that
    shows the same finding again (the examples themselves are deleted as the campaign goes)."""
    result = cli(
        "run",
        "--engines",
        "reference,transformers",
        "--formats",
        "fp8-block",
        "--max-examples",
        "4",
        "--no-shrink",
        "--report",
        tmp_path / "r",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "up to 4 examples" in result.stdout and "4 examples," in result.stdout
    findings = json.loads((tmp_path / "r" / "report.json").read_text())["findings"]
    known = [f for f in findings if f["known_issue"]]
    assert known, "the derandomized profile draws a known transformers fp8-block issue in 4 examples"
    for finding in findings:
        assert (tmp_path / "r" / "repro").exists() and os.path.isdir(finding["reproduction"]), finding
        assert finding["command"].startswith(f"python -m harness compare {finding['reproduction']} "), finding
    again = cli(*shlex.split(known[0]["command"])[3:])
    assert again.returncode == 0 and f"known issue {known[0]['known_issue']}" in again.stdout, again.stdout
