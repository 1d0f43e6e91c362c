"""`audit DIR`: what is wrong with a checkpoint itself (harness.oracle.audit), as a table and, with
`--report OUT`, OUT/audit.json and OUT/audit.md; with `--engines`, then the differential judgement
as `compare` runs it, with the expectation it inferred and why.

Exit 0: no problem (and no new engine finding); 1: a problem or a new finding; 2: unusable input
or an engine that cannot run (one line, as every command)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness.commands.common import (
    EXIT_FINDING,
    EXIT_OK,
    checkpoint_json,
    parse_engines,
    parse_optional,
    print_outcomes,
    reproduce_command,
    start_engines,
)
from harness.core.errors import CheckpointError, HarnessError

if TYPE_CHECKING:
    from harness.oracle.audit import AuditResult

COLUMNS = ("check", "module", "tensor", "file", "reason")


def add_parser(commands) -> None:
    from harness.engines import ENGINES

    audit = commands.add_parser(
        "audit",
        help="report what is wrong with a checkpoint itself (scales, index, ignore list, config), before any engine",
        description="Audit a checkpoint on disk (any supported format, sharded or not): its index and shards, "
        "config fields engines misread, missing and orphan scales, the ignore list against the stored dtypes, "
        "scale grids, non-finite, zero or subnormal scales, NVFP4 global-scale conventions (docs/audit.md). "
        "Exit 0 clean, 1 problems found, 2 unusable input.",
    )
    audit.add_argument("directory", help="checkpoint directory (generated or not)")
    audit.add_argument("--report", metavar="OUT", help="write OUT/audit.json and OUT/audit.md here")
    audit.add_argument(
        "--engines",
        help=f"then judge these engines on it as compare does (comma-separated: {', '.join(ENGINES)}, or "
        "package.module:Class)",
    )
    audit.add_argument(
        "--optional-engines",
        help="engines (of --engines) that may be unavailable here; any other that cannot run is exit 2",
    )
    audit.set_defaults(run=command_audit)


def command_audit(args) -> int:
    from harness.oracle.audit import audit_checkpoint  # torch: not imported to build the parser

    engines = parse_engines(args.engines) if args.engines is not None else []
    if args.optional_engines and not engines:
        raise HarnessError("--optional-engines needs --engines")
    optional = parse_optional(args, engines) if engines else []
    directory = Path(args.directory)
    started = time.monotonic()
    result = audit_checkpoint(directory)
    seconds = time.monotonic() - started
    print_table(result)
    differential = judge(directory, result, engines, optional, args.report) if engines else None
    if args.report:
        path = write_audit_report(Path(args.report), result, seconds, differential)
        print(f"report: {path} and {path.with_suffix('.md')}")
    new = differential and differential.get("new", 0)
    return EXIT_FINDING if result.findings or new else EXIT_OK


def print_table(result: AuditResult) -> None:
    print(
        f"audit {result.directory} ({result.format}): {result.tensors} tensors in {result.files} file(s), "
        f"{result.bytes_read / 2**20:.1f} MiB read"
    )
    if not result.findings:
        print("  no problems found")
        return
    rows = [[getattr(f, c) or "-" for c in COLUMNS] for f in result.findings]
    rows = [[row[0], row[1], row[2].removeprefix(f"{row[1]}.") if row[1] != "-" else row[2], *row[3:]] for row in rows]
    widths = [max(len(r[i]) for r in [list(COLUMNS), *rows]) for i in range(len(COLUMNS) - 1)]
    for row in [list(COLUMNS), *rows]:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    print(f"{len(result.findings)} problem(s)")


def expectation_reason(directory: Path, expectation: str, result: AuditResult) -> str:
    """What a correct loader must do with this checkpoint, and why, as the differential judged it."""
    from harness.checkpoints.writer import MANIFEST_FILE

    if (directory / MANIFEST_FILE).is_file():
        return f"{expectation}: from {MANIFEST_FILE} (the harness wrote this checkpoint)"
    if expectation == "refuse":
        why = result.refusals[0] if result.refusals else "the reference dequantizer refuses it"
        return f"refuse: the reference refuses {why}"
    return f"{expectation}: the reference dequantizes every module (no manifest: its values are the truth)"


def judge(directory: Path, result: AuditResult, engines: list[str], optional: list[str], report: str | None) -> dict:
    """`compare`'s differential judgement after the audit; the report's `differential` section."""
    from harness.differential.known_issues import KnownIssues
    from harness.differential.report import write_report
    from harness.differential.runner import EngineSession, evaluate
    from harness.engines.process import Limits

    with tempfile.TemporaryDirectory(prefix="harness-") as scratch:
        work = Path(report) if report else Path(scratch)
        session = EngineSession(engines, work / "work", Limits())
        try:
            start_engines(session, engines, optional)
            judged = evaluate(directory, session, KnownIssues.load())
        except CheckpointError as error:
            if not result.findings:
                raise
            print(f"engines not run: the harness's reader refuses the checkpoint ({error})")
            return {"skipped": f"the harness's reader refuses the checkpoint: {error}", "new": 0}
        finally:
            session.close()
    for item in judged.findings:
        item.reproduction = str(directory.resolve())
        item.command = reproduce_command(directory.resolve(), item.engine)
    reason = expectation_reason(directory, judged.expectation, result)
    print(f"expectation {reason}")
    print_outcomes(judged)
    engines_info = {
        e: {"version": session.versions.get(e, ""), "status": session.unavailable.get(e, "ran")} for e in engines
    }
    if report:
        write_report(Path(report), judged.findings, [checkpoint_json(judged)], engines_info, f"audit {directory}")
    return {
        "expectation": judged.expectation,
        "why": reason,
        "engines": engines_info,
        "checkpoint": checkpoint_json(judged),
        "findings": [f.to_json() for f in judged.findings],
        "new": sum(1 for f in judged.findings if not f.known_issue),
    }


def write_audit_report(out: Path, result: AuditResult, seconds: float, differential: dict | None) -> Path:
    from harness.oracle.audit import CHECKS

    try:
        out.mkdir(parents=True, exist_ok=True)
        payload = {"title": f"audit {result.directory}", **result.to_json(), "seconds": round(seconds, 3)}
        payload["checks"] = CHECKS
        if differential is not None:
            payload["differential"] = differential
        path = out / "audit.json"
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        path.with_suffix(".md").write_text(render_markdown(result, differential))
    except OSError as error:
        raise HarnessError(f"{out}: cannot write the report ({error.strerror or error})") from None
    return path


def cell(text: str) -> str:
    return (text or "-").replace("|", "\\|").replace("\n", " ")


def render_markdown(result: AuditResult, differential: dict | None) -> str:
    from harness.oracle.audit import CHECKS

    lines = [
        f"# audit {result.directory}",
        "",
        f"Format {result.format}; {result.tensors} tensors in {result.files} file(s), "
        f"{result.bytes_read / 2**20:.1f} MiB read; **{len(result.findings)} problem(s)**.",
        "",
    ]
    if result.findings:
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cell(getattr(f, c)) for c in COLUMNS) + " |" for f in result.findings]
        lines += ["", "## Checks", ""]
        lines += [
            f"- `{name}`: {what}" for name, what in CHECKS.items() if any(f.check == name for f in result.findings)
        ]
    if differential is not None:
        lines += ["", "## Engines", ""]
        if "skipped" in differential:
            lines.append(f"Not run: {differential['skipped']}.")
        else:
            lines += [f"Expectation {differential['why']}.", "", "| engine | status | detail |", "|---|---|---|"]
            for engine, outcome in differential["checkpoint"]["outcomes"].items():
                lines.append(f"| {cell(engine)} | {outcome['status']} | {cell(outcome['detail'])} |")
            lines.append("")
            for item in differential["findings"]:
                tag = f"known issue {item['known_issue']}" if item["known_issue"] else "NEW"
                lines.append(f"- [{tag}] {item['engine']} {item['kind']}: {cell(item['message'])}")
            lines += ["", "Full differential report: report.md"]
    return "\n".join(lines) + "\n"
