"""`run`: a property-based campaign that keeps exploring.

The cells (harness.campaign.cells) are visited in turn, the least served first, until the
budget (time or examples) is spent. Each visit is one short Hypothesis run over the cell's recipes:
Hypothesis generates, every engine loads and is judged. A finding with a signature not seen
before (engine, kind, format, cause) raises, so Hypothesis shrinks it, within a bounded number
of evaluations; the smallest failing recipe is kept as the reproduction and the signature is
then seen: later examples that show it again are counted, not raised, and exploration goes on
to find the next bug. Known issues never raise.

Hypothesis does what it is good at: generation, shrinking, and (nightly profile) the example
database, one key per cell. A visit's first example is Hypothesis's simplest one in the cell, and
each visit rotates the values its family forces (Coverage.force_on_visit), so that the simplest
example of each visit is another one (another disagreement kind, another KV naming); a recipe
evaluated before is not evaluated again (its findings are remembered), so later visits spend their
examples on new recipes.
"""

from __future__ import annotations

import heapq
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import Phase, given, seed, settings
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky

from harness.campaign.cells import Cell, Coverage, Family
from harness.campaign.strategies import recipes
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.findings import Finding
from harness.differential.known_issues import KnownIssues
from harness.differential.relations import CAMPAIGN_EVERY, sampled
from harness.differential.runner import CheckpointResult, EngineSession, evaluate
from harness.engines import judged_with_reference
from harness.engines.options import CAMPAIGN_OPTIONS_EVERY, base_engine, drawn_variant, format_variant

#: evaluations one new signature may spend on shrinking (each is a load in every engine)
SHRINK_EVALUATIONS = 12
#: examples a visit after a cell's first asks Hypothesis for (its simplest one is a repeat where its
#: family forces one value per field, a new recipe where the rotation gives it another value)
LATER_VISIT_EXAMPLES = 2
#: visits in a row that evaluate nothing new before a cell counts as exhausted
IDLE_VISITS = 3
ENGINE_STATUSES = ("loaded", "refused", "unsupported", "unavailable", "failed")


class FindingFailure(AssertionError):
    """Raised inside the property for a new finding; one subclass per signature."""


_FAILURE_TYPES: dict[tuple, type] = {}


def failure_type(signature: tuple) -> type:
    if signature not in _FAILURE_TYPES:
        name = "Finding_" + "_".join(str(part).replace("-", "_") for part in signature[:3])
        _FAILURE_TYPES[signature] = type(name, (FindingFailure,), {"signature": signature})
    return _FAILURE_TYPES[signature]


class CellDatabase(ExampleDatabase):
    """One example database shared by every cell, each cell under its own key prefix (every
    visit runs the same test function, whose own key would be the same for all cells)."""

    def __init__(self, inner: ExampleDatabase, prefix: bytes):
        super().__init__()
        self.inner, self.prefix = inner, prefix

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.prefix + key, value)

    def fetch(self, key: bytes):
        yield from self.inner.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.prefix + key, value)


@dataclass
class CellStats:
    examples: int = 0
    findings: int = 0
    new: int = 0
    engines: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, result: CheckpointResult) -> None:
        self.examples += 1
        self.findings += len(result.findings)
        self.new += sum(1 for f in result.findings if not f.known_issue)
        for engine, outcome in result.outcomes.items():
            counts = self.engines.setdefault(engine, dict.fromkeys(ENGINE_STATUSES, 0))
            counts[outcome.status] = counts.get(outcome.status, 0) + 1


