"""Every repository path the data, the lanes and the docs cite exists (a moved file leaves no stale
reference behind)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITING = [
    "README.md",
    "tox.ini",
    "pyproject.toml",
    ".ci/run",
    *map(str, Path(ROOT).glob("cases/**/*.toml")),
    *Path(ROOT).glob("**/*.md"),
    *Path(ROOT).glob("tests/**/*.py"),
    *Path(ROOT).glob("harness/**/*.py"),
    *Path(ROOT).glob(".github/workflows/*.yml"),
    *Path(ROOT).glob("scripts/*"),
]
PATH = re.compile(
    r"(?<![\w./-])((?:harness|tests|scripts|docs|benchmarks|cases|golden|models|\.github)/"
    r"[\w./-]*[\w])"
)


def cited_paths() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    for source in {Path(ROOT, s) for s in CITING}:
        if not source.is_file() or any(part in (".tox", ".venv-tox", "out") for part in source.parts):
            continue
        content = source.read_text(errors="replace")
        for match in PATH.finditer(content):
            text = match.group(1).rstrip(".")
            end = match.end(1)
            placeholder = (
                any(c in text for c in "<>*{}$")
                or any(c in content[end : end + 2] for c in "<{*")
                or any(part.isupper() for part in text.split("/"))
            )  # models/NAME, results/dequant-<host>.json
            if not placeholder:
                cited.setdefault(text, set()).add(str(source.relative_to(ROOT)))
    return cited


def test_every_cited_path_exists():
    missing = {path: sorted(sources) for path, sources in cited_paths().items() if not (ROOT / path).exists()}
    assert not missing, "cited but not in the repository:\n" + "\n".join(
        f"{p} (in {', '.join(s)})" for p, s in sorted(missing.items())
    )


def test_the_scan_sees_the_citations():
    cited = cited_paths()
    assert "cases/known_issues.toml" in cited and "harness/differential/runner.py" in cited, sorted(cited)[:20]
