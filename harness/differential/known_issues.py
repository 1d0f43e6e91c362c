"""Known upstream issues are data (cases/known_issues.toml). A matching finding is reported but
does not fail a run; each entry carries a reproducer recipe, and an entry whose reproducer no
longer reproduces fails the suite (strict), so the list stays true.

A finding is attributed to an entry by mechanism, not by message: the entry's engine, version
range, formats and kinds; its preconditions (`when`, harness/differential/preconditions.py) over
the checkpoint and the module; its message regex, as a secondary check; and, where it names a
predicted misreading (`misreading`, harness/differential/misreadings.py), the engine's held values
for the module equal to that prediction. A finding that meets an entry's preconditions but not its
mechanism stays new, and says why in metrics["attribution"]."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from harness.core.errors import HarnessError
from harness.core.findings import CONSEQUENCE_KINDS, KINDS, Finding
from harness.core.paths import CASES_DIR
from harness.differential.misreadings import WEIGHT_KINDS, require_misreading
from harness.differential.preconditions import SCHEMES, Predicate, checkpoint_context, known_names, module_context
from harness.engines.options import base_engine

DEFAULT_FILE = CASES_DIR / "known_issues.toml"
FIELDS = {
    "id",
    "engine",
    "versions",
    "formats",
    "archs",
    "dtypes",
    "kind",
    "message",
    "when",
    "misreading",
    "reason",
    "upstream",
    "reproducer",
    "engine_options",
    "status",
}
REQUIRED = {"id", "engine", "versions", "formats", "kind", "reason", "reproducer"}


@dataclass
class KnownIssue:
    id: str
    engine: str
    versions: SpecifierSet
    formats: list[str]
    kinds: list[str]
    reason: str
    reproducer: dict[str, Any]
    message: str | None = None
    #: all must hold (harness/differential/preconditions.py)
    when: list[Predicate] = field(default_factory=list)
    #: a name registered in harness/differential/misreadings.py: weight findings must equal its prediction
    misreading: str | None = None
    archs: list[str] | None = None
    dtypes: list[str] | None = None
    upstream: str = ""
    status: str = "open"
    #: the options its reproducer loads the engine with (harness.engines.options), e.g. a model dtype
    engine_options: dict[str, str] = field(default_factory=dict)

    @property
    def engine_name(self) -> str:
        """The engine its reproducer runs: `engine`, with `engine_options` where it has some."""
        from harness.engines.options import with_options

        return with_options(self.engine, self.engine_options)

    def outside_this_machine(self) -> str | None:
        """Why this machine cannot show the issue (a precondition on `isa` alone that is false
        here), else None."""
        from harness.core.machine import isa_class

        here = {"isa": isa_class()}
        for predicate in self.when:
            if predicate.names == {"isa"} and not predicate.holds(here):
                return f"this machine's kind ({here['isa']}) is outside {predicate.text!r}"
        return None

    raw: dict = field(default_factory=dict)

    def applies_to(self, engine: str, version: str) -> bool:
        try:
            return base_engine(engine) == self.engine and Version(version.split("+")[0]) in self.versions
        except InvalidVersion:
            return False

    def in_scope(self, finding: Finding) -> bool:
        """Engine, version, kind, format, architecture and dtype: the entry's scope."""
        if not self.applies_to(finding.engine, finding.engine_version):
            return False
        if finding.kind not in self.kinds or ("*" not in self.formats and finding.format not in self.formats):
            return False
        if self.archs is not None and finding.arch not in self.archs:
            return False
        return self.dtypes is None or finding.dtype in self.dtypes

    def attribute(self, finding: Finding, context: dict[str, Any] | None = None) -> tuple[bool, str | None]:
        """(whether the finding is this issue, and when it is in scope and meets the preconditions
        but not the mechanism, one line saying why not). `context`: the checkpoint's
        (preconditions.checkpoint_context), read from finding.checkpoint when not given."""
        if not self.in_scope(finding):
            return False, None
        if self.when:
            if context is None:
                context = checkpoint_context(finding.checkpoint) if finding.checkpoint else {}
            facts = context | module_context(finding)
            if not all(p.holds(facts) for p in self.when):
                return False, None
        if self.message and not re.search(self.message, finding.message):
            return False, None
        if self.misreading and finding.kind in WEIGHT_KINDS:
            return self._held_as_predicted(finding)
        return True, None

    def _held_as_predicted(self, finding: Finding) -> tuple[bool, str | None]:
        verdict = (finding.metrics.get("misreadings") or {}).get(self.misreading)
        lead = f"meets {self.id}'s preconditions, but"
        if verdict is None:
            return False, f"{lead} the held values were not compared with its predicted misreading {self.misreading}"
        if "undefined" in verdict:
            return False, f"{lead} its predicted misreading {self.misreading} does not apply: {verdict['undefined']}"
        if not verdict.get("equal"):
            return False, (
                f"{lead} the values differ from its predicted misreading {self.misreading} (max |err| "
                f"{verdict['max_abs']:.3g}, {verdict['bad_elements']} element(s) beyond the {verdict['dtype']} "
                "tolerance)"
            )
        return True, None

    def matches(self, finding: Finding, context: dict[str, Any] | None = None) -> bool:
        return self.attribute(finding, context)[0]


