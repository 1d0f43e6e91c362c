"""Reports: OUTDIR/report.json (machine-readable, top-level `findings`) and OUTDIR/report.md
(human: a summary table, each finding with its reproduction command and block heatmap)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.core.findings import KINDS, Finding
from harness.differential.heatmap import write_heatmap


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80]


def repairing_fix(finding: Finding) -> str | None:
    """The name of the fix module that repairs this finding after load, if one does."""
    from harness.fixes import fix_for_finding

    fix = fix_for_finding(finding)
    return fix.name if fix else None


def write_report(out: Path, findings: list[Finding], checkpoints: list[dict], engines: dict, title: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for index, item in enumerate(findings):
        grid = item.metrics.pop("block_ratio", None)
        if grid:
            name = f"heatmaps/{index:03d}-{slug(item.engine)}-{slug(item.module or item.kind)}.png"
            write_heatmap(grid, out / name)
            item.heatmap = name
    payload = {
        "title": title,
        "findings": [{**f.to_json(), "fix": repairing_fix(f)} for f in findings],
        "checkpoints": checkpoints,
        "engines": engines,
        "summary": {
            "findings": len(findings),
            "new": sum(1 for f in findings if not f.known_issue),
            "known": sum(1 for f in findings if f.known_issue),
        },
    }
    (out / "report.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(payload))
    return out / "report.json"


def render_markdown(payload: dict) -> str:
    lines = [f"# {payload['title']}", ""]
    summary = payload["summary"]
    lines.append(f"{summary['findings']} finding(s): {summary['new']} new, {summary['known']} known upstream issue(s).")
    lines += ["", "## Engines", "", "| engine | version | python |", "|---|---|---|"]
    for name, info in payload["engines"].items():
        lines.append(f"| {name} | {info.get('version', '')} | {info.get('python', info.get('status', ''))} |")
    lines += [
        "",
        "## Checkpoints",
        "",
        "| checkpoint | format | expectation | " + " | ".join(payload["engines"]) + " |",
        "|---|---|---|" + "---|" * len(payload["engines"]),
    ]
    for checkpoint in payload["checkpoints"]:
        cells = []
        for engine in payload["engines"]:
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
    if payload["findings"]:
        lines += ["", "## Findings", ""]
    for index, item in enumerate(payload["findings"]):
        known = f" — known issue `{item['known_issue']}`" if item["known_issue"] else " — **new**"
        lines += [
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
            lines += [
                "",
                f"![per-block error]({item['heatmap']})",
                "",
                "(one cell per scale block: white exact, yellow within tolerance, red over, black NaN/inf)",
            ]
        lines.append("")
    return "\n".join(lines) + "\n"
