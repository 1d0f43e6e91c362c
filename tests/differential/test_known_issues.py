"""Known upstream issues are strict: each entry's reproducer must still reproduce it on the
installed engine version, or this test fails and the entry must be narrowed or removed."""

from __future__ import annotations

import pytest

from harness.campaign.replay import reproduce_known_issue
from harness.differential.known_issues import KnownIssues

ISSUES = KnownIssues.load().issues


@pytest.mark.parametrize("issue", ISSUES, ids=[i.id for i in ISSUES])
def test_known_issue_still_reproduces(issue, engine_session, tmp_path):
    status, findings = reproduce_known_issue(issue, engine_session, tmp_path)
    if status.startswith("skipped"):
        pytest.skip(status)
    assert status == "reproduced", (
        f"known issue {issue.id} no longer reproduces with {issue.engine_name} "
        f"{engine_session.versions.get(issue.engine_name)}: upstream fixed it? Narrow `versions` in "
        f"cases/known_issues.toml or remove the entry."
    )
    assert all(f.known_issue == issue.id for f in findings)
