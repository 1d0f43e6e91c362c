"""The campaign keeps exploring: distinct bugs are told apart, each shrunk and kept; the budget
and the shard bound what runs; a run is deterministic under the ci profile."""

from __future__ import annotations

import json

import pytest

from harness.campaign.cells import Coverage
from harness.campaign.explore import UNCHECKED_TURN, Budget, count_checked
from harness.commands.run import parse_duration
from harness.core.errors import HarnessError
from harness.core.findings import Finding, normalise
from tests.cli import run_cli as cli

pytest.importorskip("transformers")
TWO_BUGS = "tests.doubles.campaign_doubles:TwoBugsEngine"


def test_the_campaign_goes_on_after_its_first_new_finding_and_finds_the_second_bug(tmp_path):
    """A double with one bug in fp8-block and another in ct-fp8-channel: both are found, as
    distinct signatures, each with a minimal reproduction that shows it again. The budget is
    small (12 examples, 6 cells): shrinking the first finding leaves every other cell its visit."""
    result = cli(
        "run",
        "--engines",
        f"reference,{TWO_BUGS}",
        "--formats",
        "fp8-block,ct-fp8-channel",
        "--archs",
        "qwen2",
        "--families",
        "plain",
        "--max-examples",
        "12",
        "--report",
        tmp_path / "r",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    new = [c for c in report["counts"] if c["new"]]
    kinds = {(c["signature"][1], c["signature"][2]) for c in new}
    assert ("weight-mismatch", "fp8-block") in kinds and ("weight-nonfinite", "ct-fp8-channel") in kinds, kinds
    for engine, kind, fmt in (
        (TWO_BUGS, "weight-mismatch", "fp8-block"),
        (TWO_BUGS, "weight-nonfinite", "ct-fp8-channel"),
    ):
        item = next(f for f in report["findings"] if (f["engine"], f["kind"], f["format"]) == (engine, kind, fmt))
        again = cli(*item["command"].split()[3:])
        assert again.returncode == 1 and kind in again.stdout
    assert report["examples"] <= 12 and report["shrink_examples"] > 0
    assert all(row["examples"] >= 1 for row in report["coverage"]), report["coverage"]
    assert sum(row["examples"] for row in report["coverage"]) == report["examples"]


def test_the_same_command_explores_the_same_examples_under_the_ci_profile(tmp_path):
    runs = [
        cli(
            "run",
            "--engines",
            "reference",
            "--formats",
            "ct-fp8-tensor",
            "--max-examples",
            "12",
            "--report",
            tmp_path / n,
        )
        for n in ("a", "b")
    ]
    assert all(r.returncode == 0 for r in runs), runs[0].stdout + runs[0].stderr
    rows = [json.loads((tmp_path / n / "report.json").read_text())["coverage"] for n in ("a", "b")]
    assert rows[0] == rows[1] and sum(r["examples"] for r in rows[0]) == 12
    # where the time went: the seconds waited on the worker, per request, in the summary and the report
    spent = json.loads((tmp_path / "a" / "report.json").read_text())["seconds_per_worker_op"]
    assert set(spent) == {"reference"} and all(spent["reference"][op] > 0 for op in ("start", "load", "logprobs"))
    assert "time: reference " in runs[0].stdout and "harness (generate, oracle, judge)" in runs[0].stdout


def test_a_shard_explores_only_its_cells(tmp_path):
    result = cli(
        "run", "--engines", "reference", "--formats", "ct-fp8-tensor", "--shard", "2/3", "--max-examples", "6",
        "--report", tmp_path / "r",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    everything = cli("run", "--engines", "reference", "--formats", "ct-fp8-tensor", "--max-examples", "1")
    total = int(everything.stdout.split("campaign: ")[1].split()[0])
    assert report["shard"] == "2/3" and len(report["coverage"]) in (total // 3, total // 3 + 1)


def test_relations_every_sets_how_often_a_relation_is_checked(tmp_path):
    """--relations-every 1 checks a relation on every example, 3 on the third of three only."""
    common = [
        "run",
        "--engines",
        "reference",
        "--formats",
        "ct-fp8-tensor",
        "--families",
        "plain",
        "--max-examples",
        "3",
    ]
    checked = {}
    for every in (1, 3):
        result = cli(
            *common, "--relations", "load-twice", "--relations-every", str(every), "--report", tmp_path / str(every)
        )
        assert result.returncode == 0 and f"one on 1 example in {every}" in result.stdout, result.stdout + result.stderr
        report = json.loads((tmp_path / str(every) / "report.json").read_text())
        assert report["relations_every"] == every
        checked[every] = [sorted(c["outcomes"]["reference"]["relations"]) for c in report["checkpoints"]]
    assert checked == {1: [["load-twice"]] * 3, 3: [[], [], ["load-twice"]]}, checked


def test_a_familys_relations_and_variants_are_checked_on_every_example_of_its_cells(tmp_path):
    """unignored-plain-relations names the sentinel (and tensor parallelism, vLLM's: not in this
    run): every example checks it, whatever the campaign samples (here one relation in 1000
    examples); load-dtype names transformers in float16, loaded beside plain transformers on every
    example; `--relations none` and `--options-every 0` still turn both off."""
    common = ["run", "--engines", "reference,transformers", "--relations-every", "1000", "--max-examples", "3"]
    common += ["--families", "unignored-plain-relations,load-dtype", "--formats", "ct-fp8-channel,ct-fp8-tensor"]
    result = cli(
        *common, "--report", tmp_path / "on"
    )  # ct-fp8-channel: the first family's only, ct-fp8-tensor: the second's
    assert result.returncode in (0, 1), result.stdout + result.stderr
    checkpoints = json.loads((tmp_path / "on" / "report.json").read_text())["checkpoints"]
    assert sorted(c["format"] for c in checkpoints) == ["ct-fp8-channel", "ct-fp8-channel", "ct-fp8-tensor"]
    for checkpoint in checkpoints:
        plain = checkpoint["format"] == "ct-fp8-channel"
        assert ("sentinel" in checkpoint["outcomes"]["reference"]["relations"]) is plain
        assert ("transformers[dtype=float16]" in checkpoint["outcomes"]) is not plain
    result = cli(*common, "--relations", "none", "--options-every", "0", "--report", tmp_path / "off")
    assert result.returncode in (0, 1), result.stdout + result.stderr
    for checkpoint in json.loads((tmp_path / "off" / "report.json").read_text())["checkpoints"]:
        assert set(checkpoint["outcomes"]) == {"reference", "transformers"}
        assert not checkpoint["outcomes"]["reference"]["relations"]


def test_a_recipe_another_cell_evaluated_is_evaluated_again_where_its_family_checks_more(tmp_path):
    """producer-round-trip's simplest awq/llama/float32 recipe is producer-config's own; a recipe is
    evaluated once per what its cell checks, so the round-trip relation runs on it all the same
    (session 40: keyed by the recipe alone, the family's relation never ran in the main job)."""
    result = cli(
        *("run", "--engines", "reference", "--families", "producer-config,producer-round-trip"),
        *("--formats", "awq", "--archs", "llama", "--max-examples", "4", "--relations-every", "1000"),
        *("--no-shrink", "--report", tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert {c["cell"]: c["examples"] for c in report["coverage"]}["awq/llama/float32/producer-round-trip"] == 1
    relations = [c["outcomes"]["reference"]["relations"] for c in report["checkpoints"]]
    family = sorted(Coverage.load().families["producer-round-trip"].relations)  # round-trip among them
    assert "round-trip" in family and sorted(map(sorted, relations)) == [[], [], [], family], relations


def test_a_relation_no_engine_could_check_counts_less_than_one_that_ran():
    """The least-checked order counts real checks: a tensor-parallel turn vLLM refused (a float32
    gpt-oss) counts UNCHECKED_TURN, so the relation comes back before one that ran; any engine that
    checked it (held or not) makes it a whole check."""
    from harness.differential.judgement import EngineOutcome

    refused, ran = EngineOutcome("vllm"), EngineOutcome("transformers")
    refused.relations = {"tensor-parallel": "not checked: vLLM: torch.float32 is not supported"}
    ran.relations = {"load-twice": "does not hold"}
    checked: dict[str, float] = {}
    count_checked(checked, ("tensor-parallel", "load-twice"), {"vllm": refused, "transformers": ran})
    count_checked(checked, ("offload",), {"vllm": refused})  # no verdict at all: not checked either
    assert checked == {"tensor-parallel": UNCHECKED_TURN, "load-twice": 1, "offload": UNCHECKED_TURN}
    assert 0 < UNCHECKED_TURN < 1


def test_a_bad_relations_every_is_one_line():
    result = cli("run", "--engines", "reference", "--relations-every", "0")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "--relations-every expects a whole number of examples >= 1, got 0" in result.stderr


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("10m", 600), ("1.5h", 5400)])
def test_budgets_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten minutes", "0", "-5m", "5d"])
def test_a_bad_budget_is_one_line(text):
    with pytest.raises(HarnessError, match="--budget expects"):
        parse_duration(text)


def test_a_budget_stops_on_examples_or_time():
    assert Budget(max_examples=3).spent(3) and not Budget(max_examples=3).spent(2)
    assert Budget(seconds=0.0).spent(0) and not Budget(seconds=3600).spent(10**6)


def test_a_signature_tells_causes_apart_and_ignores_numbers():
    def finding(message, kind="load-error"):
        return Finding(engine="e", engine_version="1", kind=kind, format="f", message=message)

    a = finding("start (0) + length (72) exceeds dimension size (32)")
    b = finding("start (0) + length (96) exceeds dimension size (64)")
    c = finding("expected m1 and m2 to have the same dtype, but got: c10::Half != c10::BFloat16")
    assert a.signature() == b.signature() != c.signature()
    assert "c10::BFloat16" in c.cause()
    w1 = finding("model.layers.0.mlp.up_proj.weight: 3/9 elements differ [checkpoint: zero block 0]", "weight-mismatch")
    w2 = finding("model.layers.1.mlp.down_proj.weight: 5/9 elements differ", "weight-mismatch")
    assert w1.cause() == "zero block N" and w2.cause() == "unperturbed module"
    known = finding("anything")
    known.known_issue = "some-issue"
    assert known.cause() == "known: some-issue"
    assert normalise("/tmp/a/b.safetensors: 1.5e-3 off") == "PATH: N off"
    assert normalise("not applied at 1/7 quantized Linear(s)") == "not applied at N/N quantized Linear(s)"
    assert normalise("missing model.layers.1.mlp.experts.12.w1.weight_scale") == normalise(
        "missing model.layers.0.mlp.experts.3.w1.weight_scale"
    )


def test_each_cell_keeps_its_own_examples_in_a_shared_database():
    """The nightly profile's example database: one test function serves every cell, so each cell's
    entries live under the cell's own prefix and never replay in another cell."""
    from hypothesis.database import InMemoryExampleDatabase

    from harness.campaign.cells import Coverage
    from harness.campaign.explore import CellDatabase

    first, second = Coverage.load().cells()[:2]
    shared = InMemoryExampleDatabase()
    a, b = CellDatabase(shared, first.key()), CellDatabase(shared, second.key())
    a.save(b"test", b"example")
    assert list(a.fetch(b"test")) == [b"example"] and list(b.fetch(b"test")) == []
    a.delete(b"test", b"example")
    assert list(a.fetch(b"test")) == []


def test_the_campaign_finds_an_engine_that_ignores_activation_quantization(tmp_path):
    """The labelled double that runs activation-quantized checkpoints on unquantized activations
    is a new `activations` finding of the campaign itself, not only of `compare` (float32 cells)."""
    result = cli(
        "run",
        "--engines",
        "reference,tests.doubles.buggy_engines:ActivationsIgnoredEngine",
        "--formats",
        "ct-fp8-tensor",
        "--archs",
        "llama",
        "--families",
        "plain",
        "--max-examples",
        "12",
        "--no-shrink",
        "--report",
        tmp_path / "r",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert ("activations", "ct-fp8-tensor") in {(c["signature"][1], c["signature"][2]) for c in report["counts"]}


def test_the_campaign_finds_a_static_input_scale_read_in_the_other_convention(tmp_path):
    """The labelled double that reads static input scales as 1/s is found by the campaign on its own
    in the input-scale cells, named for what it does (the activation probe's verdict)."""
    result = cli(
        "run",
        "--engines",
        "reference,tests.doubles.buggy_engines:InvertedInputScaleEngine",
        "--formats",
        "ct-fp8-tensor",
        "--archs",
        "llama",
        "--families",
        "input-scale",
        "--max-examples",
        "6",
        "--no-shrink",
        "--report",
        tmp_path / "r",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    messages = [f["message"] for f in report["findings"] if f["kind"] == "activations"]
    assert any("static scale in the other convention" in m for m in messages), messages