def readings(finding: Finding, context: dict[str, Any]) -> list[tuple[Finding, dict[str, Any]]]:
    """The finding with the context it is attributed in: as it is, or on a mixed checkpoint (its
    config groups in context[SCHEMES]) once per group it may concern: the group of its format where
    the finding names one (a module's, Judgement.module_format), else each group, with that group's
    format and knobs (a known issue of one format explains a finding on that format's modules)."""
    schemes = context.get(SCHEMES)
    if not schemes:
        return [(finding, context)]
    own = [(name, facts) for name, facts in schemes if name == finding.format] or schemes
    return [(dataclasses.replace(finding, format=name), context | facts) for name, facts in own]


def _list_of_strings(entry: dict, key: str, where: str) -> list[str]:
    value = entry.get(key, [])
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HarnessError(f"{where}: {key} must be a list of strings, got {value!r}")
    return value


def _issue(entry: dict, where: str, names: frozenset[str]) -> KnownIssue:
    if set(entry) - FIELDS:
        raise HarnessError(f"{where}: unknown key(s) {sorted(set(entry) - FIELDS)}")
    if REQUIRED - set(entry):
        raise HarnessError(f"{where}: missing key(s) {sorted(REQUIRED - set(entry))}")
    kinds = [entry["kind"]] if isinstance(entry["kind"], str) else list(entry["kind"])
    if set(kinds) - set(KINDS):
        raise HarnessError(f"{where}: unknown kind(s) {sorted(set(kinds) - set(KINDS))}")
    try:
        versions = SpecifierSet(entry["versions"])
    except InvalidSpecifier:
        raise HarnessError(f"{where}: bad version range {entry['versions']!r}") from None
    if entry.get("message") is not None:
        try:
            re.compile(entry["message"])
        except re.error as error:
            raise HarnessError(f"{where}: bad message regex ({error})") from None
    when = [Predicate.parse(text, where, names) for text in _list_of_strings(entry, "when", where)]
    options = entry.get("engine_options", {})
    if not isinstance(options, dict) or not all(isinstance(v, str) for v in options.values()):
        raise HarnessError(f"{where}: engine_options must be a table of strings, got {options!r}")
    if options:
        from harness.engines.options import split_engine, with_options

        split_engine(with_options(entry["engine"], options))  # an unknown option is a load error
    misreading = entry.get("misreading")
    if misreading is not None:
        known = require_misreading(misreading, where)
        if not set(kinds) & set(WEIGHT_KINDS):
            raise HarnessError(f"{where}: misreading {misreading!r} judges {' / '.join(WEIGHT_KINDS)} findings only")
        outside = [f for f in entry["formats"] if f not in known.formats]
        if outside:
            raise HarnessError(f"{where}: misreading {misreading!r} is not defined for format(s) {outside}")
    return KnownIssue(
        id=entry["id"],
        engine=entry["engine"],
        versions=versions,
        formats=list(entry["formats"]),
        kinds=kinds,
        reason=entry["reason"],
        reproducer=dict(entry["reproducer"]),
        message=entry.get("message"),
        when=when,
        misreading=misreading,
        archs=entry.get("archs"),
        dtypes=entry.get("dtypes"),
        upstream=entry.get("upstream", ""),
        status=entry.get("status", "open"),
        engine_options=dict(options),
        raw=entry,
    )


class KnownIssues:
    def __init__(self, issues: list[KnownIssue]):
        self.issues = issues

    @classmethod
    def load(cls, path: Path = DEFAULT_FILE) -> KnownIssues:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise HarnessError(f"{path}: cannot read known issues ({error})") from None
        names = known_names()
        issues = [_issue(entry, f"{path}: issue {entry.get('id', '?')}", names) for entry in data.get("issue", [])]
        ids = [i.id for i in issues]
        if len(ids) != len(set(ids)):
            raise HarnessError(f"{path}: duplicate issue ids")
        return cls(issues)

    def attribute(self, finding: Finding, context: dict[str, Any] | None = None) -> tuple[str | None, str | None]:
        """(the id of the first entry the finding is, or None; when None, why the first entry whose
        preconditions it meets does not explain it, or None)."""
        if context is None:
            context = checkpoint_context(finding.checkpoint) if finding.checkpoint else {}
        note = None
        for reading, facts in readings(finding, context):
            for issue in self.issues:
                matched, why = issue.attribute(reading, facts)
                if matched:
                    return issue.id, None
                note = note or why
        return None, note

    def match(self, finding: Finding, context: dict[str, Any] | None = None) -> str | None:
        return self.attribute(finding, context)[0]

    def annotate(self, findings: list[Finding]) -> None:
        """Mark each finding with the known issue that explains it (and, where one's preconditions
        hold but not its mechanism, metrics["attribution"] says so). An engine's logit-level
        findings (logprobs, top-k, perplexity) are consequences of its weight or load findings:
        when all of those are known, the logit ones carry the same issue."""
        contexts: dict[str, dict[str, Any]] = {}
        for item in findings:
            if item.checkpoint not in contexts:
                contexts[item.checkpoint] = checkpoint_context(item.checkpoint) if item.checkpoint else {}
            item.known_issue, note = self.attribute(item, contexts[item.checkpoint])
            item.metrics.pop("attribution", None)
            if note:
                item.metrics["attribution"] = note
        for engine in {f.engine for f in findings}:
            causes = [f for f in findings if f.engine == engine and f.kind not in CONSEQUENCE_KINDS]
            ids = {f.known_issue for f in causes}
            if causes and None not in ids:
                for item in findings:
                    if item.engine == engine and item.kind in CONSEQUENCE_KINDS and item.known_issue is None:
                        item.known_issue = sorted(ids)[0]

    def by_id(self, issue_id: str) -> KnownIssue:
        for issue in self.issues:
            if issue.id == issue_id:
                return issue
        raise HarnessError(f"no known issue '{issue_id}'")
