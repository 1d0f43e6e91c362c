"""`merge-reports OUT REPORT [REPORT ...]`: one report from the shards of a campaign (CI's matrix,
the pytest plugin's xdist mode). Findings and checkpoints are concatenated (each keeps its
shard's reproduction paths), engines united, coverage rows summed by cell, examples summed; the
shards' heatmaps are copied into OUT/heatmaps/. Exit 1 when a merged finding is new, else 0;
unreadable input is one line and exit 2. Nothing is written outside OUT."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import fields
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.findings import Finding
from harness.differential.report import ENGINE_STATUSES, slug, write_report

EXIT_OK, EXIT_FINDING = 0, 1
FINDING_FIELDS = {f.name for f in fields(Finding)}
REQUIRED = {
    "findings": list,
    "engines": dict,
    "checkpoints": list,
}
#: top-level keys merged by their own rule; every other one by `merge_extra`
HANDLED = {"title", "summary", "notes", "findings", "engines", "checkpoints", "coverage", "shard"}


def report_file(given: Path) -> Path:
    """A report directory (holding report.json) or a report.json itself."""
    if given.is_dir():
        if not (given / "report.json").is_file():
            raise HarnessError(f"{given}: no report.json in this directory")
        return given / "report.json"
    if not given.exists():
        raise HarnessError(f"{given}: no such file or directory")
    return given


def read_report(given: Path) -> tuple[Path, dict]:
    """(the report's directory, its payload): checked to be a harness report, else one line."""
    path = report_file(given)
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise HarnessError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise HarnessError(f"{path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    if not isinstance(payload, dict):
        raise HarnessError(f"{path}: not a harness report (a JSON {type(payload).__name__}, not an object)")
    for key, kind in REQUIRED.items():
        if not isinstance(payload.get(key), kind):
            raise HarnessError(f"{path}: not a harness report (no `{key}` {kind.__name__})")
    for row in payload.get("coverage") or []:
        if not isinstance(row, dict) or not isinstance(row.get("cell"), str):
            raise HarnessError(f"{path}: not a harness report (a coverage row without a `cell`)")
    for checkpoint in payload["checkpoints"]:
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("outcomes"), dict):
            raise HarnessError(f"{path}: not a harness report (a checkpoint without `outcomes`)")
    payload["findings"] = [finding_from_json(path, item) for item in payload["findings"]]
    return path.parent, payload


def finding_from_json(path: Path, item) -> Finding:
    if not isinstance(item, dict):
        raise HarnessError(f"{path}: not a harness report (a finding that is not an object)")
    try:
        return Finding(**{k: v for k, v in item.items() if k in FINDING_FIELDS})
    except (TypeError, ValueError) as error:
        raise HarnessError(f"{path}: not a harness report (a finding: {error})") from None


def merge_engines(shards: list[tuple[Path, dict]], notes: list[str]) -> dict:
    """The union; an engine whose version differs between shards shows every version, with a note."""
    merged: dict[str, dict] = {}
    versions: dict[str, dict[str, list[str]]] = {}
    for directory, payload in shards:
        for name, info in payload["engines"].items():
            info = dict(info) if isinstance(info, dict) else {"status": str(info)}
            if name not in merged or (info.get("status") == "ran" and merged[name].get("status") != "ran"):
                merged[name] = {**merged.get(name, {}), **info}
            if info.get("version"):
                versions.setdefault(name, {}).setdefault(str(info["version"]), []).append(str(directory))
    for name, seen in versions.items():
        if len(seen) > 1:
            merged[name]["version"] = ", ".join(seen)
            where = "; ".join(f"{version} in {', '.join(dirs)}" for version, dirs in seen.items())
            notes.append(f"engine {name}: the shards ran different versions ({where})")
    return merged


def merge_coverage(shards: list[tuple[Path, dict]]) -> list[dict] | None:
    """Rows summed by cell (examples, findings, new, and each engine's status counts)."""
    if not any("coverage" in payload for _, payload in shards):
        return None
    rows: dict[str, dict] = {}
    for _, payload in shards:
        for row in payload.get("coverage") or []:
            into = rows.setdefault(row["cell"], {**row, "examples": 0, "findings": 0, "new": 0, "engines": {}})
            for key in ("examples", "findings", "new"):
                into[key] += int(row.get(key, 0) or 0)
            for engine, counts in (row.get("engines") or {}).items():
                total = into["engines"].setdefault(engine, dict.fromkeys(ENGINE_STATUSES, 0))
                for status, count in (counts or {}).items():
                    total[status] = total.get(status, 0) + int(count or 0)
    return list(rows.values())


#: top-level numbers that add up over shards
SUMMED = ("examples", "shrink_examples")


def merge_counts(values: list):
    """The campaign's `counts` (one entry per finding signature: `seen` added up, `new` if new in
    any shard), or a dict of numbers added up key by key."""
    if all(isinstance(v, list) for v in values):
        merged: dict[tuple, dict] = {}
        for entry in (e for v in values for e in v if isinstance(e, dict)):
            key = tuple(entry.get("signature") or ())
            into = merged.setdefault(key, {**entry, "seen": 0, "new": False})
            into["seen"] += int(entry.get("seen", 0) or 0)
            into["new"] = bool(into["new"] or entry.get("new"))
        return list(merged.values())
    return merge_value(values)


def merge_value(values: list):
    """Dicts key by key, numbers in dicts added up, lists united (in order), equal values kept;
    values that differ become the list of each shard's value."""
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: merge_value([v[k] for v in values if k in v]) for k in keys}
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values) and len(values) > 1:
        return sum(values)
    if all(isinstance(v, list) for v in values):
        return list({json.dumps(e, sort_keys=True): e for v in values for e in v}.values())
    return values[0] if all(v == values[0] for v in values) else values


