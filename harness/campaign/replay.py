"""Replaying recipes: known issues' reproducers and case files, on chosen engines."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.findings import CONSEQUENCE_KINDS, Finding
from harness.differential.known_issues import KnownIssue, KnownIssues
from harness.differential.relations import RELATION_NAMES, relation_named
from harness.differential.runner import CheckpointResult, EngineSession, evaluate
from harness.engines import judged_with_reference

#: finding kinds an engine shows only by running its forward (logits, activations, its KV cache)
SEEN_IN_FORWARD = (*CONSEQUENCE_KINDS, "activations", "kv-scales")


def replay_recipe(
    recipe: Recipe,
    directory: Path,
    session: EngineSession,
    known: KnownIssues | None = None,
    engines: list[str] | None = None,
    relations: tuple[str, ...] = (),
) -> CheckpointResult:
    if not directory.exists():
        generate(recipe, directory)
    return evaluate(directory, session, known, engines, relations=relations)


def reproduce_known_issue(issue: KnownIssue, session: EngineSession, work: Path) -> tuple[str, list[Finding]]:
    """('reproduced' | 'gone' | 'skipped: why', the matching findings), its engine loaded with the
    options its reproducer names (`issue.engine_name`); 'gone' means the engine's version is in range and the reproducer no longer shows it."""
    engine = issue.engine_name  # with the options its reproducer loads it with
    worker = session.process(engine)
    if worker is None:
        return f"skipped: {session.unavailable[engine]}", []
    version = session.versions[engine]
    if not issue.applies_to(engine, version):
        return f"skipped: {engine} {version} is outside {issue.versions}", []
    if issue.outside_this_machine():
        return f"skipped: {issue.outside_this_machine()}", []
    recipe = Recipe.from_json({"seed": 0, **issue.reproducer})
    engines = judged_with_reference(engine)
    result = replay_recipe(recipe, work / issue.id, session, KnownIssues([issue]), engines, issue_relations(issue))
    matching = [f for f in result.findings if f.known_issue == issue.id]
    if not matching and _cannot_show_here(issue, result.outcomes.get(engine)):
        outcome = result.outcomes[engine]
        return f"skipped: {engine} cannot run it here ({outcome.detail or outcome.status})", []
    return ("reproduced" if matching else "gone"), matching


def issue_relations(issue: KnownIssue) -> tuple[str, ...]:
    """The relations a replay of `issue` checks: a relation finding shows only when its relation is
    checked, the one its message names (else all); none for an issue of another kind."""
    if "relation" not in issue.kinds:
        return ()
    named = relation_named(issue.message or "")
    return (named,) if named else RELATION_NAMES


def _cannot_show_here(issue: KnownIssue, outcome) -> bool:
    """Whether the machine or the engine's build kept the reproducer from showing the issue: the
    engine has no kernel for the checkpoint, or loaded it but cannot run its forward (vLLM's FP8 KV
    cache on an AVX2-only CPU) while the issue is seen only through the forward. Unknown here, not gone."""
    if outcome is None:
        return False
    if outcome.status == "unsupported":
        return True
    kv_cache = issue.reproducer.get("layout", {}).get("kv_scales", "none") != "none"  # judged on the cache's scales
    seen_in_forward = kv_cache or any(kind in SEEN_IN_FORWARD for kind in issue.kinds)
    return outcome.detail.startswith("partly unsupported") and seen_in_forward


def in_selection(issue: KnownIssue, engines, formats=(), archs=()) -> bool:
    """Whether the known issue belongs to a run of `engines` over `formats` and `archs` (any where
    empty): its engine ran, and it names one of the formats and (where it names any) architectures
    ("*": every one)."""
    return (
        issue.engine in engines
        and (not formats or "*" in issue.formats or bool(set(formats) & set(issue.formats)))
        and (not archs or not issue.archs or "*" in issue.archs or bool(set(archs) & set(issue.archs)))
    )


def issues_to_replay(known: KnownIssues, engines, formats=(), archs=(), shard=(1, 1)) -> list[KnownIssue]:
    """The known issues `run --confirm-known` may replay: those in the run's selection (in_selection),
    this shard's share (every N-th by id)."""
    chosen = sorted((i for i in known.issues if in_selection(i, engines, formats, archs)), key=lambda i: i.id)
    index, count = shard
    return [issue for position, issue in enumerate(chosen) if position % count == index - 1]


def replay_known_issues(issues: list[KnownIssue], session: EngineSession, work: Path, spent=None) -> dict[str, str]:
    """Each issue's reproducer replayed (reproduce_known_issue): id -> 'reproduced', 'gone' or
    'skipped: why'. `spent()` says why to stop before the next one ('' to go on); the issues left
    are then 'skipped: not replayed (the budget ran out)'."""
    statuses: dict[str, str] = {}
    for issue in issues:
        stop = spent() if spent else ""
        if stop:
            statuses[issue.id] = f"skipped: not replayed ({stop} spent)"
            continue
        statuses[issue.id] = reproduce_known_issue(issue, session, work)[0]
        shutil.rmtree(work / issue.id, ignore_errors=True)
    return statuses