@dataclass
class Campaign:
    cells: list[Cell]
    examples: int = 0
    shrink_examples: int = 0
    stopped: str = ""
    results: list[CheckpointResult] = field(default_factory=list)
    #: signature -> (recipe, findings) of the smallest failing example found for a new signature
    minimal: dict[tuple, tuple[Recipe, list[Finding]]] = field(default_factory=dict)
    #: signature -> (recipe, findings) of the last example that showed a known issue
    known: dict[tuple, tuple[Recipe, list[Finding]]] = field(default_factory=dict)
    counts: dict[tuple, int] = field(default_factory=dict)
    coverage: dict[str, CellStats] = field(default_factory=dict)
    #: engine variant (harness.engines.options) -> examples it was drawn on
    options_drawn: dict[str, int] = field(default_factory=dict)
    #: examples so far per format (harness.engines.options.format_variant)
    format_examples: dict[str, int] = field(default_factory=dict)
    #: known issue -> what replaying its reproducer showed (`run --confirm-known`, after exploring): not exploration
    replayed: dict[str, str] = field(default_factory=dict)
    #: how many known issues `run --confirm-known` accounts for: those it replayed and those exploration rediscovered
    replay_selection: int = 0

    def cells_reached(self) -> int:
        return sum(1 for c in self.cells if self.coverage.get(c.name, CellStats()).examples)

    def new_signatures(self) -> int:
        return len(self.minimal)

    def known_issue_ids(self) -> set[str]:
        return {items[0].known_issue for _, items in self.known.values()}

    def coverage_rows(self) -> list[dict]:
        rows = []
        for cell in self.cells:
            stats = self.coverage.get(cell.name, CellStats())
            rows.append(
                {
                    "cell": cell.name,
                    "format": cell.format,
                    "arch": cell.arch,
                    "dtype": cell.dtype,
                    "family": cell.family,
                    "examples": stats.examples,
                    "findings": stats.findings,
                    "new": stats.new,
                    "engines": stats.engines,
                }
            )
        return rows


@dataclass
class Budget:
    """When the campaign stops: a number of evaluated examples and/or seconds."""

    max_examples: int | None = None
    seconds: float | None = None
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def spent(self, examples: int) -> str:
        """Why the campaign must stop now ('' while it may go on)."""
        if self.max_examples is not None and examples >= self.max_examples:
            return f"{self.max_examples} examples"
        if self.seconds is not None and self.elapsed() >= self.seconds:
            return f"time budget of {self.seconds:.0f} s"
        return ""


#: what a sampled relation's turn counts where no engine could check it (vLLM refusing the model's
#: dtype, a lane that cannot lay the model out): half a check, so that it comes back on the next
#: examples of the same format and architecture until one really checks it (the tensor-parallel
#: relation on gpt-oss, whose float16 and float32 models vLLM refuses), without taking every turn
#: where none ever can
UNCHECKED_TURN = 0.5


def count_checked(checked: dict[str, float], drawn: tuple[str, ...], outcomes: dict) -> None:
    """Count each `drawn` relation on the example: 1 where some engine checked it (it held or not),
    UNCHECKED_TURN where every engine's verdict was "not checked"."""
    for name in drawn:
        verdicts = [o.relations[name] for o in outcomes.values() if name in o.relations]
        really = any(not verdict.startswith("not checked") for verdict in verdicts)
        checked[name] = checked.get(name, 0) + (1 if really else UNCHECKED_TURN)


@dataclass
class _Visit:
    """The state of one Hypothesis run over one cell."""

    cell: Cell
    shrinking: bool = False
    shrink_left: int = 0
    #: signatures first found in this run, which it may still shrink
    active: set[tuple] = field(default_factory=set)
    #: the relations those signatures were found checking: checked on every example that shrinks them
    relations: set[str] = field(default_factory=set)


def run_campaign(
    cells: list[Cell],
    coverage: Coverage,
    budget: Budget,
    work: Path,
    session: EngineSession,
    known: KnownIssues,
    shrink: bool = True,
    progress: Callable[[Campaign], None] | None = None,
    relations: tuple[str, ...] = (),
    relations_every: int = CAMPAIGN_EVERY,
    options_every: int = CAMPAIGN_OPTIONS_EVERY,
) -> Campaign:
    """Visit `cells` until `budget` is spent or every cell is exhausted. Each visit goes to the
    cell served least so far (_VisitCost): least time under a time budget (a cell whose examples
    load in vLLM costs more than one only the reference loads, and gets fewer of them), fewest
    examples under an example budget (deterministic). Every cell is visited once before any twice.
    `relations` are checked one at a time on one example in `relations_every`
    (harness.differential.relations.sampled); one example in `options_every` also loads an engine
    variant, in turn (harness.engines.options.drawn_variant)."""
    campaign = Campaign(cells)
    explorer = _Explorer(
        campaign,
        coverage,
        budget,
        work / "examples",
        session,
        known,
        shrink,
        progress,
        relations,
        relations_every,
        options_every,
    )
    queue = [(0.0, position) for position in range(len(cells))]
    clock = _VisitCost(budget.seconds is not None)
    visits = [0] * len(cells)
    idle = [0] * len(cells)  # visits in a row that found no recipe not evaluated before
    while queue:
        campaign.stopped = budget.spent(campaign.examples)
        if campaign.stopped:
            return campaign
        served, position = heapq.heappop(queue)
        before, started = campaign.examples, time.monotonic()
        explorer.unvisited = sum(1 for i, count in enumerate(visits) if count == 0 and i != position)
        explorer.visit(cells[position], visits[position])
        visits[position] += 1
        idle[position] = 0 if campaign.examples > before else idle[position] + 1
        if idle[position] < IDLE_VISITS:
            heapq.heappush(queue, (served + clock.cost(campaign.examples - before, started), position))
    campaign.stopped = "every cell's recipes exhausted"
    return campaign


