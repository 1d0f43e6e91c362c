"""`upstream`: write OUT/reproduce.py (standalone) and OUT/ISSUE.md for a known issue or a report's
finding, after running the script here. Exit 0: it reproduces (the script exits 1), or --no-run;
1: it does not (the script exits 0: fixed in this version?); 2: a usage error, or the script cannot
run here (the files are written all the same)."""

from __future__ import annotations

from pathlib import Path

from harness.core.errors import HarnessError

EXIT_REPRODUCES, EXIT_DOES_NOT, EXIT_ERROR = 0, 1, 2


def command_upstream(args) -> int:
    from harness.lanes.upstream import ISSUE_FILE, SCRIPT_FILE, from_finding, from_known_issue, write_reproducer

    if bool(args.issue) == bool(args.report):
        raise HarnessError("upstream needs a known issue id, or --report REPORT.json with --finding N (not both)")
    if args.report and args.finding is None:
        raise HarnessError("--report needs --finding N (1-based, as report.md numbers them)")
    if args.finding is not None and not args.report:
        raise HarnessError("--finding needs --report REPORT.json")
    reproducer = from_finding(Path(args.report), args.finding) if args.report else from_known_issue(args.issue)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise HarnessError(f"{out}: exists and is not a directory")
    run = write_reproducer(reproducer, out, run=not args.no_run, timeout=args.timeout)
    print(f"wrote {out / SCRIPT_FILE} and {out / ISSUE_FILE} ({reproducer.id}, {reproducer.engine})")
    if run.code is None:
        print(f"not run here: {run.why}")
        return EXIT_REPRODUCES if args.no_run else EXIT_ERROR  # --no-run: written, nothing judged
    print(run.result)
    print(f"ran it with {run.python}: exit {run.code}")
    if run.code == 1:
        return EXIT_REPRODUCES
    if run.code == 0:
        print("it does not reproduce here: the bug looks fixed in this version (see ISSUE.md)")
        return EXIT_DOES_NOT
    return EXIT_ERROR


def add_parser(commands) -> None:
    upstream = commands.add_parser(
        "upstream",
        help="write a standalone reproduce.py and ISSUE.md for a known issue or a report's finding",
        description="Writes OUT/reproduce.py (one file: torch, safetensors and the engine's own package; exit 1 "
        "while the bug is present, 0 once fixed, 2 when it cannot run) and OUT/ISSUE.md, after running the "
        "script here with the engine's interpreter. Exit 0: it reproduces; 1: it does not; 2: error.",
    )
    upstream.add_argument("issue", nargs="?", help="an id in cases/known_issues.toml")
    upstream.add_argument("--report", help="a report.json (with --finding N instead of an issue id)")
    upstream.add_argument("--finding", type=int, help="the finding's number in the report (1-based)")
    upstream.add_argument(
        "--out", required=True, help="output directory (created; its reproduce.py and ISSUE.md are replaced)"
    )
    upstream.add_argument("--no-run", action="store_true", help="write the files without running the script")
    upstream.add_argument("--timeout", type=float, default=600.0, help="seconds the script may run")
    upstream.set_defaults(run=command_upstream)
