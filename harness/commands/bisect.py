"""`bisect`: the argument parsing and report of harness.lanes.bisect over a package's releases."""

from __future__ import annotations

from pathlib import Path

from harness.core.errors import HarnessError
from harness.lanes.bisect import (
    BAD,
    DEFAULT_CACHE,
    EXIT_FOUND,
    EXIT_NOT_FOUND,
    GOOD,
    SKIP,
    CheckRun,
    EnvironmentBuilder,
    PipSource,
    bisect_versions,
    check_in_release,
    released_versions,
    versions_between,
)


def command_bisect(args) -> int:
    from harness.lanes.check import find_case, load_case

    load_case(args.case, args.engine)  # a bad case or engine is a usage error here, before any venv is built
    case_path = find_case(args.case).resolve()
    source = PipSource(args.index_url, args.extra_index_url or [], args.find_links or [])
    all_versions = released_versions(args.package, source, args.pre)
    if not all_versions:
        raise HarnessError(f"no released versions of {args.package} found ({' '.join(source.options()) or 'index'})")
    versions = versions_between(all_versions, args.good, args.bad, args.pre)
    cache = Path(args.cache).expanduser() if args.cache else DEFAULT_CACHE.expanduser()
    builder = EnvironmentBuilder(cache, args.package, source, args.with_requirement or [], args.rebuild)
    extra = ["--timeout", str(args.timeout), "--memory-mb", str(args.memory_mb)]
    print(
        f"bisect {args.package}: {len(versions)} version(s) from good {args.good} to bad {args.bad}: "
        f"{', '.join(versions)}"
    )
    print(f"case {case_path}, engine {args.engine or 'from the case'}, environments in {cache}")

    def test(version: str) -> CheckRun:
        python, how = builder.ensure(version)
        if python is None:
            run = CheckRun(version, SKIP, f"environment not built: {how}")
        else:
            run = check_in_release(python, str(case_path), args.engine, extra, version)
        label = {GOOD: "good", BAD: "bad", SKIP: "skip (cannot test)"}[run.code]
        last_line = run.output.strip().splitlines()[-1] if run.output.strip() else ""
        print(f"{args.package} {version}: {label} -- {last_line}", flush=True)
        return run

    result = bisect_versions(versions, test)
    print(result.message)
    for version in (result.last_good, result.first_bad):
        if version and version in result.runs:
            run = result.runs[version]
            label = "last good" if version == result.last_good else "first bad"
            print(f"\n--- {label}: {args.package} {version} (check exit {run.code}) ---\n{run.output}")
    if result.first_bad:
        print(f"\nfirst bad version of {args.package}: {result.first_bad} (last good: {result.last_good})")
        return EXIT_FOUND
    return EXIT_NOT_FOUND


def add_parser(commands) -> None:
    bisect = commands.add_parser(
        "bisect",
        help="find the first released version of a package in which a check goes bad",
        description="Exit 0 found, 1 not found or inconsistent (good is bad, bad is good, only untestable "
        "versions left), 2 usage error. Versions whose check exits 125 are skipped.",
    )
    bisect.add_argument("--case", required=True, help="case file or reproduction directory (as for `check`)")
    bisect.add_argument("--package", required=True, help="distribution to bisect, e.g. transformers")
    bisect.add_argument("--good", required=True, help="a version where the check is good")
    bisect.add_argument("--bad", required=True, help="a version where the check is bad")
    bisect.add_argument("--engine", help="engine to judge (default: the case's)")
    bisect.add_argument("--cache", help=f"where the per-version venvs live (default {DEFAULT_CACHE}/NAME-VERSION)")
    bisect.add_argument("--index-url", help="package index (default: pip's configuration)")
    bisect.add_argument("--extra-index-url", action="append", help="another index; repeatable")
    bisect.add_argument(
        "--find-links",
        action="append",
        help="directory (or URL) of wheels/sdists; repeatable. Without an index option, the only source",
    )
    bisect.add_argument("--pre", action="store_true", help="include pre-releases between good and bad")
    bisect.add_argument(
        "--with",
        dest="with_requirement",
        action="append",
        metavar="REQUIREMENT",
        help="another requirement each venv needs for the engine; repeatable",
    )
    bisect.add_argument("--rebuild", action="store_true", help="rebuild cached environments")
    bisect.add_argument("--timeout", type=float, default=600.0, help="seconds an engine may take per request")
    bisect.add_argument("--memory-mb", type=float, default=16000.0, help="resident memory limit per engine worker")
    bisect.set_defaults(run=command_bisect)
