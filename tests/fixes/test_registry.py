"""Every fix module declares itself completely, `fixes` lists them, and reports name the fix
that repairs a finding."""

from __future__ import annotations

import json
import subprocess
import sys

from packaging.specifiers import SpecifierSet

from harness.core.findings import KINDS, Finding
from harness.differential.known_issues import KnownIssues
from harness.differential.report import write_report
from harness.engines import REGISTRY
from harness.fixes import all_fixes, fix_for_finding, get_fix
from harness.formats import FORMAT_NAMES

SEEDS = {"000-vllm-fp8-bias-materialize", "002-nvfp4-activation-global-scale", "003-unsloth-restore-dropped-fp8-scales"}


def test_every_fix_is_declared_completely():
    known = {issue.id for issue in KnownIssues.load().issues}
    fixes = all_fixes()
    assert {f.report for f in fixes if f.report} >= SEEDS, "one fix module per seed bug"
    assert len({f.name for f in fixes}) == len(fixes)
    for fix in fixes:
        assert fix.repairs and fix.detection and callable(fix.apply), fix.name
        assert set(fix.engines) <= set(REGISTRY), fix.name
        SpecifierSet(fix.versions)  # a valid PEP 440 range
        assert set(fix.formats) <= {*FORMAT_NAMES, "*", "bf16"}, fix.name
        assert set(fix.known_issues) <= known, f"{fix.name} names unknown known issues"
        assert set(fix.kinds) <= set(KINDS), fix.name


def test_findings_map_to_their_fix():
    for fix in all_fixes():
        for issue in fix.known_issues:
            finding = Finding(
                engine=fix.engines[0],
                engine_version="9",
                kind="weight-mismatch",
                format=fix.formats[0],
                message="m",
                known_issue=issue,
            )
            assert fix_for_finding(finding) is get_fix(fix.name)
    unrelated = Finding(engine="reference", engine_version="0", kind="engine-crash", format="fp8-block", message="m")
    assert fix_for_finding(unrelated) is None


def test_report_names_the_fix(tmp_path):
    fix = next(f for f in all_fixes() if f.known_issues)
    finding = Finding(
        engine=fix.engines[0],
        engine_version="9",
        kind="weight-mismatch",
        format=fix.formats[0],
        message="m",
        known_issue=fix.known_issues[0],
    )
    path = write_report(tmp_path, [finding], [], {}, "t")
    assert json.loads(path.read_text())["findings"][0]["fix"] == fix.name
    assert f"fix `{fix.name}`" in (tmp_path / "report.md").read_text()


def test_fixes_command_lists_every_fix():
    out = subprocess.run([sys.executable, "-m", "harness", "fixes"], capture_output=True, text=True, check=True).stdout
    for fix in all_fixes():
        assert f"{fix.name}: " in out
    assert f"{len(all_fixes())} fix module(s)" in out
