"""`run`: the campaign's arguments, its terminal summary and its report (harness.campaign.explore)."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

from harness.commands.common import (
    EXIT_FINDING,
    EXIT_OK,
    checkpoint_json,
    parse_engines,
    parse_optional,
    reproduce_command,
    start_engines,
)
from harness.core.errors import HarnessError
from harness.engines.options import (
    CAMPAIGN_OPTIONS_EVERY,
    CAMPAIGN_VARIANTS,
    FORMAT_VARIANTS,
    FORMAT_VARIANTS_EVERY,
    base_engine,
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '1.5h' -> seconds."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise HarnessError(f"--budget expects a duration such as 90s, 10m or 1h, got '{text}'")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2) or "s"]


def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(n.strip() for n in text.split(",") if n.strip()) if text else None


def plan_cells(args):
    """(coverage, every cell of the selection, this shard's cells)."""
    from harness.campaign.cells import Coverage, parse_shard, shard_cells
    from harness.checkpoints.architectures import ARCHITECTURES
    from harness.formats import require_formats

    formats, archs = _names(args.formats), _names(args.archs)
    if formats:
        require_formats(*formats)
    for name in archs or ():
        if name not in ARCHITECTURES:
            raise HarnessError(f"unknown architecture '{name}' (known: {', '.join(ARCHITECTURES)})")
    coverage = Coverage.load()
    cells = coverage.cells(formats, archs, _names(args.families))
    if not cells:
        raise HarnessError("no cell matches --formats / --archs / --families")
    mine = shard_cells(cells, *parse_shard(args.shard)) if args.shard else cells
    return coverage, cells, mine


def drawn_options(engines: list[str], every: int) -> str:
    """What the campaign's header says of the engine variants it draws ('' where none)."""
    variants = [v for v in CAMPAIGN_VARIANTS if base_engine(v) in engines and v not in engines]
    by_format = [
        f"{v} ({fmt}: 1 example in {FORMAT_VARIANTS_EVERY})"
        for fmt, drawn in FORMAT_VARIANTS.items()
        for v in drawn
        if base_engine(v) in engines and v not in engines
    ]
    if not every:
        return ""
    return (f"; engine options {', '.join(variants)}, one on 1 example in {every}" if variants else "") + (
        f"; {', '.join(by_format)}" if by_format else ""
    )


def command_run(args) -> int:
    import hypothesis

    from harness.campaign.explore import Budget, run_campaign
    from harness.campaign.profiles import load_profile
    from harness.differential.known_issues import KnownIssues
    from harness.differential.relations import RELATIONS, parse_relations
    from harness.differential.runner import EngineSession
    from harness.engines.process import Limits

    engines = parse_engines(args.engines)
    optional = parse_optional(args, engines)
    relations = parse_relations(args.relations)
    # a relation of other engines (tensor-parallel: vLLM's) would take its turns for nothing
    relations = tuple(r for r in relations if RELATIONS[r].engines is None or set(RELATIONS[r].engines) & set(engines))
    if args.relations_every < 1:
        raise HarnessError(f"--relations-every expects a whole number of examples >= 1, got {args.relations_every}")
    if args.options_every < 0:
        raise HarnessError(f"--options-every expects a whole number of examples >= 0, got {args.options_every}")
    seconds = parse_duration(args.budget) if args.budget else None
    coverage, cells, mine = plan_cells(args)
    load_profile(args.profile)
    max_examples = args.max_examples or (None if seconds else hypothesis.settings.default.max_examples)
    known = KnownIssues.load()
    bounds = [f"{args.budget} budget"] if seconds else []
    bounds += [f"up to {max_examples} examples"] if max_examples else []
    shard = f" (shard {args.shard}: {len(mine)} of {len(cells)} cells)" if args.shard else ""
    print(
        f"campaign: {len(mine)} cells (format x arch x dtype x family){shard}, engines {', '.join(engines)}, "
        f"profile {args.profile}, {' or '.join(bounds)}"
        + ("" if args.shrink else ", no shrinking")
        + (f"; relations {', '.join(relations)}, one on 1 example in {args.relations_every}" if relations else "")
        + drawn_options(engines, args.options_every)
    )
    with tempfile.TemporaryDirectory(prefix="harness-run-") as scratch:
        report = Path(args.report).resolve() if args.report else None
        work = (report / "work") if report else Path(scratch)
        session = EngineSession(engines, work, Limits(args.timeout, args.memory_mb))
        bar = None
        try:
            start_engines(session, engines, optional)
            budget = Budget(max_examples, seconds)  # from now: starting the engines is not the campaign's time
            exploring = Budget(max_examples, exploration_seconds(seconds, args.confirm_known), budget.started)
            bar = _progress_bar(exploring, len(mine))
            campaign = run_campaign(
                mine,
                coverage,
                exploring,
                work,
                session,
                known,
                args.shrink,
                bar,
                relations,
                args.relations_every,
                args.options_every,
            )
            if args.confirm_known:
                campaign.replayed = confirm_known(args, known, session, engines, campaign, budget, work)
        finally:
            session.close()
            if bar:
                bar.close()
        findings = summarise(campaign, session, engines + sorted(campaign.options_drawn), known, report)
        if campaign.options_drawn:
            drawn = ", ".join(f"{v} on {n} example(s)" for v, n in sorted(campaign.options_drawn.items()))
            print(f"engine options drawn: {drawn}")
        spent = session.time_spent()
        print(where_the_time_went(spent, budget.elapsed()))
        if report:
            write_campaign_report(report, campaign, findings, session, engines, args, spent)
    new, gone = campaign.new_signatures(), gone_issues(campaign.replayed)
    print(
        f"{campaign.examples} examples ({campaign.shrink_examples} while shrinking) in "
        f"{budget.elapsed():.0f} s, stopped at: {campaign.stopped}; {len(campaign.counts)} finding signature(s), "
        f"{new} new" + (f"; {len(gone)} known issue(s) gone" if gone else "")
    )
    return EXIT_FINDING if new or gone else EXIT_OK


#: the share of a time budget `--confirm-known` keeps from exploration for its replays (session 37's main
#: job: the 19 of 122 known issues its exploration left replayed in 14 s of its 600, AMD AVX-512 kind)
CONFIRM_RESERVE = 0.05


def exploration_seconds(seconds: float | None, confirm_known: bool) -> float | None:
    return seconds * (1 - CONFIRM_RESERVE) if seconds and confirm_known else seconds


def confirm_known(args, known, session, engines: list[str], campaign, budget, work: Path) -> dict[str, str]:
    """`--confirm-known`: after exploring, replay the reproducer of each known issue of the run's
    engines, formats and architectures (this shard's share) that exploration did not rediscover,
    until the whole budget is spent: id -> status."""
    from harness.campaign.cells import parse_shard
    from harness.campaign.replay import issues_to_replay, replay_known_issues

    shard = parse_shard(args.shard) if args.shard else (1, 1)
    found = campaign.known_issue_ids()
    formats, archs = {c.format for c in campaign.cells}, {c.arch for c in campaign.cells}
    selection = issues_to_replay(known, engines, formats, archs, shard)
    issues = [issue for issue in selection if issue.id not in found]
    started = budget.elapsed()
    statuses = replay_known_issues(issues, session, work / "confirm-known", lambda: budget.spent(0))
    print(f"confirm-known: {len(issues)} reproducer(s) replayed in {budget.elapsed() - started:.0f} s", flush=True)
    campaign.replay_selection = len(selection)
    return statuses


def gone_issues(replayed: dict[str, str]) -> list[str]:
    return [issue for issue, status in replayed.items() if status == "gone"]


def replay_summary(replayed: dict[str, str], selection: int) -> list[str]:
    """The lines `run --confirm-known` prints: how many of the `selection`'s known issues exploration
    rediscovered and how many of the others reproduced, and each one gone or skipped."""
    reproduced = sum(1 for status in replayed.values() if status == "reproduced")
    lines = [
        f"known issues not rediscovered, replayed from their reproducers: {reproduced}/{len(replayed)} reproduced; "
        f"known issues of these engines, formats and architectures accounted for: "
        f"{selection - len(replayed) + reproduced}/{selection} ({selection - len(replayed)} rediscovered by "
        f"exploration, {reproduced} reproduced by replay)"
    ]
    for issue in gone_issues(replayed):
        lines.append(
            f"    GONE {issue}: its reproducer no longer shows it (upstream fixed it? narrow its `versions` "
            "in cases/known_issues.toml)"
        )
    lines += [f"    {issue}: {status}" for issue, status in replayed.items() if status.startswith("skipped")]
    return lines


def where_the_time_went(spent: dict[str, dict[str, float]], elapsed: float) -> str:
    """One line: the seconds waited on each worker (its three costliest ops), and the rest: the
    harness's own generation, oracle and judging (workers are called one at a time, so they add up;
    a worker's start before the budget began is included)."""
    parts = []
    for key, ops in sorted(spent.items(), key=lambda item: -sum(item[1].values())):
        top = sorted(ops.items(), key=lambda item: -item[1])[:3]
        parts.append(f"{key} {sum(ops.values()):.0f} s ({', '.join(f'{op} {s:.0f}' for op, s in top)})")
    waited = sum(sum(ops.values()) for ops in spent.values())
    return (
        f"time: {'; '.join(parts) or 'no worker'}; harness (generate, oracle, judge) {max(elapsed - waited, 0):.0f} s"
    )


def _progress_bar(budget, cells: int):
    try:
        from harness.campaign.progress import ProgressBar
    except ImportError:  # tqdm absent: the summary at the end still says everything
        return None
    return ProgressBar(budget, cells)


def applicable_issues(known, session, engines: list[str], cells=()) -> list:
    """The known issues of the engines that ran, at the versions they ran, on a format and an
    architecture of the `cells` explored (harness.campaign.replay.in_selection); one whose reproducer
    loads its engine with options (a model dtype) only where a drawn variant ran with them."""
    from harness.campaign.replay import in_selection

    formats, archs = {c.format for c in cells}, {c.arch for c in cells}
    return [
        issue
        for issue in known.issues
        if in_selection(issue, engines, formats, archs)
        and issue.engine_name in session.versions
        and issue.applies_to(issue.engine, session.versions[issue.engine_name])
    ]


def repro_directory(report: Path, signature: tuple) -> Path:
    from harness.differential.report import slug

    digest = hashlib.sha256(repr(signature).encode()).hexdigest()[:8]
    return report / "repro" / f"{slug('-'.join(signature[:3]))}-{digest}"


def summarise(campaign, session, engines: list[str], known, report: Path | None) -> list:
    """Print what ran, each finding signature, the known issues rediscovered and the coverage;
    keep a reproduction of every signature under `report`; return the findings to report."""
    from harness.checkpoints.writer import generate

    for engine, why in session.unavailable.items():
        print(f"engine {engine} skipped (optional): {why}")
    for engine in engines:
        statuses = [r.outcomes[engine].status for r in campaign.results if engine in r.outcomes]
        if engine not in session.unavailable and "loaded" not in statuses:
            counts = ", ".join(f"{statuses.count(s)} {s}" for s in sorted(set(statuses))) or "no example"
            print(f"engine {engine} ran on nothing: {counts}")
    findings = []
    print(f"\n{'engine':<20} {'kind':<18} {'format':<16} {'seen':>5}  status")
    for signature, count in sorted(campaign.counts.items(), key=str):
        engine, kind, fmt, cause = signature
        minimal = signature in campaign.minimal
        recipe, items = campaign.minimal[signature] if minimal else campaign.known[signature]
        status = f"NEW: {cause}" if minimal else cause
        print(f"{engine:<20} {kind:<18} {fmt:<16} {count:>5}  {status}")
        if report:  # every finding, known or new, keeps a checkpoint that reproduces it
            destination = repro_directory(report, signature)
            if not destination.exists():
                generate(recipe, destination)
            for item in items:
                item.reproduction = str(destination)
                item.command = reproduce_command(destination, engine, item.metrics.get("relation"))
            if minimal:
                print(f"    reproduce: {items[0].command}")
        findings.extend(items)
    issues = applicable_issues(known, session, engines, campaign.cells)
    found = campaign.known_issue_ids()
    missed = [i.id for i in issues if i.id not in found]
    print(
        f"known issues rediscovered from scratch: {len(issues) - len(missed)}/{len(issues)} of the engines that ran"
        + (f" (not this time: {', '.join(missed)})" if missed else "")
    )
    if campaign.replay_selection:
        print("\n".join(replay_summary(campaign.replayed, campaign.replay_selection)))
    never = [c.name for c in campaign.cells if not campaign.coverage.get(c.name)]
    print(
        f"cells reached: {campaign.cells_reached()}/{len(campaign.cells)}" + (f" ({len(never)} never)" if never else "")
    )
    return findings


def write_campaign_report(
    report: Path, campaign, findings: list, session, engines: list[str], args, spent: dict | None = None
) -> None:
    from harness.differential.report import write_report

    engines_info = {
        e: {"version": session.versions.get(e, ""), "status": session.unavailable.get(e, "ran")} for e in engines
    }
    extra = {
        "examples": campaign.examples,
        "shrink_examples": campaign.shrink_examples,
        "stopped": campaign.stopped,
        "shard": args.shard or "1/1",
        "budget": args.budget or "",
        "relations_every": args.relations_every,
        "options_every": args.options_every,
        "engine_options_drawn": dict(sorted(campaign.options_drawn.items())),
        "counts": [{"signature": list(s), "seen": n, "new": s in campaign.minimal} for s, n in campaign.counts.items()],
        "known_issues_rediscovered": sorted(campaign.known_issue_ids()),
        "known_issues_replayed": dict(sorted(campaign.replayed.items())),
        "seconds_per_worker_op": {k: {op: round(s, 3) for op, s in ops.items()} for k, ops in (spent or {}).items()},
    }
    path = write_report(
        report,
        findings,
        [checkpoint_json(r) for r in campaign.results[-50:]],
        engines_info,
        f"run: {campaign.examples} examples over {campaign.cells_reached()}/{len(campaign.cells)} cells",
        coverage=campaign.coverage_rows(),
        extra=extra,
    )
    print(f"report: {path} and {path.with_suffix('.md')}")


def add_parser(commands) -> None:
    from harness.differential.relations import CAMPAIGN_DEFAULT, CAMPAIGN_EVERY, RELATION_NAMES
    from harness.engines import ENGINES

    run = commands.add_parser(
        "run",
        help="property-based campaign over cells (format x arch x dtype x family): generate, load, judge, "
        "shrink each new finding, keep exploring until the budget is spent",
    )
    run.add_argument("--engines", default="reference,transformers", help=f"{', '.join(ENGINES)}, or module:Class")
    run.add_argument("--formats", help="comma-separated formats (default: all)")
    run.add_argument("--archs", help="comma-separated architectures (default: all)")
    run.add_argument("--families", help="comma-separated families of cases/coverage.toml (default: all)")
    run.add_argument("--profile", default="ci", choices=["dev", "ci", "nightly"])
    run.add_argument("--budget", help="time budget (90s, 10m, 1h); without it, the profile's example count")
    run.add_argument("--max-examples", type=int, default=0, help="evaluated examples at most (default: the profile's)")
    run.add_argument("--shard", help="I/N: explore only shard I (1-based) of N; merge with merge-reports")
    run.add_argument("--report", help="write OUTDIR/report.json, report.md and repro/ here")
    run.add_argument("--no-shrink", dest="shrink", action="store_false", help="skip shrinking new findings")
    run.add_argument(
        "--confirm-known",
        action="store_true",
        help="after exploring (for 95%% of a time budget), replay the reproducer of each known issue of these "
        "engines, formats and architectures that exploration did not rediscover: reproduced, skipped with why, "
        "or gone (exit 1: upstream fixed it?)",
    )
    run.add_argument(
        "--relations",
        default=",".join(CAMPAIGN_DEFAULT),
        help=f"load paths that must agree ({', '.join(RELATION_NAMES)}), checked one at a time on every "
        f"N-th example (--relations-every); all, none, or names (default: {', '.join(CAMPAIGN_DEFAULT)})",
    )
    run.add_argument(
        "--relations-every",
        type=int,
        default=CAMPAIGN_EVERY,
        metavar="N",
        help=f"check one relation on every N-th example (default: {CAMPAIGN_EVERY}; 1: on every example)",
    )
    run.add_argument(
        "--options-every",
        type=int,
        default=CAMPAIGN_OPTIONS_EVERY,
        metavar="N",
        help="also load one engine variant on every N-th example, in turn: "
        f"{', '.join(CAMPAIGN_VARIANTS)}, each where its plain engine runs "
        f"(default: {CAMPAIGN_OPTIONS_EVERY}; 0: never; docs/engines.md)",
    )
    run.add_argument(
        "--optional-engines",
        help="engines (of --engines) that may be unavailable here; any other that cannot run is exit 2",
    )
    run.add_argument("--timeout", type=float, default=600.0)
    run.add_argument("--memory-mb", type=float, default=16000.0)
    run.set_defaults(run=command_run)
