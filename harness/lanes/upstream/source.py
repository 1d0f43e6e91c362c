"""What a reproducer reproduces: a known issue's entry (its reproducer recipe and reason), or one
finding of a report (the recipe in its reproduction directory's harness_manifest.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harness.checkpoints.recipe import Recipe
from harness.core.errors import HarnessError
from harness.differential.known_issues import KnownIssue, KnownIssues
from harness.differential.relations import relation_named
from harness.engines.options import split_engine

#: the engines a standalone script can drive (harness/lanes/upstream/parts/engine_*.py)
SCRIPTED_ENGINES = ("transformers", "compressed-tensors", "vllm")


@dataclass
class Reproducer:
    id: str
    engine: str
    recipe: Recipe
    #: why it happens: the known issue's reason, or the finding's message
    mechanism: str
    #: where it comes from, for the reader: `cases/known_issues.toml` or `REPORT, finding N`
    source: str
    #: the error the harness saw, as a regex (a load-error issue's `message`), or None
    reported_error: str | None = None
    upstream: str = ""
    kinds: list[str] = field(default_factory=list)
    #: a report's finding: its message, as the harness wrote it
    finding: str = ""
    #: what the finding says: a known issue's `message` (a regex), or a report finding's own message
    finding_pattern: str = ""
    #: a relation finding's relation (harness.differential.relations): the second load path the
    #: script holds to the first, None for the others
    relation: str | None = None
    #: the options the engine is loaded with (harness.engines.options), e.g. {"dtype": "float16"}
    engine_options: dict[str, str] = field(default_factory=dict)


def require_engine(engine: str, where: str) -> None:
    if engine not in SCRIPTED_ENGINES:
        raise HarnessError(
            f"{where}: no standalone reproducer for engine '{engine}' (only {', '.join(SCRIPTED_ENGINES)}); "
            "reproduce it with `python -m harness compare`"
        )


def from_issue(issue: KnownIssue) -> Reproducer:
    require_engine(issue.engine, f"known issue {issue.id}")
    return Reproducer(
        id=issue.id,
        engine=issue.engine,
        recipe=Recipe.from_json({"seed": 0, **issue.reproducer}),
        mechanism=" ".join(issue.reason.split()),
        source="cases/known_issues.toml",
        reported_error=issue.message if {"load-error", "refused-valid"} & set(issue.kinds) else None,
        upstream=issue.upstream,
        kinds=list(issue.kinds),
        relation=relation_named(issue.message) if "relation" in issue.kinds else None,
        finding_pattern=issue.message or "",
        engine_options=dict(issue.engine_options),
    )


def from_known_issue(issue_id: str, known: KnownIssues | None = None) -> Reproducer:
    return from_issue((known or KnownIssues.load()).by_id(issue_id))


def from_finding(report: Path, number: int, known: KnownIssues | None = None) -> Reproducer:
    """Finding `number` (1-based, as report.md numbers them) of `report` (a report.json)."""
    try:
        payload = json.loads(Path(report).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise HarnessError(f"{report}: cannot read the report ({error})") from None
    findings = payload.get("findings") if isinstance(payload, dict) else None
    if not isinstance(findings, list):
        raise HarnessError(f"{report}: not a report.json (no `findings` list)")
    if not 1 <= number <= len(findings):
        raise HarnessError(f"{report}: --finding {number}: the report has {len(findings)} finding(s), numbered from 1")
    finding = findings[number - 1]
    where = f"{report}, finding {number}"
    engine, options = split_engine(str(finding.get("engine", "?")))
    require_engine(engine, where)
    directory = Path(finding.get("reproduction") or finding.get("checkpoint") or "")
    manifest = directory / "harness_manifest.json"
    if not manifest.is_file():
        raise HarnessError(f"{where}: its checkpoint {directory} has no harness_manifest.json (gone, or not generated)")
    recipe = Recipe.from_json(json.loads(manifest.read_text())["recipe"])
    issue_id = finding.get("known_issue")
    if issue_id:
        issue = (known or KnownIssues.load()).by_id(issue_id)
        reported = issue.message if {"load-error", "refused-valid"} & set(issue.kinds) else None
        mechanism, upstream = " ".join(issue.reason.split()), issue.upstream
    else:
        mechanism, reported, upstream = finding.get("message", ""), None, ""
    return Reproducer(
        id=issue_id or f"finding-{number}",
        engine=engine,
        engine_options=options,
        recipe=recipe,
        mechanism=mechanism,
        source=where,
        reported_error=reported,
        upstream=upstream,
        kinds=[finding.get("kind", "")],
        relation=relation_named(finding.get("message", "")) if finding.get("kind") == "relation" else None,
        finding_pattern=finding.get("message", ""),
        finding=f"{finding.get('engine')} {finding.get('engine_version', '')} {finding.get('kind')}: "
        f"{finding.get('message', '')}",
    )
