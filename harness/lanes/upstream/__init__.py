"""`upstream`: hand upstream a reproducer it can run. For a known issue (or a report's finding), one
standalone reproduce.py (torch, safetensors and the engine's own package only: it builds the
checkpoint, loads it with the engine's public API, compares with the format's definition; exit 1
while the bug is present, 0 once fixed, 2 when it cannot run) and an ISSUE.md around its output."""

from harness.lanes.upstream.issue import ISSUE_FILE, SCRIPT_FILE, Run, run_script, write_reproducer
from harness.lanes.upstream.script import Script, render_script
from harness.lanes.upstream.source import Reproducer, from_finding, from_issue, from_known_issue

__all__ = [
    "ISSUE_FILE",
    "SCRIPT_FILE",
    "Reproducer",
    "Run",
    "Script",
    "from_finding",
    "from_issue",
    "from_known_issue",
    "render_script",
    "run_script",
    "write_reproducer",
]
