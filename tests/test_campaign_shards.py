"""The pytest plugin's sharded campaign: `--harness-campaign-shards N` collects N items, xdist
spreads them over its workers, a shard's exit 1 / 2 fails its item with the reason, and the
controller merges the shard reports at the end.

The first tests stand a small script in for `python -m harness run` (the plugin's `shard_command`,
replaced by a conftest), so they prove the plugin alone; the last runs a tiny real campaign."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = '''
"""A stand-in shard: writes a shard report; shard 2 has a new finding (exit 1), BAD=I exits 2."""
import os, sys
from pathlib import Path
from harness.core.findings import Finding
from harness.differential.report import write_report

index, total, report = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
print("shard", index, "of", total, "args", sys.argv[4:])
if os.environ.get("BAD") == str(index):
    print("error: --engines names nope, which is not an engine", file=sys.stderr)
    sys.exit(2)
new = index == 2
finding = Finding(engine="vllm", engine_version="0.32.0", kind="weight-mismatch", format="fp8-block",
                  message=f"w{index}: 3 elements differ", module=f"w{index}", known_issue=None if new else "known",
                  command=f"python -m harness compare /repro/{index} --engines reference,vllm",
                  metrics={"block_ratio": [[0.0, 2.0]], "shape": [128, 256], "block": [128, 128]})
row = {"cell": "fp8-block/llama/bfloat16/plain", "format": "fp8-block", "arch": "llama", "dtype": "bfloat16",
       "family": "plain", "examples": 5, "findings": 1, "new": int(new),
       "engines": {"vllm": {"loaded": 5, "refused": 0, "unsupported": 0, "failed": 0, "unavailable": 0}}}
write_report(report, [finding], [], {"vllm": {"version": "0.32.0", "status": "ran"}}, "run",
             coverage=[row], extra={"examples": 5, "shard": f"{index}/{total}"})
sys.exit(1 if new else 0)
'''

CONFTEST = """
import sys
import harness.pytest_plugin as plugin

def stand_in(index, total, report, args):
    return [sys.executable, {script!r}, str(index), str(total), str(report), *args]

plugin.shard_command = stand_in
"""


def pytest_run(directory: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *args],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )


@pytest.fixture
def project(tmp_path) -> Path:
    """A directory outside the repository whose conftest puts the stand-in in place of `run`."""
    script = tmp_path / "stand_in.py"
    script.write_text(textwrap.dedent(STAND_IN))
    (tmp_path / "conftest.py").write_text(CONFTEST.format(script=str(script)))
    (tmp_path / "test_unrelated.py").write_text("def test_not_collected_in_campaign_mode():\n    assert False\n")
    return tmp_path


def test_shards_spread_over_xdist_workers_fail_on_new_findings_and_merge(project):
    result = pytest_run(
        project, "-p", "xdist", "-n", "2", "--harness-campaign-shards", "2", "--harness-campaign-args", "--x 'a b'"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "[gw0]" in output and "[gw1]" in output
    assert "PASSED campaign shard 1/2" in output and "FAILED campaign shard 2/2" in output
    assert "test_not_collected" not in output
    assert "campaign shard 2/2: exit 1, 1 new finding(s)" in output
    assert "NEW vllm weight-mismatch (fp8-block): w2: 3 elements differ" in output
    assert "reproduce: python -m harness compare /repro/2" in output
    out = project / "out" / "campaign-shards"
    assert "args ['--x', 'a b']" in (out / "shard-1.log").read_text()
    assert "harness campaign: merged 2 shard report(s): 10 examples, 2 finding(s), 1 new" in output
    merged = json.loads((out / "merged" / "report.json").read_text())
    assert merged["examples"] == 10 and merged["shards"] == ["1/2", "2/2"]
    assert merged["coverage"][0]["examples"] == 10 and merged["coverage"][0]["new"] == 1
    assert all((out / "merged" / f["heatmap"]).is_file() for f in merged["findings"])


def test_without_xdist_an_error_exit_fails_its_item_and_the_others_still_merge(project):
    result = pytest_run(project, "--harness-campaign-shards", "3", "--harness-campaign-out", "elsewhere", BAD="3")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "campaign shard 3/3: exit 2 (an error" in output
    assert "error: --engines names nope, which is not an engine" in output
    assert "merged 2 shard report(s)" in output
    merged = json.loads((project / "elsewhere" / "merged" / "report.json").read_text())
    assert merged["shards"] == ["1/3", "2/3"]


def test_a_report_left_by_an_earlier_session_is_not_merged(project):
    stale = project / "out" / "campaign-shards" / "shard-1"
    stale.mkdir(parents=True)
    (stale / "report.json").write_text("{}")
    result = pytest_run(project, "--harness-campaign-shards", "2", BAD="1")
    output = result.stdout + result.stderr
    assert "merged 1 shard report(s)" in output, output
    assert not (stale / "report.json").exists()


def test_the_option_wants_a_positive_count(project):
    result = pytest_run(project, "--harness-campaign-shards", "-1")
    assert result.returncode == 4 and "1 or more" in result.stderr


@pytest.mark.slow
def test_a_tiny_real_campaign_in_two_shards(tmp_path):
    args = "--engines reference --formats fp8-block --archs llama --max-examples 2 --no-shrink"
    result = pytest_run(
        tmp_path,
        "-p",
        "xdist",
        "-n",
        "2",
        "--harness-campaign-shards",
        "2",
        "--harness-campaign-args",
        args,
        "--harness-campaign-out",
        str(tmp_path / "shards"),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for index in (1, 2):
        assert (tmp_path / "shards" / f"shard-{index}" / "report.json").is_file(), output
    merged = json.loads((tmp_path / "shards" / "merged" / "report.json").read_text())
    shards = [json.loads((tmp_path / "shards" / f"shard-{i}" / "report.json").read_text()) for i in (1, 2)]
    assert merged["examples"] == sum(s.get("examples", 0) for s in shards)
