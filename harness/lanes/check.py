"""`python -m harness check CASE`: one question a bisect can ask of any engine version: is the
bug this case pins present? Exit 0 good, 1 bad, 125 cannot test (`git bisect run`'s convention).

CASE is a case file (`cases/checks/*.toml`, schema in cases/README.md), a reproduction
directory (a generated checkpoint with `harness_manifest.json`, as `run --report` leaves in
`repro/`), or a known issue's id (its reproducer, judged as tests/differential/test_known_issues.py
replays it: bad = a finding of its kinds matching its message). The engine is judged against the truth and the reference engine by
`harness.differential.runner.evaluate`; known upstream issues never excuse a finding here (a bisect asks
whether the bug is there, not whether it is known). Every user error is one line on stderr and
exit 125, so that `git bisect run` skips the version instead of marking it bad.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.paths import CASES_DIR
from harness.engines import judged_with_reference

EXIT_GOOD, EXIT_BAD, EXIT_CANNOT_TEST = 0, 1, 125
CHECKS_DIR = CASES_DIR / "checks"
CASE_KEYS = {"description", "engine", "expect", "kind", "message", "known_issue", "recipe"}
RECIPE_KEYS = {"format", "arch", "seed", "config", "knobs", "layout", "perturb", "set"}
EXPECTATIONS = ("agree", "finding")
#: the worker died: with expect = "finding", the engine gave no answer either way (unless the case names these)
WORKER_DEATHS = {"engine-crash", "engine-timeout", "engine-memory"}


class CannotTest(HarnessError):
    """The check cannot say good or bad: exit 125."""


@dataclass
class CheckCase:
    """What to load, in which engine, and what makes the answer 'good'."""

    name: str
    source: str
    engine: str
    expect: str = "agree"
    kinds: list[str] = field(default_factory=list)
    message: str | None = None
    known_issue: str | None = None
    description: str = ""
    recipe: object | None = None  # a harness.checkpoints.recipe.Recipe; None for a reproduction directory
    directory: Path | None = None
    #: relations checked on the load (a known issue's: harness.campaign.replay.issue_relations)
    relations: tuple[str, ...] = ()
    #: a known issue's reproducer, judged as its replay is: an engine without a kernel for the format
    #: still runs (its loaders with stand-in kernels), and a matching finding is the bug present
    replays_issue: bool = False


@dataclass
class Verdict:
    code: int
    reason: str


def find_case(text: str) -> Path:
    """A path as given, or a bare name of a file in cases/checks/ (with or without .toml)."""
    path = Path(text)
    if path.exists():
        return path
    for candidate in (CHECKS_DIR / text, CHECKS_DIR / f"{text}.toml"):
        if candidate.is_file():
            return candidate
    raise CannotTest(f"{text}: no such case file, reproduction directory or known issue (nor in {CHECKS_DIR})")


def load_case_file(path: Path, engine: str | None = None) -> CheckCase:  # noqa: C901  (one branch per refused field)
    """Parse and validate a case file; unknown keys and bad values are CannotTest."""
    from harness.checkpoints.recipe import Recipe, apply_settings
    from harness.core.findings import KINDS

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise CannotTest(f"{path}: cannot read it ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise CannotTest(f"{path}: not valid TOML ({error})") from None
    unknown = set(data) - CASE_KEYS
    if unknown:
        raise CannotTest(f"{path}: unknown key(s) {sorted(unknown)} (known: {', '.join(sorted(CASE_KEYS))})")
    expect = data.get("expect", "agree")
    if expect not in EXPECTATIONS:
        raise CannotTest(f"{path}: expect = {expect!r}; expected one of {list(EXPECTATIONS)}")
    raw_kinds = data.get("kind", [])
    kinds = [raw_kinds] if isinstance(raw_kinds, str) else list(raw_kinds)
    if set(kinds) - set(KINDS):
        raise CannotTest(f"{path}: unknown finding kind(s) {sorted(set(kinds) - set(KINDS))}")
    if expect == "finding" and not kinds:
        raise CannotTest(f'{path}: expect = "finding" needs `kind` (one of {", ".join(KINDS)})')
    if expect == "agree" and (kinds or "message" in data):
        raise CannotTest(f'{path}: `kind` and `message` belong to expect = "finding"')
    message = data.get("message")
    if message is not None:
        try:
            re.compile(message)
        except (re.error, TypeError) as error:
            raise CannotTest(f"{path}: message is not a regular expression ({error})") from None
    known_issue = data.get("known_issue")
    if known_issue is not None:
        from harness.differential.known_issues import KnownIssues

        KnownIssues.load().by_id(known_issue)  # a dangling reference is an error
    recipe_table = data.get("recipe")
    if not isinstance(recipe_table, dict):
        raise CannotTest(f"{path}: needs a [recipe] table (format, arch, and config/knobs/layout/perturb or set)")
    if set(recipe_table) - RECIPE_KEYS:
        raise CannotTest(f"{path}: unknown recipe key(s) {sorted(set(recipe_table) - RECIPE_KEYS)}")
    if "format" not in recipe_table or "arch" not in recipe_table:
        raise CannotTest(f"{path}: the recipe needs `format` and `arch`")
    settings = recipe_table.get("set", [])
    if not isinstance(settings, list) or not all(isinstance(s, str) for s in settings):
        raise CannotTest(f'{path}: recipe `set` must be a list of "KEY=VALUE" strings')
    try:
        recipe = Recipe.from_json({"seed": 0, **{k: v for k, v in recipe_table.items() if k != "set"}})
        recipe = apply_settings(recipe, settings)
        recipe.resolved()
    except HarnessError as error:
        raise CannotTest(f"{path}: {error}") from None
    except TypeError as error:
        raise CannotTest(f"{path}: malformed recipe ({error})") from None
    chosen = engine or data.get("engine")
    if not chosen:
        raise CannotTest(f"{path}: no engine (set `engine` in the case or pass --engine)")
    return CheckCase(
        name=path.stem,
        source=str(path),
        engine=chosen,
        expect=expect,
        kinds=kinds,
        message=message,
        known_issue=known_issue,
        description=str(data.get("description", "")).strip(),
        recipe=recipe,
    )


def load_reproduction(directory: Path, engine: str | None = None) -> CheckCase:
    """A reproduction directory: good means the engine agrees. Without --engine, the engine
    is the one whose findings in ../../report.json name this directory."""
    from harness.checkpoints.writer import MANIFEST_FILE

    if not (directory / MANIFEST_FILE).is_file():
        raise CannotTest(f"{directory}: not a reproduction directory (no {MANIFEST_FILE})")
    if engine is None:
        engines = set()
        report = directory.resolve().parent.parent / "report.json"
        if report.is_file():
            try:
                findings = json.loads(report.read_text()).get("findings", [])
            except (OSError, ValueError):
                findings = []
            engines = {
                f.get("engine")
                for f in findings
                if f.get("reproduction") and Path(f["reproduction"]).resolve() == directory.resolve()
            }
        if len(engines) != 1:
            raise CannotTest(f"{directory}: which engine? pass --engine (no single engine in its report.json)")
        engine = engines.pop()
    return CheckCase(name=directory.name, source=str(directory), engine=engine, directory=directory.resolve())


def load_known_issue(issue_id: str, engine: str | None = None) -> CheckCase | None:
    """A known issue's reproducer as a case (good = no finding of its kinds matching its message on
    its engine, with the options its reproducer names), or None where no known issue has that id."""
    from harness.campaign.replay import issue_relations
    from harness.checkpoints.recipe import Recipe
    from harness.differential.known_issues import KnownIssues

    issue = next((i for i in KnownIssues.load().issues if i.id == issue_id), None)
    if issue is None:
        return None
    return CheckCase(
        name=issue.id,
        source=f"known issue {issue.id} (cases/known_issues.toml)",
        engine=engine or issue.engine_name,
        expect="finding",
        kinds=list(issue.kinds),
        message=issue.message,
        known_issue=issue.id,
        recipe=Recipe.from_json({"seed": 0, **issue.reproducer}),
        relations=issue_relations(issue),
        replays_issue=True,
    )


def load_case(text: str, engine: str | None = None) -> CheckCase:
    from harness.engines import engine_spec

    if engine is not None:
        engine_spec(engine)  # an unknown engine name is a user error
    try:
        path = find_case(text)
    except CannotTest:
        case = load_known_issue(text, engine)
        if case is None:
            raise
        engine_spec(case.engine)
        return case
    case = load_reproduction(path, engine) if path.is_dir() else load_case_file(path, engine)
    engine_spec(case.engine)
    return case


def judge_case(case: CheckCase, result) -> Verdict:
    """Good, bad or cannot test, from one evaluated checkpoint (known issues play no part)."""
    engine = case.engine
    if engine != "reference":
        reference = result.outcomes.get("reference")
        if reference is None or reference.status not in ("loaded", "refused"):
            detail = f": {reference.detail}" if reference and reference.detail else ""
            return Verdict(
                EXIT_CANNOT_TEST,
                f"the reference engine {reference.status if reference else 'did not run'}{detail}: environment broken",
            )
        if any(f.engine == "reference" for f in result.findings):
            return Verdict(EXIT_CANNOT_TEST, "the reference engine itself disagrees with the truth: environment broken")
    outcome = result.outcomes[engine]
    findings = [f for f in result.findings if f.engine == engine]
    matching = [
        f for f in findings if f.kind in case.kinds and (case.message is None or re.search(case.message, f.message))
    ]
    if outcome.status in ("unavailable", "unsupported") and not (case.replays_issue and matching):
        # a known issue's finding made by its loaders with stand-in kernels decides; nothing else does
        return Verdict(EXIT_CANNOT_TEST, f"{engine} {outcome.status}: {outcome.detail}")
    partly = outcome.detail.startswith("partly unsupported")
    if case.expect == "agree":
        if findings:
            kinds = sorted({f.kind for f in findings})
            return Verdict(EXIT_BAD, f"{len(findings)} finding(s) for {engine} ({', '.join(kinds)})")
        if partly:
            return Verdict(EXIT_CANNOT_TEST, f"{engine} {outcome.detail}")
        return Verdict(EXIT_GOOD, f"{engine} agrees with the reference ({outcome.status})")
    wanted = "/".join(case.kinds) + (f" matching /{case.message}/" if case.message else "")
    if matching:
        return Verdict(EXIT_BAD, f"{len(matching)} {wanted} finding(s) for {engine}: the bug is present")
    died = sorted({f.kind for f in findings if f.kind in WORKER_DEATHS})
    if died or partly:
        why = ", ".join(died) or outcome.detail
        return Verdict(
            EXIT_CANNOT_TEST, f"{engine} did not finish ({why}): cannot tell whether the {wanted} bug is present"
        )
    others = (
        f"; {len(findings)} other finding(s) ({', '.join(sorted({f.kind for f in findings}))}) do not decide"
        if findings
        else ""
    )
    return Verdict(EXIT_GOOD, f"no {wanted} finding for {engine} ({outcome.status}){others}")


def check_in_process(
    case: CheckCase, work: Path, timeout_s: float = 600.0, memory_mb: float = 16000.0, out=print
) -> Verdict:
    """Generate the case's checkpoint (if it is a recipe), evaluate it, judge it, print why."""
    from harness.checkpoints.writer import generate
    from harness.differential.runner import EngineSession, evaluate
    from harness.engines.process import EngineError, EngineFailure, Limits
    from harness.oracle.reference import format_and_knobs

    what = (
        "agree with the reference"
        if case.expect == "agree"
        else (f"no {'/'.join(case.kinds)} finding" + (f" matching /{case.message}/" if case.message else ""))
    )
    out(
        f"case {case.source}: engine {case.engine}, good = {what}"
        + (f" (checks known issue {case.known_issue})" if case.known_issue else "")
    )
    if case.directory is not None:
        directory = case.directory
    else:
        directory = work / "checkpoint"
        generate(case.recipe, directory)
        recipe = case.recipe
        out(
            f"checkpoint {directory}: {recipe.format} {recipe.arch} config={recipe.config} knobs={recipe.knobs} "
            f"layout={recipe.layout} perturb={recipe.perturb}"
        )
    fmt, knobs = format_and_knobs(directory)
    engines = judged_with_reference(case.engine)
    session = EngineSession(engines, work / "engines", Limits(timeout_s, memory_mb))
    try:
        # the engine first: one that cannot start or lacks this format is 125 before the reference loads
        worker = session.process(case.engine)
        if worker is None:
            return Verdict(EXIT_CANNOT_TEST, f"{case.engine} unavailable: {session.unavailable[case.engine]}")
        out(f"engine {case.engine} {session.versions[case.engine]} ({worker.info.get('python', '?')})")
        try:
            reason = worker.unsupported_schemes(fmt, knobs)
        except (EngineError, EngineFailure) as error:
            return Verdict(EXIT_CANNOT_TEST, f"{case.engine} cannot say whether it supports {fmt.name}: {error}")
        if reason and not case.replays_issue:
            return Verdict(EXIT_CANNOT_TEST, f"{case.engine} does not support {fmt.name}: {reason}")
        result = evaluate(directory, session, None, engines, relations=case.relations)
    finally:
        session.close()
    print_result(result, out)
    return judge_case(case, result)


def print_result(result, out) -> None:
    from harness.differential.known_issues import KnownIssues

    try:
        known = KnownIssues.load()
    except HarnessError:
        known = KnownIssues([])
    for engine, outcome in result.outcomes.items():
        detail = f": {outcome.detail}" if outcome.detail else ""
        out(f"  {engine:<20} {outcome.version:<12} {outcome.status}{detail}")
    for item in result.findings:
        issue = known.match(item)
        note = f" [matches known issue {issue}; not excused here]" if issue else ""
        out(f"  finding {item.engine} {item.kind}: {item.message}{note}")
