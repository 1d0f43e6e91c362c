"""`merge-reports`: two real shard reports (written by write_report) merged into one; exit codes
0 / 1 / 2; heatmaps copied; nothing written outside OUT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.differential.report import write_report
from tests.cli import run_cli
from tests.differential.test_report import coverage_row, weight_finding

ENGINES = {"reference": {"version": "0.1.0", "status": "ran"}, "vllm": {"version": "0.32.0", "status": "ran"}}


def checkpoint(directory: str) -> dict:
    return {
        "directory": directory,
        "format": "fp8-block",
        "expectation": "load",
        "outcomes": {"reference": {"status": "loaded"}, "vllm": {"status": "loaded"}},
    }


def shard(tmp_path: Path, number: int, *, new: bool, engines: dict = ENGINES) -> Path:
    """A shard's report as the campaign writes it: a finding with a heatmap, coverage, extra keys."""
    out = tmp_path / f"shard-{number}"
    item = weight_finding(known=None if new else "known-one")
    item.reproduction = str(tmp_path / f"shard-{number}" / "repro" / "x")
    item.command = f"python -m harness compare {item.reproduction} --engines reference,vllm"
    rows = [
        coverage_row("fp8-block/llama/bfloat16/plain", 3, {"reference": 3, "vllm": 2}, new=int(new)),
        coverage_row(f"fp8-block/qwen2/float16/only-{number}", 1, {"reference": 1, "vllm": 0}, refused=1),
        coverage_row("ct-fp8/llama/bfloat16/plain", 0, {"reference": 0, "vllm": 0}),
    ]
    write_report(
        out,
        [item],
        [checkpoint(f"/work/ck-{number}")],
        engines,
        f"run: {number * 10} examples",
        coverage=rows,
        extra={
            "examples": number * 10,
            "shrink_examples": number,
            "stopped": f"stop {number}",
            "shard": f"{number}/2",
            "budget": "10m",
            "counts": [
                {"signature": ["vllm", "weight-mismatch", "fp8-block", "c"], "seen": number, "new": new},
                {"signature": ["vllm", "load-error", "fp8-block", f"c{number}"], "seen": 1, "new": False},
            ],
            "known_issues_rediscovered": ["known-one", f"only-{number}"],
        },
    )
    return out


def listing(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*"))}


def test_merge_sums_coverage_and_examples_and_copies_heatmaps(tmp_path):
    first, second = shard(tmp_path, 1, new=False), shard(tmp_path, 2, new=True)
    before = listing(tmp_path)
    out = tmp_path / "merged"
    result = run_cli("merge-reports", out, first, second / "report.json", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr  # shard 2's finding is new
    assert "NEW vllm weight-mismatch" in result.stdout and "reproduce: python -m harness compare" in result.stdout
    after = listing(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("merged")} == before  # nothing outside OUT
    report = json.loads((out / "report.json").read_text())
    assert report["examples"] == 30 and report["summary"]["examples"] == 30
    assert report["shards"] == ["1/2", "2/2"] and report["budget"] == "10m"
    assert report["shrink_examples"] == 3 and report["stopped"] == ["stop 1", "stop 2"]
    assert report["counts"] == [
        {"signature": ["vllm", "weight-mismatch", "fp8-block", "c"], "seen": 3, "new": True},
        {"signature": ["vllm", "load-error", "fp8-block", "c1"], "seen": 1, "new": False},
        {"signature": ["vllm", "load-error", "fp8-block", "c2"], "seen": 1, "new": False},
    ]
    assert report["known_issues_rediscovered"] == ["known-one", "only-1", "only-2"]
    assert report["summary"]["findings"] == 2 and report["summary"]["new"] == 1
    assert [f["known_issue"] for f in report["findings"]] == ["known-one", None]
    assert [f["reproduction"] for f in report["findings"]] == [
        str(tmp_path / "shard-1" / "repro" / "x"),
        str(tmp_path / "shard-2" / "repro" / "x"),
    ]
    assert [c["directory"] for c in report["checkpoints"]] == ["/work/ck-1", "/work/ck-2"]
    assert report["engines"] == ENGINES
    cells = {row["cell"]: row for row in report["coverage"]}
    assert len(cells) == 4
    plain = cells["fp8-block/llama/bfloat16/plain"]
    assert (plain["examples"], plain["findings"], plain["new"]) == (6, 1, 1)
    assert plain["engines"]["vllm"]["loaded"] == 4 and plain["engines"]["reference"]["loaded"] == 6
    assert cells["fp8-block/qwen2/float16/only-1"]["engines"]["vllm"]["refused"] == 1
    heatmaps = [f["heatmap"] for f in report["findings"]]
    assert len(set(heatmaps)) == 2
    for name in heatmaps:
        assert name.startswith("heatmaps/") and (out / name).read_bytes().startswith(b"\x89PNG")
    markdown = (out / "report.md").read_text()
    assert "30 example(s), 2 finding(s)" in markdown and "3 of 4 planned cell(s) reached" in markdown
    assert f"![per-block error]({heatmaps[1]})" in markdown


def test_merge_of_known_findings_only_exits_0_and_notes_differing_versions(tmp_path):
    other = {**ENGINES, "vllm": {"version": "0.31.0", "status": "ran"}}
    first, second = shard(tmp_path, 1, new=False), shard(tmp_path, 2, new=False, engines=other)
    result = run_cli("merge-reports", tmp_path / "merged", first, second, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "merged" / "report.json").read_text())
    assert report["engines"]["vllm"]["version"] == "0.32.0, 0.31.0"
    assert any("engine vllm: the shards ran different versions" in note for note in report["notes"])


def test_a_merged_report_merges_again(tmp_path):
    from harness.commands.merge_reports import merge_reports

    first = merge_reports(tmp_path / "m1", [shard(tmp_path, 1, new=False)])
    assert first["examples"] == 10
    again = merge_reports(tmp_path / "m2", [tmp_path / "m1", shard(tmp_path, 2, new=True)])
    assert again["examples"] == 30 and again["shards"] == ["1/2", "2/2"]
    assert all((tmp_path / "m2" / f["heatmap"]).is_file() for f in again["findings"])


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: d / "absent", "no such file or directory"),
        (lambda d: d, "no report.json in this directory"),
        (lambda d: write(d / "report.json", "{not json"), "not JSON"),
        (lambda d: write(d / "report.json", "[1, 2]"), "not a harness report"),
        (lambda d: write(d / "report.json", '{"findings": [], "engines": {}}'), "no `checkpoints` list"),
        (
            lambda d: write(d / "r.json", '{"findings": [{"engine": "e"}], "engines": {}, "checkpoints": []}'),
            "not a harness report (a finding",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, make, says):
    given = tmp_path / "in"
    given.mkdir()
    result = run_cli("merge-reports", tmp_path / "out", shard(tmp_path, 1, new=True), make(given), timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr
    assert not (tmp_path / "out").exists()  # every input is read before anything is written


def test_out_may_not_be_one_of_the_reports(tmp_path):
    from harness.commands.merge_reports import merge_reports

    first = shard(tmp_path, 1, new=True)
    with pytest.raises(HarnessError, match="is one of the reports merged"):
        merge_reports(first, [first])


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