class _VisitCost:
    """What a visit costs its cell: its examples under an example budget; under a time budget, its
    seconds, but never less than the mean seconds of an example times its examples, so that cells
    whose examples are refused at once (NaN scales) do not take over the budget."""

    def __init__(self, by_time: bool):
        self.by_time, self.seconds, self.examples = by_time, 0.0, 0

    def cost(self, examples: int, started: float) -> float:
        if not self.by_time:
            return max(examples, 1e-3)
        seconds = time.monotonic() - started
        self.seconds, self.examples = self.seconds + seconds, self.examples + examples
        mean = self.seconds / self.examples if self.examples else 0.0
        return max(seconds, mean * examples, 1e-3)


class _Explorer:
    def __init__(
        self,
        campaign,
        coverage,
        budget,
        examples_dir,
        session,
        known,
        shrink,
        progress,
        relations=(),
        relations_every=CAMPAIGN_EVERY,
        options_every=CAMPAIGN_OPTIONS_EVERY,
    ):
        self.campaign, self.coverage, self.budget = campaign, coverage, budget
        self.examples_dir, self.session, self.known = examples_dir, session, known
        self.shrink, self.progress = shrink, progress
        #: recipe (as JSON, with what its cell checks: _key) -> signatures of the new findings it showed:
        #: a recipe is evaluated once
        self.evaluated: dict[str, list[tuple]] = {}
        #: signature -> the recipe (as JSON) recorded as its smallest example
        self.minimal_key: dict[tuple, str] = {}
        #: the relations the campaign samples (harness.differential.relations)
        self.relations: tuple[str, ...] = relations
        #: one example in `relations_every` checks one of them
        self.relations_every = relations_every
        #: one example in `options_every` also loads an engine variant (harness.engines.options)
        self.options_every = options_every
        #: (format, architecture) -> relation -> how often it was checked there (least checked first; a
        #: turn no engine could take counts UNCHECKED_TURN)
        self.relations_checked: dict[tuple[str, str], dict[str, float]] = {}
        #: cells not visited yet, besides the one being visited: under an example budget, shrinking
        #: leaves one example to each (a first finding's shrink must not starve the other cells)
        self.unvisited = 0

    def visit(self, cell: Cell, visit_round: int) -> None:
        base = settings.default
        phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if self.shrink else [])
        database = CellDatabase(base.database, cell.key()) if base.database is not None else None
        state = _Visit(cell)

        @settings(
            base,
            max_examples=1 if visit_round == 0 else LATER_VISIT_EXAMPLES,
            phases=phases,
            database=database,
            derandomize=False,
            report_multiple_bugs=True,
        )
        @given(recipes((cell.format,), (cell.arch,), self.coverage.force_on_visit(cell, visit_round)))
        def explore(recipe: Recipe) -> None:
            self.check(recipe, state)

        if base.derandomize:  # the ci profile: a fixed, distinct seed per cell and round
            explore = seed(int.from_bytes(cell.key()[:8], "big") + visit_round)(explore)
        try:
            explore()
        except (FindingFailure, Flaky):
            pass  # recorded in campaign.minimal as it was raised
        except BaseExceptionGroup as group:  # several new signatures; anything else is a harness bug
            rest = group.subgroup(lambda e: not isinstance(e, (FindingFailure, Flaky, BaseExceptionGroup)))
            if rest is not None:
                raise rest from None

    def check(self, recipe: Recipe, state: _Visit) -> None:
        """The property: evaluate `recipe` (once), record it, raise for a signature being shrunk."""
        key = self._key(recipe, state)
        if key not in self.evaluated:
            if self.budget.spent(self.campaign.examples) or (state.shrinking and not self._may_shrink(state)):
                return  # nothing more is evaluated: generation and shrinking end without cost
            self.evaluated[key] = self.evaluate(recipe, state)
        signatures = self.evaluated[key]
        raising = None
        for signature in signatures:
            if signature not in self.campaign.minimal or signature not in state.active:
                continue
            if self.minimal_key.get(signature) != key:
                self.minimal_key[signature] = key  # Hypothesis only tries smaller examples once one failed
                self.campaign.minimal[signature] = (recipe, self.campaign.minimal[signature][1])
            raising = raising or signature
        if raising is not None:
            if not state.shrinking:  # a logit consequence of a weight finding shrinks with it
                causes = [s for s in state.active if s[3] != "consequence"]
                state.shrinking, state.shrink_left = True, SHRINK_EVALUATIONS * max(1, len(causes))
            raise failure_type(raising)(raising[3])

    def _variants(self, fmt: str, family: Family) -> list[str]:
        """The engine variants this example also loads: the campaign's drawn one (one example in
        `options_every`, else its format's own in turn), and every one its cell's family names that
        the run's engines have; none under `--options-every 0`."""
        if not self.options_every:
            return []
        campaign, engines = self.campaign, self.session.engines
        seen = campaign.format_examples[fmt] = campaign.format_examples.get(fmt, 0) + 1
        drawn = drawn_variant(campaign.examples, self.options_every, engines) or format_variant(seen, fmt, engines)
        mine = [v for v in family.variants if base_engine(v) in engines and v not in engines]
        return [drawn] + [v for v in mine if v != drawn] if drawn else mine

    def _key(self, recipe: Recipe, state: _Visit) -> str:
        """A recipe as its cell evaluates it: its JSON, and the relations and engine variants its
        cell's family checks on every example. Another cell's simplest recipe is often the same (the
        producer-round-trip family's is the producer-config family's): evaluated once per what is
        checked, not once per recipe, or the family's relations would never run."""
        family = self.coverage.families[state.cell.family]
        checked = family.relations + family.variants
        return json.dumps(recipe.to_json(), sort_keys=True) + (f" checked with {', '.join(checked)}" if checked else "")

    def _may_shrink(self, state: _Visit) -> bool:
        cap = self.budget.max_examples
        reserved = cap is not None and cap - self.campaign.examples <= self.unvisited
        return state.shrink_left > 0 and not reserved

    def evaluate(self, recipe: Recipe, state: _Visit) -> list[tuple]:
        campaign = self.campaign
        campaign.examples += 1
        if state.shrinking:
            campaign.shrink_examples += 1
            state.shrink_left -= 1
        directory = self.examples_dir / f"{campaign.examples:05d}"
        generate(recipe, directory)
        config = json.loads((directory / "config.json").read_text())
        checked = self.relations_checked.setdefault((recipe.format, recipe.arch), {})
        family = self.coverage.families[state.cell.family]
        drawn = sampled(campaign.examples, self.relations, self.relations_every, config=config, checked=checked)
        drawn += tuple(name for name in family.relations if name in self.relations and name not in drawn)
        relations = drawn + (tuple(sorted(state.relations - set(drawn))) if state.shrinking else ())
        try:
            result = evaluate(directory, self.session, self.known, relations=relations)
            count_checked(checked, drawn, result.outcomes)
            for variant in self._variants(recipe.format, family):  # each judged as its plain engine is
                loaded = evaluate(directory, self.session, self.known, engines=judged_with_reference(variant))
                result.outcomes[variant] = loaded.outcomes[variant]
                result.findings += [f for f in loaded.findings if f.engine == variant]
                campaign.options_drawn[variant] = campaign.options_drawn.get(variant, 0) + 1
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        campaign.results.append(result)
        campaign.coverage.setdefault(state.cell.name, CellStats()).add(result)
        new = []
        for item in result.findings:
            signature = item.signature()
            campaign.counts[signature] = campaign.counts.get(signature, 0) + 1
            same = [f for f in result.findings if f.signature() == signature]
            if item.known_issue:
                campaign.known[signature] = (recipe, same)
                continue
            if signature not in campaign.minimal:
                campaign.minimal[signature] = (recipe, same)
                self.minimal_key[signature] = self._key(recipe, state)
                state.active.add(signature)
                state.relations.update(f.metrics["relation"] for f in same if "relation" in f.metrics)
            elif signature in state.active:
                campaign.minimal[signature] = (recipe, same)
            if signature not in new:
                new.append(signature)
        if self.progress:
            self.progress(campaign)
        return sorted(new, key=str)
