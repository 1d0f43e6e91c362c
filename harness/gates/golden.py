"""Golden files: golden/<model>/<format>/<engine>.toml, one per (model, format, engine).

Reviewable text: perplexity on the held-out slice, greedy continuations of fixed prompts (as
text and token ids, with each token's margin over the runner-up under teacher forcing), and
provenance (engine and version, the CPU's instruction-set class and thread count, dtype, date,
producer, command). Written only by an explicit update; read with a schema (unknown keys are
errors). `golden/unsupported.toml` lists the combinations that could not run where the goldens
were recorded, with the engine's reason.
"""

from __future__ import annotations

import datetime
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harness.checkpoints.architectures import ARCHITECTURES
from harness.core.errors import HarnessError
from harness.core.paths import GOLDEN_DIR
from harness.formats import FORMAT_NAMES

GOLDEN_ROOT = GOLDEN_DIR
#: every registered format the tiny (dense llama/qwen2) models can be written in has goldens: not
#: one that exists for another architecture only (mxfp4: gpt-oss's), nor `unquantized` (that variant
#: is the model itself; its bf16 goldens are the originals', golden/MODEL/bf16, read by the fix
#: gates). The registries import no torch, so the CLI parser stays light.
GOLDEN_FORMATS = tuple(
    f for f in FORMAT_NAMES if f != "unquantized" and not any(f in a.only_formats for a in ARCHITECTURES.values())
)

#: goldens read outside the model x format x engine matrix, and by what
OTHER_READERS = {
    ("tiny-qwen2", "bf16", "vllm"): "tests/fixes/test_materialize_meta_only.py (online FP8 loads "
    "of the bf16 model, clobbered and repaired)"
}


UNSUPPORTED_FILE = "unsupported.toml"
PROVENANCE = ("engine_version", "isa", "threads", "dtype", "producer", "date", "command")
FIELDS = {"model", "format", "engine", *PROVENANCE, "perplexity", "continuation"}
CONTINUATION_FIELDS = {"prompt", "text", "tokens", "margins"}
UNSUPPORTED_FIELDS = {"model", "format", "engine", "reason", "engine_version", "isa", "date"}


@dataclass
class Golden:
    model: str
    format: str
    engine: str
    perplexity: float
    continuations: list[list[int]]  # greedy tokens after each prompt of harness.lm.corpus.PROMPTS
    prompts: list[str]
    engine_version: str = ""
    isa: str = ""  # harness.core.machine.isa_class() where it was recorded
    threads: int = 0
    dtype: str = "bfloat16"
    producer: str = "harness"
    date: str = ""
    command: str = ""
    texts: list[str] = field(default_factory=list)
    #: per continuation token: its logprob minus the best other token's, under teacher forcing, in
    #: the recording run (small or negative: a near-tie that kernel rounding may flip)
    margins: list[list[float]] = field(default_factory=list)


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
        return Golden(
            model=data["model"],
            format=data["format"],
            engine=data["engine"],
            perplexity=float(data["perplexity"]),
            continuations=[list(map(int, c["tokens"])) for c in data.get("continuation", [])],
            prompts=[c["prompt"] for c in data.get("continuation", [])],
            texts=[c.get("text", "") for c in data.get("continuation", [])],
            margins=[list(map(float, c["margins"])) for c in data.get("continuation", []) if "margins" in c],
            engine_version=data.get("engine_version", ""),
            isa=data.get("isa", ""),
            threads=int(data.get("threads", 0)),
            dtype=data.get("dtype", "bfloat16"),
            producer=data.get("producer", "harness"),
            date=data.get("date", ""),
            command=data.get("command", ""),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise HarnessError(f"{path}: malformed golden ({error})") from None


def write_golden(golden: Golden, path: Path) -> None:
    """TOML by hand (tomllib reads only): strings JSON-quoted, which TOML basic strings accept."""
    golden.date = golden.date or datetime.date.today().isoformat()
    lines = ["# Golden perplexity and greedy text; regenerate only with --update-golden (see golden/README.md)."]
    for key in ("model", "format", "engine", *PROVENANCE):
        lines.append(f"{key} = {json.dumps(getattr(golden, key))}")
    lines.append(f"perplexity = {golden.perplexity!r}")
    margins = golden.margins or [None] * len(golden.continuations)
    for prompt, tokens, text, margin in zip(golden.prompts, golden.continuations, golden.texts, margins, strict=True):
        lines += [
            "",
            "[[continuation]]",
            f"prompt = {json.dumps(prompt)}",
            f"text = {json.dumps(text)}",
            f"tokens = {json.dumps(tokens)}",
        ]
        if margin is not None:
            lines.append(f"margins = {json.dumps([round(m, 4) for m in margin])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def existing_goldens(root: Path = GOLDEN_ROOT) -> list[tuple[str, str, str, Path]]:
    """(model, format, engine, path) for every golden file on disk."""
    return [(p.parent.parent.name, p.parent.name, p.stem, p) for p in sorted(root.glob("*/*/*.toml"))]


def orphaned_goldens(expected: set[tuple[str, str, str]], root: Path = GOLDEN_ROOT) -> list[Path]:
    """Golden files no gate in `expected` (model, format, engine) reads."""
    return [path for model, fmt, engine, path in existing_goldens(root) if (model, fmt, engine) not in expected]


def read_unsupported(root: Path = GOLDEN_ROOT) -> dict[tuple[str, str, str], dict]:
    """(model, format, engine) -> the record of why it could not run where the goldens were made."""
    path = root / UNSUPPORTED_FILE
    if not path.is_file():
        return {}
    try:
        entries = tomllib.loads(path.read_text()).get("combination", [])
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise HarnessError(f"{path}: cannot read ({error})") from None
    for entry in entries:
        if set(entry) - UNSUPPORTED_FIELDS or not {"model", "format", "engine", "reason"} <= set(entry):
            raise HarnessError(
                f"{path}: an entry needs model, format, engine, reason (and only {sorted(UNSUPPORTED_FIELDS)})"
            )
    return {(e["model"], e["format"], e["engine"]): e for e in entries}


def write_unsupported(records: dict[tuple[str, str, str], dict], root: Path = GOLDEN_ROOT) -> None:
    lines = [
        "# Combinations that could not run where the goldens were recorded (harness golden --update writes",
        "# this): their gates skip with the reason. A machine that runs one records its golden with",
        "# `python -m harness golden --update --models M --formats F --engines E`, which drops the entry.",
    ]
    for key in sorted(records):
        lines += ["", "[[combination]]", *(f"{k} = {json.dumps(v)}" for k, v in records[key].items())]
    (root / UNSUPPORTED_FILE).write_text("\n".join(lines) + "\n")
