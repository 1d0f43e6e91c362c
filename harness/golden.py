"""Golden files: golden/<model>/<format>/<engine>.toml, one per (model, format, engine).

Reviewable text: perplexity on the held-out slice, greedy continuations of fixed prompts (as
text and token ids), and provenance (engine and version, dtype, date, producer, command).
Written only by an explicit update; read with a schema (unknown keys are errors).
"""

from __future__ import annotations

import datetime
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import HarnessError

GOLDEN_ROOT = Path(__file__).resolve().parent.parent / "golden"
FIELDS = {"model", "format", "engine", "engine_version", "dtype", "producer", "date", "command", "perplexity",
          "continuation"}
CONTINUATION_FIELDS = {"prompt", "text", "tokens"}


@dataclass
class Golden:
    model: str
    format: str
    engine: str
    perplexity: float
    continuations: list[list[int]]  # greedy tokens after each prompt of harness.lm.corpus.PROMPTS
    prompts: list[str]
    engine_version: str = ""
    dtype: str = "bfloat16"
    producer: str = "harness"
    date: str = ""
    command: str = ""
    texts: list[str] = field(default_factory=list)


def golden_path(model: str, fmt: str, engine: str, root: Path = GOLDEN_ROOT) -> Path:
    return root / model / fmt / f"{engine.replace(':', '_').replace('/', '_')}.toml"


def read_golden(path: Path) -> Golden:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise HarnessError(f"{path}: cannot read golden ({error})") from None
    unknown = set(data) - FIELDS
    if unknown:
        raise HarnessError(f"{path}: unknown golden key(s) {sorted(unknown)}")
    for item in data.get("continuation", []):
        if set(item) - CONTINUATION_FIELDS:
            raise HarnessError(f"{path}: unknown continuation key(s) {sorted(set(item) - CONTINUATION_FIELDS)}")
    try:
        return Golden(model=data["model"], format=data["format"], engine=data["engine"],
                      perplexity=float(data["perplexity"]),
                      continuations=[list(map(int, c["tokens"])) for c in data.get("continuation", [])],
                      prompts=[c["prompt"] for c in data.get("continuation", [])],
                      texts=[c.get("text", "") for c in data.get("continuation", [])],
                      engine_version=data.get("engine_version", ""), dtype=data.get("dtype", "bfloat16"),
                      producer=data.get("producer", "harness"), date=data.get("date", ""),
                      command=data.get("command", ""))
    except (KeyError, TypeError, ValueError) as error:
        raise HarnessError(f"{path}: malformed golden ({error})") from None


def write_golden(golden: Golden, path: Path) -> None:
    """TOML by hand (tomllib reads only): strings JSON-quoted, which TOML basic strings accept."""
    golden.date = golden.date or datetime.date.today().isoformat()
    lines = ["# Golden perplexity and greedy text; regenerate only with --update-golden (see golden/README.md)."]
    for key in ("model", "format", "engine", "engine_version", "dtype", "producer", "date", "command"):
        lines.append(f"{key} = {json.dumps(getattr(golden, key))}")
    lines.append(f"perplexity = {golden.perplexity!r}")
    for prompt, tokens, text in zip(golden.prompts, golden.continuations, golden.texts, strict=True):
        lines += ["", "[[continuation]]", f"prompt = {json.dumps(prompt)}", f"text = {json.dumps(text)}",
                  f"tokens = {json.dumps(tokens)}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def existing_goldens(root: Path = GOLDEN_ROOT) -> list[tuple[str, str, str, Path]]:
    """(model, format, engine, path) for every golden file on disk."""
    return [(p.parent.parent.name, p.parent.name, p.stem, p) for p in sorted(root.glob("*/*/*.toml"))]


def orphaned_goldens(expected: set[tuple[str, str, str]], root: Path = GOLDEN_ROOT) -> list[Path]:
    """Golden files no gate in `expected` (model, format, engine) reads."""
    return [path for model, fmt, engine, path in existing_goldens(root) if (model, fmt, engine) not in expected]
