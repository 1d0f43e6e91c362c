"""Known upstream issues are data (cases/known_issues.toml). A matching finding is reported but
does not fail a run; each entry carries a reproducer recipe, and an entry whose reproducer no
longer reproduces fails the suite (strict), so the list stays true."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from harness.core.errors import HarnessError
from harness.core.findings import KINDS, Finding
from harness.core.paths import CASES_DIR

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
    "partial_blocks",
    "reason",
    "upstream",
    "reproducer",
    "status",
}
CONSEQUENCES = {"logprobs", "topk", "perplexity", "nonfinite-logits"}
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
    partial_blocks: bool | None = None
    archs: list[str] | None = None
    dtypes: list[str] | None = None
    upstream: str = ""
    status: str = "open"
    raw: dict = field(default_factory=dict)

    def applies_to(self, engine: str, version: str) -> bool:
        try:
            return engine == self.engine and Version(version.split("+")[0]) in self.versions
        except InvalidVersion:
            return False

    def matches(self, finding: Finding) -> bool:
        if not self.applies_to(finding.engine, finding.engine_version):
            return False
        if finding.kind not in self.kinds or ("*" not in self.formats and finding.format not in self.formats):
            return False
        if self.archs is not None and finding.arch not in self.archs:
            return False
        if self.dtypes is not None and finding.dtype not in self.dtypes:
            return False
        if self.message and not re.search(self.message, finding.message):
            return False
        if self.partial_blocks is not None:
            shape, block = finding.metrics.get("shape"), finding.metrics.get("block")
            partial = bool(shape and block and any(s % b for s, b in zip(shape, block, strict=False)))
            if partial != self.partial_blocks:
                return False
        return True


class KnownIssues:
    def __init__(self, issues: list[KnownIssue]):
        self.issues = issues

    @classmethod
    def load(cls, path: Path = DEFAULT_FILE) -> KnownIssues:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise HarnessError(f"{path}: cannot read known issues ({error})") from None
        issues = []
        for entry in data.get("issue", []):
            where = f"{path}: issue {entry.get('id', '?')}"
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
            issues.append(
                KnownIssue(
                    id=entry["id"],
                    engine=entry["engine"],
                    versions=versions,
                    formats=list(entry["formats"]),
                    kinds=kinds,
                    reason=entry["reason"],
                    reproducer=dict(entry["reproducer"]),
                    message=entry.get("message"),
                    partial_blocks=entry.get("partial_blocks"),
                    archs=entry.get("archs"),
                    dtypes=entry.get("dtypes"),
                    upstream=entry.get("upstream", ""),
                    status=entry.get("status", "open"),
                    raw=entry,
                )
            )
        ids = [i.id for i in issues]
        if len(ids) != len(set(ids)):
            raise HarnessError(f"{path}: duplicate issue ids")
        return cls(issues)

    def match(self, finding: Finding) -> str | None:
        for issue in self.issues:
            if issue.matches(finding):
                return issue.id
        return None

    def annotate(self, findings: list[Finding]) -> None:
        """Mark each finding with the known issue that explains it. An engine's logit-level
        findings (logprobs, top-k, perplexity) are consequences of its weight or load findings:
        when all of those are known, the logit ones carry the same issue."""
        for item in findings:
            item.known_issue = self.match(item)
        for engine in {f.engine for f in findings}:
            causes = [f for f in findings if f.engine == engine and f.kind not in CONSEQUENCES]
            ids = {f.known_issue for f in causes}
            if causes and None not in ids:
                for item in findings:
                    if item.engine == engine and item.kind in CONSEQUENCES and item.known_issue is None:
                        item.known_issue = sorted(ids)[0]

    def by_id(self, issue_id: str) -> KnownIssue:
        for issue in self.issues:
            if issue.id == issue_id:
                return issue
        raise HarnessError(f"no known issue '{issue_id}'")
