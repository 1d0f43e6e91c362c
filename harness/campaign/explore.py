"""`run`: a property-based campaign. Hypothesis draws recipes; each checkpoint is generated,
loaded by every engine and judged. A new finding raises a failure whose type names its
signature (engine, kind, format), so Hypothesis shrinks each distinct bug separately; the
last failing recipe seen per signature is the minimal one, kept as the reproduction."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import Phase, given, settings

from harness.campaign.strategies import recipes
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.findings import Finding
from harness.differential.known_issues import KnownIssues
from harness.differential.runner import CheckpointResult, EngineSession, evaluate


class FindingFailure(AssertionError):
    """Raised inside the property for a new finding; one subclass per signature."""


_FAILURE_TYPES: dict[tuple, type] = {}


def failure_type(signature: tuple) -> type:
    if signature not in _FAILURE_TYPES:
        name = "Finding_" + "_".join(str(part).replace("-", "_") for part in signature)
        _FAILURE_TYPES[signature] = type(name, (FindingFailure,), {})
    return _FAILURE_TYPES[signature]


@dataclass
class Campaign:
    examples: int = 0
    results: list[CheckpointResult] = field(default_factory=list)
    #: signature -> (recipe, findings) of the last (so smallest) failing example
    minimal: dict[tuple, tuple[Recipe, list[Finding]]] = field(default_factory=dict)
    known: dict[tuple, tuple[Recipe, list[Finding]]] = field(default_factory=dict)
    counts: dict[tuple, int] = field(default_factory=dict)


def run_campaign(
    engines: list[str],
    formats: tuple[str, ...] | None,
    archs: tuple[str, ...] | None,
    max_examples: int,
    work: Path,
    session: EngineSession,
    known: KnownIssues,
    shrink: bool = True,
    progress=sys.stderr,
) -> Campaign:
    campaign = Campaign()
    examples_dir = work / "examples"
    started = time.monotonic()
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=max_examples, phases=phases, database=None, report_multiple_bugs=True)
    @given(recipes(formats=formats, archs=archs))
    def explore(recipe: Recipe) -> None:
        campaign.examples += 1
        directory = examples_dir / f"{campaign.examples:05d}"
        generate(recipe, directory)
        result = evaluate(directory, session, known)
        campaign.results.append(result)
        new = [f for f in result.findings if not f.known_issue]
        elapsed = time.monotonic() - started
        line = (
            f"[{campaign.examples:4d} examples, {elapsed:6.0f} s] {recipe.format:<15} {recipe.arch:<6} "
            f"{len(result.findings)} finding(s), {len(campaign.minimal)} new signature(s) so far"
        )
        if progress.isatty():
            print("\r" + line, end="   ", file=progress, flush=True)
        elif campaign.examples % 10 == 1:
            print(line, file=progress, flush=True)
        for item in result.findings:
            campaign.counts[item.signature()] = campaign.counts.get(item.signature(), 0) + 1
            bucket = campaign.known if item.known_issue else campaign.minimal
            bucket[item.signature()] = (recipe, [f for f in result.findings if f.signature() == item.signature()])
        if not new:
            shutil.rmtree(directory, ignore_errors=True)
            return
        raise failure_type(new[0].signature())(new[0].message)

    try:
        explore()
    except FindingFailure:
        pass  # Hypothesis re-raises the finding after shrinking; it is recorded in `minimal`
    except BaseExceptionGroup as group:  # several distinct findings; anything else is a harness bug
        rest = group.subgroup(lambda e: not isinstance(e, (FindingFailure, BaseExceptionGroup)))
        if rest is not None:
            raise rest from None
    print(file=progress)
    return campaign
