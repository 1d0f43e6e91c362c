"""`run --confirm-known`: after exploring, the campaign replays the reproducer of each known issue of
its engines, formats and architectures that exploration did not rediscover, and says which still
show, which were skipped and why, and which are gone (exit 1: upstream fixed it?). Replayed issues
are reported apart from the ones exploration rediscovers from scratch."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.campaign.replay import issues_to_replay, replay_known_issues
from harness.differential.known_issues import KnownIssues
from tests.cli import run_cli as cli

pytest.importorskip("transformers")


def test_confirm_known_replays_the_issues_exploration_did_not_rediscover(tmp_path):
    result = cli(
        "run", "--engines", "reference,transformers", "--formats", "fp8-block", "--archs", "llama",
        "--confirm-known", "--max-examples", "1", "--no-shrink", "--report", tmp_path / "r",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    selection = issues_to_replay(KnownIssues.load(), ["reference", "transformers"], ("fp8-block",), ("llama",))
    rediscovered, replayed = set(report["known_issues_rediscovered"]), report["known_issues_replayed"]
    # every issue of the selection is accounted for once: rediscovered by exploration, or replayed
    assert sorted(replayed) == sorted(i.id for i in selection if i.id not in rediscovered)
    assert len(replayed) >= 2 and not rediscovered & set(replayed)
    assert all(status == "reproduced" or status.startswith("skipped: ") for status in replayed.values()), replayed
    assert "reproduced" in replayed.values()
    reproduced = list(replayed.values()).count("reproduced")
    assert f"replayed from their reproducers: {reproduced}/{len(replayed)} reproduced" in result.stdout
    assert "## Known issues replayed from their reproducers" in (tmp_path / "r" / "report.md").read_text()
    # what exploration rediscovered, it showed on its own examples
    assert report["examples"] == 1 and rediscovered <= {
        c["signature"][3].removeprefix("known: ") for c in report["counts"]
    }


def test_a_known_issue_whose_reproducer_no_longer_shows_it_is_gone(engine_session, tmp_path):
    """An entry whose reproducer is a checkpoint the engine loads exactly (whole 128-blocks,
    transformers' FineGrainedFP8 reads it right) stands for an issue upstream has fixed."""
    issue = next(i for i in KnownIssues.load().issues if i.id == "transformers-fp8-block-grid-inferred-from-shape")
    clean = {
        "format": "fp8-block",
        "arch": "llama",
        "config": {"num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 64},
    }  # fmt: skip
    fixed = dataclasses.replace(issue, reproducer=clean)
    assert replay_known_issues([fixed], engine_session, tmp_path) == {issue.id: "gone"}
    assert replay_known_issues([issue], engine_session, tmp_path) == {issue.id: "reproduced"}


def test_merged_shards_exit_1_on_a_gone_known_issue(tmp_path):
    for shard, status in (("1/2", "reproduced"), ("2/2", "gone")):
        directory = tmp_path / shard.replace("/", "-")
        cli("run", "--engines", "reference", "--formats", "ct-fp8-tensor", "--max-examples", "1", "--report", directory)
        payload = json.loads((directory / "report.json").read_text())
        payload["shard"], payload["known_issues_replayed"] = shard, {f"issue-{shard[0]}": status}
        (directory / "report.json").write_text(json.dumps(payload))
    merged = cli("merge-reports", tmp_path / "m", tmp_path / "1-2", tmp_path / "2-2")
    assert merged.returncode == 1, merged.stdout + merged.stderr
    assert "GONE issue-2" in merged.stdout
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    assert report["known_issues_replayed"] == {"issue-1": "reproduced", "issue-2": "gone"}


def test_replay_stops_where_the_budget_is_spent(engine_session, tmp_path):
    issues = KnownIssues.load().issues[:2]
    statuses = replay_known_issues(issues, engine_session, tmp_path, spent=lambda: "time budget of 1 s")
    assert all(status == "skipped: not replayed (time budget of 1 s spent)" for status in statuses.values())


def test_an_issue_of_every_format_is_in_every_selection_of_its_architectures():
    """`formats = ["*"]` (and `archs`) mean every one, as the known issues' own matching reads them."""
    from harness.campaign.replay import in_selection

    issue = KnownIssues.load().by_id("transformers-moe-grouped-mm-odd-width-cpu")
    assert issue.formats == ["*"]
    assert in_selection(issue, ["transformers"], ("fp8-block",), ("mixtral",))
    assert not in_selection(issue, ["transformers"], ("fp8-block",), ("llama",))
    assert not in_selection(issue, ["vllm"], ("fp8-block",), ("mixtral",))
