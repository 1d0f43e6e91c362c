"""What a fix module is: a post-load repair of one known loading bug, with the rule that says
when it applies. Fix modules import torch but never an engine; the caller hands them the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class FixReport:
    """What one application of a fix did: tensors repaired, tensors it declined to touch (and why),
    and warnings a user must see (meta or offloaded weights, ambiguous grids)."""

    fix: str
    repaired: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.repaired)

    def summary(self) -> str:
        return f"{self.fix}: {len(self.repaired)} repaired, {len(self.skipped)} skipped" + (
            f", {len(self.warnings)} warning(s)" if self.warnings else ""
        )


@dataclass(frozen=True)
class Fix:
    """One fix module's declaration (each module defines `FIX = Fix(...)`)."""

    name: str
    repairs: str  # one sentence: the bug, as a user sees it
    engines: tuple[str, ...]  # engine names as in harness.engines.REGISTRY
    versions: str  # PEP 440 specifier on the engine's package where the bug exists
    formats: tuple[str, ...]  # harness format names, or ("*",)
    detection: str  # the rule that decides the fix applies to a loaded model, in words
    apply: Callable[..., FixReport]  # apply(model, checkpoint_dir, **options) -> FixReport
    hook: Callable | None = None  # optional: install the repair where it must run (e.g. a forward pre-hook)
    known_issues: tuple[str, ...] = ()  # ids in cases/known_issues.toml this fix repairs
    report: str | None = None  # the user report in shared/seeds/ it comes from (a report id), if any
    kinds: tuple[str, ...] = ()  # finding kinds it repairs (harness.core.findings.KINDS), for reports
