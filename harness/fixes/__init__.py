"""Fix modules: one post-load repair per known loading bug (see base.Fix). Every module in this
package that defines `FIX` is registered; importing the registry imports torch, not an engine."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from harness.fixes.base import Fix, FixReport

__all__ = ["Fix", "FixReport", "all_fixes", "get_fix", "fix_for_finding"]


@cache
def all_fixes() -> tuple[Fix, ...]:
    fixes = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "FIX", None), Fix):
            fixes.append(module.FIX)
    return tuple(fixes)


def get_fix(name: str) -> Fix:
    for fix in all_fixes():
        if fix.name == name:
            return fix
    raise KeyError(f"no fix named {name!r} (known: {', '.join(f.name for f in all_fixes())})")


def fix_for_finding(finding) -> Fix | None:
    """The fix that repairs a finding: by its known issue id first, then by engine, kind and format."""
    fixes = all_fixes()
    if finding.known_issue:
        for fix in fixes:
            if finding.known_issue in fix.known_issues:
                return fix
    for fix in fixes:
        if (
            finding.engine in fix.engines
            and finding.kind in fix.kinds
            and ("*" in fix.formats or finding.format in fix.formats)
        ):
            return fix
    return None
