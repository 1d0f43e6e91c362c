"""Reports: OUTDIR/report.json (machine-readable, top-level `findings`) and OUTDIR/report.md
(human: a summary, the engines, the coverage of the campaign's cells, the checkpoints, and each
finding with its reproduction command and block heatmap)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.core.findings import KINDS, Finding
from harness.differential.heatmap import EXTRA_MISSING, LEGEND, HeatmapsUnavailable, write_heatmap

#: per engine and coverage cell: how its examples ended (a row's `engines` holds these counts)
ENGINE_STATUSES = ("loaded", "refused", "unsupported", "failed", "unavailable")
#: what write_report itself writes at the top level of report.json; `extra` may not replace them
OWN_KEYS = ("title", "summary", "notes", "engines", "coverage", "checkpoints", "findings")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80]


def repairing_fix(finding: Finding) -> str | None:
    """The name of the fix module that repairs this finding after load, if one does."""
    from harness.fixes import fix_for_finding

    fix = fix_for_finding(finding)
    return fix.name if fix else None


def draw_heatmaps(out: Path, findings: list[Finding]) -> list[str]:
    """One PNG per finding that carries a per-block grid (the grid leaves the finding: report.json
    keeps the picture's path, not the grid); the notes say what could not be drawn."""
    undrawn = 0
    for index, item in enumerate(findings):
        grid = item.metrics.pop("block_ratio", None)
        if not grid:
            continue
        if undrawn:
            undrawn += 1
            continue
        name = f"heatmaps/{index:03d}-{slug(item.engine)}-{slug(item.module or item.kind)}.png"
        try:
            write_heatmap(
                grid,
                out / name,
                engine=item.engine,
                module=item.module,
                shape=item.metrics.get("shape"),
                block=item.metrics.get("block"),
            )
        except HeatmapsUnavailable:
            undrawn += 1
            continue
        item.heatmap = name
    return [EXTRA_MISSING.format(count=undrawn)] if undrawn else []


def write_report(
    out: Path,
    findings: list[Finding],
    checkpoints: list[dict],
    engines: dict,
    title: str,
    *,
    coverage: list[dict] | None = None,
    extra: dict | None = None,
) -> Path:
    """`coverage`: one row per campaign cell (see `render_coverage`); `extra`: more top-level keys
    of report.json (`examples`, `shard`, `budget`, `counts`, `notes`, ...)."""
    extra = dict(extra or {})
    clash = sorted(set(extra) & (set(OWN_KEYS) - {"notes"}))
    if clash:
        raise ValueError(f"write_report: extra may not replace {', '.join(clash)}")
    out.mkdir(parents=True, exist_ok=True)
    notes = [*extra.pop("notes", []), *draw_heatmaps(out, findings)]
    summary = {
        "findings": len(findings),
        "new": sum(1 for f in findings if not f.known_issue),
        "known": sum(1 for f in findings if f.known_issue),
        "signatures": len({f.signature() for f in findings}),
    }
    if "examples" in extra:
        summary["examples"] = extra["examples"]
    if coverage is not None:
        summary["cells_planned"] = len(coverage)
        summary["cells_reached"] = sum(1 for row in coverage if row.get("examples", 0) > 0)
    payload = {"title": title, "summary": summary, **extra, "notes": notes, "engines": engines}
    if coverage is not None:
        payload["coverage"] = coverage
    payload["checkpoints"] = checkpoints
    payload["findings"] = [{**f.to_json(), "fix": repairing_fix(f)} for f in findings]
    (out / "report.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(payload))
    return out / "report.json"


def summary_line(payload: dict) -> str:
    """The counts report.json holds: its `examples` and its `findings` list, as they are there."""
    summary = payload["summary"]
    examples = payload.get("examples")
    head = f"{examples} example(s), " if examples is not None else ""
    return (
        f"{head}{summary['findings']} finding(s) in {summary.get('signatures', 0)} signature(s): "
        f"{summary['new']} new, {summary['known']} known upstream issue(s)."
    )


def render_markdown(payload: dict) -> str:
    lines = [f"# {payload['title']}", "", summary_line(payload)]
    if payload.get("notes"):
        lines += ["", *(f"- note: {note}" for note in payload["notes"])]
    lines += ["", "## Engines", "", "| engine | version | python |", "|---|---|---|"]
    for name, info in payload["engines"].items():
        lines.append(f"| {name} | {info.get('version', '')} | {info.get('python', info.get('status', ''))} |")
    if payload.get("coverage") is not None:
        lines += ["", *render_coverage(payload["coverage"], list(payload["engines"]))]
    if payload.get("known_issues_replayed"):
        lines += ["", "## Known issues replayed from their reproducers", "", "| known issue | status |", "|---|---|"]
        lines += [f"| {issue} | {status} |" for issue, status in payload["known_issues_replayed"].items()]
    lines += render_checkpoints(payload)
    if payload["findings"]:
        lines += ["", "## Findings", ""]
    for index, item in enumerate(payload["findings"]):
        lines += render_finding(index, item)
    return "\n".join(lines) + "\n"


def render_checkpoints(payload: dict) -> list[str]:
    engines = list(payload["engines"])
    lines = [
        "",
        "## Checkpoints",
        "",
        "| checkpoint | format | expectation | " + " | ".join(engines) + " |",
        "|---|---|---|" + "---|" * len(engines),
    ]
    for checkpoint in payload["checkpoints"]:
        cells = []
        for engine in engines:
            outcome = checkpoint["outcomes"].get(engine, {})
            text = outcome.get("status", "")
            if outcome.get("perplexity") is not None:
                text += f" (ppl {outcome['perplexity']:.4g})"
            cells.append(text)
        lines.append(
            f"| `{checkpoint['directory']}` | {checkpoint['format']} | {checkpoint['expectation']} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def render_finding(index: int, item: dict) -> list[str]:
    known = f" — known issue `{item['known_issue']}`" if item["known_issue"] else " — **new**"
    lines = [
        f"### {index + 1}. {item['engine']} {item['engine_version']}: {item['kind']} ({item['format']}){known}",
        "",
        f"{KINDS[item['kind']]}.",
        "",
        f"- {item['message']}",
    ]
    if item.get("module"):
        lines.append(f"- module: `{item['module']}`")
    if item.get("command"):
        lines.append(f"- reproduce: `{item['command']}`")
    if item.get("fix"):
        lines.append(f"- repair after load: fix `{item['fix']}` (`python -m harness fixes`)")
    if item.get("heatmap"):
        lines += ["", f"![per-block error]({item['heatmap']})", "", f"({LEGEND})"]
    lines.append("")
    return lines


def coverage_engines(rows: list[dict], engines: list[str]) -> list[str]:
    """The engines the rows count, in the report's order of engines, then any other."""
    named = list(dict.fromkeys(e for row in rows for e in row.get("engines", {})))
    return [e for e in engines if e in named] + [e for e in named if e not in engines]


def loaded_text(counts: dict | None) -> str:
    """`loaded/attempted`, e.g. `3/4`; empty when the engine saw nothing in the cell."""
    if not counts:
        return ""
    attempted = sum(counts.get(s, 0) for s in ENGINE_STATUSES)
    return f"{counts.get('loaded', 0)}/{attempted}" if attempted else ""


def never_loaded(rows: list[dict], engines: list[str]) -> list[str]:
    """Per engine, the reached cells where it loaded nothing, with how those examples ended."""
    lines = []
    reached = [row for row in rows if row.get("examples", 0) > 0]
    for engine in engines:
        cells, totals = [], dict.fromkeys(ENGINE_STATUSES, 0)
        for row in reached:
            counts = row.get("engines", {}).get(engine, {})
            if counts.get("loaded", 0):
                continue
            ended = [f"{counts[s]} {s}" for s in ENGINE_STATUSES[1:] if counts.get(s)]
            for status in ENGINE_STATUSES[1:]:
                totals[status] += counts.get(status, 0)
            cells.append(f"`{row['cell']}`" + (f" ({', '.join(ended)})" if ended else ""))
        if not cells:
            continue
        if len(cells) == len(reached):
            ended = ", ".join(f"{n} {s}" for s, n in totals.items() if n) or "no example reached it"
            lines.append(f"- {engine}: never loaded in any reached cell ({ended})")
        else:
            lines.append(f"- {engine} ({len(cells)} cell(s)): {', '.join(cells)}")
    return lines


def render_coverage(rows: list[dict], engines: list[str]) -> list[str]:
    """Totals, one compact row per reached cell, the unreached cells as one list, and the cells
    where an engine never loaded (grouped by engine): readable at a few hundred cells."""
    engines = coverage_engines(rows, engines)
    reached = sorted((row for row in rows if row.get("examples", 0) > 0), key=lambda row: row["cell"])
    unreached = sorted(row["cell"] for row in rows if row.get("examples", 0) <= 0)
    examples = sum(row.get("examples", 0) for row in rows)
    lines = [
        "## Coverage",
        "",
        f"{len(reached)} of {len(rows)} planned cell(s) reached (format/arch/dtype/family), {examples} example(s) "
        f"in all. Engine columns: examples loaded / examples the engine was given in that cell.",
    ]
    if reached:
        lines += [
            "",
            "| cell | examples | findings | new | " + " | ".join(engines) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(engines),
        ]
        for row in reached:
            new = row.get("new", 0)
            cells = [loaded_text(row.get("engines", {}).get(e)) for e in engines]
            lines.append(
                f"| `{row['cell']}` | {row.get('examples', 0)} | {row.get('findings', 0)} | "
                f"{f'**{new}**' if new else 0} | " + " | ".join(cells) + " |"
            )
    lines += ["", f"Cells never reached ({len(unreached)}): " + (", ".join(f"`{c}`" for c in unreached) or "none.")]
    missing = never_loaded(rows, engines)
    if missing:
        return [*lines, "", "Cells where an engine never loaded, by engine:", "", *missing]
    return [*lines, "", "Every engine loaded in every reached cell."]