def merge_extra(shards: list[tuple[Path, dict]]) -> dict:
    """Every other top-level key: `examples` and `shrink_examples` summed, `counts` by signature,
    the shards' labels listed, others as `merge_value` says."""
    extra: dict = {}
    labels = []
    for _, payload in shards:  # a merged report's own `shards` count as theirs: merges merge again
        labels += payload["shards"] if isinstance(payload.get("shards"), list) else [payload.get("shard")]
    if any(labels):
        extra["shards"] = labels
    others = list(dict.fromkeys(k for _, payload in shards for k in payload if k not in HANDLED | {"shards"}))
    for key in others:
        values = [payload[key] for _, payload in shards if key in payload]
        if key in SUMMED:
            extra[key] = sum(v for v in values if isinstance(v, int | float))
        elif key == "counts":
            extra[key] = merge_counts(values)
        else:
            extra[key] = merge_value(values) if len(values) > 1 else values[0]
    return extra


def copy_heatmaps(out: Path, number: int, directory: Path, findings: list[Finding], notes: list[str]) -> None:
    """Each shard's PNGs into OUT/heatmaps/ under a name prefixed by the shard's position; the
    findings point at the copies."""
    for item in findings:
        if not item.heatmap:
            continue
        source = directory / item.heatmap
        if not source.is_file():
            notes.append(f"{directory}: heatmap {item.heatmap} is missing; its finding is merged without it")
            item.heatmap = None
            continue
        name = f"heatmaps/{number}-{slug(Path(item.heatmap).name)}"
        (out / "heatmaps").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, out / name)
        item.heatmap = name


def merge_reports(out: Path, reports: list[Path]) -> dict:
    """Write OUT/report.json and report.md from the given reports; returns the merged payload."""
    shards = [read_report(Path(r)) for r in reports]
    out = Path(out)
    for directory, _ in shards:
        if out.resolve() == directory.resolve():
            raise HarnessError(f"{out}: is one of the reports merged; name another OUT directory")
    notes: list[str] = []
    for directory, payload in shards:
        notes += [f"{directory}: {note}" for note in payload.get("notes") or []]
    engines = merge_engines(shards, notes)
    extra = merge_extra(shards)
    findings, checkpoints = [], []
    for number, (directory, payload) in enumerate(shards, start=1):
        copy_heatmaps(out, number, directory, payload["findings"], notes)
        findings += payload["findings"]
        checkpoints += payload["checkpoints"]
    described = ", ".join(
        f"{directory}" + (f" (shard {payload['shard']})" if payload.get("shard") else "")
        for directory, payload in shards
    )
    notes.insert(0, f"merged from {len(shards)} report(s): {described}")
    coverage = merge_coverage(shards)
    title = f"merge-reports: {len(shards)} report(s)"
    if "examples" in extra:
        title += f", {extra['examples']} examples"
    if coverage is not None:
        title += f" over {sum(1 for row in coverage if row['examples'] > 0)}/{len(coverage)} cells"
    write_report(
        out,
        findings,
        checkpoints,
        engines,
        title,
        coverage=coverage,
        extra={**extra, "notes": notes},
    )
    return json.loads((out / "report.json").read_text())


def command_merge_reports(args) -> int:
    payload = merge_reports(Path(args.out), [Path(r) for r in args.reports])
    new = [f for f in payload["findings"] if not f["known_issue"]]
    for item in new:
        print(f"NEW {item['engine']} {item['kind']} ({item['format']}): {item['message']}")
        if item.get("command"):
            print(f"    reproduce: {item['command']}")
    replayed = payload.get("known_issues_replayed")
    gone = [i for i, status in replayed.items() if status == "gone"] if isinstance(replayed, dict) else []
    for issue in gone:
        print(f"GONE {issue}: its reproducer no longer shows it (upstream fixed it?)")
    examples = f", {payload['examples']} examples" if "examples" in payload else ""
    print(
        f"merged {len(args.reports)} report(s){examples}: {len(payload['findings'])} finding(s), {len(new)} new; "
        f"report: {Path(args.out) / 'report.json'} and report.md"
    )
    sys.stdout.flush()
    return EXIT_FINDING if new or gone else EXIT_OK


def add_parser(commands) -> None:
    merge = commands.add_parser(
        "merge-reports",
        help="merge the reports of a sharded campaign into one; exit 1 when a merged finding is new",
        description="Merge report directories (or report.json files) into OUT/report.json and report.md: "
        "findings and checkpoints concatenated, engines united, coverage and examples summed, heatmaps copied. "
        "Exit 0 no new finding, 1 a new finding or a known issue gone (run --confirm-known), 2 unreadable input.",
    )
    merge.add_argument("out", help="output directory (created); must not be one of the reports")
    merge.add_argument("reports", nargs="+", metavar="report", help="a report directory or its report.json")
    merge.set_defaults(run=command_merge_reports)
