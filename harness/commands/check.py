"""`check`: the argument parsing and exit codes of harness.lanes.check (git bisect run's 0 / 1 / 125)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from harness.core.errors import HarnessError
from harness.lanes.check import (
    EXIT_BAD,
    EXIT_CANNOT_TEST,
    EXIT_GOOD,
    CannotTest,
    check_in_process,
    load_case,
)


def command_check(args) -> int:
    """Never raises: every problem that is not a verdict is one line on stderr and exit 125."""
    try:
        case = load_case(args.case, args.engine)
        if args.work:
            work = Path(args.work)
            if work.exists() and (not work.is_dir() or any(work.iterdir())):
                raise CannotTest(f"{work}: --work directory exists and is not empty")
            work.mkdir(parents=True, exist_ok=True)
            verdict = check_in_process(case, work, args.timeout, args.memory_mb)
        else:
            with tempfile.TemporaryDirectory(prefix="harness-check-") as scratch:
                verdict = check_in_process(case, Path(scratch), args.timeout, args.memory_mb)
    except KeyboardInterrupt:
        print("check: cannot test: interrupted", file=sys.stderr)
        return EXIT_CANNOT_TEST
    except (HarnessError, OSError) as error:
        print(f"check: cannot test: {error}", file=sys.stderr)
        return EXIT_CANNOT_TEST
    except Exception as error:  # a bug in the harness: skip the version, say so in one line
        if os.environ.get("HARNESS_DEBUG"):
            raise
        print(
            f"check: cannot test: internal error: {type(error).__name__}: {error} "
            "(set HARNESS_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return EXIT_CANNOT_TEST
    label = {EXIT_GOOD: "good", EXIT_BAD: "bad", EXIT_CANNOT_TEST: "cannot test"}[verdict.code]
    print(f"verdict: {label} (exit {verdict.code}): {verdict.reason}")
    sys.stdout.flush()
    return verdict.code


def add_parser(commands) -> None:
    """The `check` subcommand; its usage errors exit 125 too (a bisect must skip, not mark bad)."""
    check = commands.add_parser(
        "check",
        help="is the bug a case pins present in an engine? exit 0 good, 1 bad, 125 cannot test",
        description="Exit 0 good (the engine agrees / the case's finding is absent), 1 bad, 125 cannot test "
        "(engine unavailable or unsupported, environment broken, case unreadable, any user error).",
    )
    check.add_argument(
        "case",
        help="a case file (path, or a name in cases/checks/), a reproduction directory, or a known issue's id "
        "(its reproducer: bad = its finding shows)",
    )
    check.add_argument(
        "--engine", help="engine to judge (default: the case's `engine`); a name or package.module:Class"
    )
    check.add_argument("--work", help="keep the generated checkpoint and engine logs here (created; must be empty)")
    check.add_argument("--timeout", type=float, default=600.0, help="seconds an engine may take per request")
    check.add_argument("--memory-mb", type=float, default=16000.0, help="resident memory limit per engine worker")
    check.set_defaults(run=command_check)

    def error(message):
        check.exit(EXIT_CANNOT_TEST, f"{check.prog}: error: {message} (see --help)\n")

    def parse_known_args(args=None, namespace=None):  # leftovers too: the top-level parser would exit 2
        parsed, extras = parse_all(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    parse_all = check.parse_known_args
    check.error = error
    check.parse_known_args = parse_known_args
