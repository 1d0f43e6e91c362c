"""Bad input through the real CLI: exit 2, one line on stderr naming the file and the problem.

Every case copies a checkpoint written by the real `gen`, damages it, and runs
`python -m harness dequant` (or `gen`) in a process of its own with a timeout (tests.cli). Each case lives in
its own sandbox directory, which is listed before and after the run: a refused input must
leave it exactly as it was (no output, no `.partial`, nothing written into the checkpoint; only
the output directory's mtime may move, as dequant streams into a `.partial` it then removes),
and nothing may appear beside the sandboxes either. Inputs that point outside the
checkpoint point at a *valid* copy of the file, so only the containment check can refuse
them, or at a FIFO, so that reading it would hang.

The processes (forked from tests.cli's server, which has imported the CLI and torch) run in
parallel in one module fixture, and the tests then check one recorded result each. Only the cases
the issue lists, and those that could hang, pay for a process; further variants of the
same damage call the same `harness.commands.cli.main` in this process (see `case`). Only the cases
selected for this session (e.g. with -k) are run.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import subprocess
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import cli as forked_cli

TIMEOUT_S = 120
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"

FP8 = ["--format", "fp8-block", "--arch", "llama", "--seed", "1"]
#: generated once per module, copied into each case's sandbox before it is damaged
SOURCES: dict[str, list[str]] = {
    "sharded": [*FP8, "--set", "block_size=32"],
    "single": [*FP8, "--set", "block_size=32", "--set", "shards=1"],
    "nan": [*FP8, "--set", "block_size=32", "--set", "nonfinite_scale=nan"],
    "inf": [*FP8, "--set", "block_size=32", "--set", "nonfinite_scale=inf", "--set", "shards=1"],
    # gate/up [160, 64] and down [64, 160] with 32x32 blocks: grids [5, 2] and [2, 5], stored transposed
    "transposed": [
        "--format",
        "fp8-block",
        "--arch",
        "qwen2",
        "--seed",
        "2",
        "--set",
        "hidden_size=64",
        "--set",
        "intermediate_size=160",
        "--set",
        "block_size=32",
        "--set",
        "scale_layout=transposed",
        "--set",
        "shards=1",
    ],
    # every weight fits in one 128x128 block: every scale grid is [1, 1]
    "one-block": [*FP8, "--set", "intermediate_size=64"],
}


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess | None:
    """The real CLI in a process of its own (tests.cli), without HARNESS_DEBUG's tracebacks; None
    when it ran past the timeout (a hang)."""
    try:
        return forked_cli.run_cli(*args, cwd=cwd, timeout=TIMEOUT_S, HARNESS_DEBUG="")
    except subprocess.TimeoutExpired:
        return None


def run_main(args: list[str]) -> subprocess.CompletedProcess:
    """`harness.commands.cli.main` in this process, its output captured; an escaping exception is
    recorded as the traceback the interpreter would have printed."""
    from harness.commands.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(stdout), redirect_stderr(stderr):
        patch.delenv("HARNESS_DEBUG", raising=False)
        try:
            code = main(args)
        except SystemExit as exit_:  # argparse
            code = exit_.code
        except BaseException:
            stderr.write(traceback.format_exc())
            code = 1
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


#: dequant streams into out/w.safetensors.partial and removes it when a later tensor is refused, so
#: the output directory's own mtime may move; what it holds may not (nor anything else's mtime)
TRANSIENT_WRITES_ALLOWED = "out"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (symlinks not followed): kind, size and mtime of each."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            info = path.lstat()
            kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file" if path.is_file() else "other"
            relative = str(path.relative_to(root))
            mtime = None if kind == "dir" and relative == TRANSIENT_WRITES_ALLOWED else info.st_mtime_ns
            found[relative] = (kind, info.st_size if kind == "file" else 0, mtime)
    return found


# --- damaging files ----------------------------------------------------------------------------------------


def read_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_shard(path: Path, header: dict | bytes, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    header, data = read_shard(path)
    edit(header)
    write_shard(path, header, data)


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    result = edit(data)
    path.write_text(json.dumps(data if result is None else result))


def set_length_field(path: Path, length: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", length)
    path.write_bytes(bytes(raw))


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as handle:
        handle.truncate(size)


def outside_copy(sandbox: Path, ck: Path, name: str) -> Path:
    """A valid copy of a checkpoint file, outside the checkpoint (but inside the sandbox)."""
    folder = sandbox / "outside"
    folder.mkdir(exist_ok=True)
    return Path(shutil.copy(ck / name, folder / name))


def replace_with_symlink(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def scale_shard(ck: Path, module_marker: str) -> str:
    """The shard holding the scale of the module whose manifest notes mention `module_marker`."""
    manifest = json.loads((ck / "harness_manifest.json").read_text())
    modules = [m for m, info in manifest["modules"].items() if any(module_marker in n for n in info["notes"])]
    assert len(modules) == 1, modules
    index = json.loads((ck / INDEX).read_text())
    return index["weight_map"][f"{modules[0]}.weight_scale_inv"]


# --- the cases ---------------------------------------------------------------------------------------------


@dataclass
class Expect:
    """What the refusal must say: every string in `names`, and `problem` (a regex, case-insensitive)."""

    names: list[str]
    problem: str = ""
    args: list[str] | None = None  # None: dequant the checkpoint into out/w.safetensors
    may_succeed: bool = False  # a correct harness may also accept the input (writing only the output)


@dataclass
class Case:
    source: str
    damage: Callable[[Path, Path], Expect]
    cli: bool  # run in a process of its own; else through harness.commands.cli.main in this process


CASES: dict[str, Case] = {}


def case(name: str, source: str = "sharded", cli: bool = False):
    """Register a damage. `cli=True` for the cases the issue lists and for anything that could
    hang (FIFOs): those run `python -m harness` in a process of its own with a timeout. The
    other variants go through the same `main()` in this process, to keep the module fast."""

    def register(damage):
        assert name not in CASES, name
        CASES[name] = Case(source, damage, cli)
        return damage

    return register


def dequant_args(sandbox: Path, ck: Path) -> list[str]:
    return ["dequant", str(ck), "--out", str(sandbox / "out" / "w.safetensors")]


# truncated and missing shards


@case("truncated-shard-data", cli=True)
def _(sandbox, ck):
    truncate(ck / SHARD2, (ck / SHARD2).stat().st_size - 100)
    return Expect([SHARD2], "truncated")


@case("truncated-shard-in-header")
def _(sandbox, ck):
    truncate(ck / SHARD1, 40)
    return Expect([SHARD1], "truncated")


@case("truncated-shard-no-length")
def _(sandbox, ck):
    truncate(ck / SHARD1, 3)
    return Expect([SHARD1], "truncated")


@case("truncated-single-file", source="single")
def _(sandbox, ck):
    truncate(ck / SINGLE, (ck / SINGLE).stat().st_size // 2)
    return Expect([SINGLE], "truncated")


@case("missing-shard", cli=True)
def _(sandbox, ck):
    (ck / SHARD1).unlink()
    return Expect([SHARD1], "missing|not found")


@case("missing-single-file", source="single")
def _(sandbox, ck):
    (ck / SINGLE).unlink()
    return Expect([SINGLE], "not found|missing")


@case("no-weights-at-all")
def _(sandbox, ck):
    for name in (INDEX, SHARD1, SHARD2):
        (ck / name).unlink()
    return Expect([str(ck)], "found|missing")


@case("shard-is-a-directory")
def _(sandbox, ck):
    (ck / SHARD1).unlink()
    (ck / SHARD1).mkdir()
    return Expect([SHARD1], "directory")


@case("shard-is-a-fifo", cli=True)
def _(sandbox, ck):
    (ck / SHARD1).unlink()
    os.mkfifo(ck / SHARD1)
    return Expect([SHARD1], "regular file")


@case("shard-symlink-loop")
def _(sandbox, ck):
    replace_with_symlink(ck / SHARD1, ck / SHARD1)
    return Expect([SHARD1], "")


@case("shard-dangling-symlink")
def _(sandbox, ck):
    replace_with_symlink(ck / SHARD1, ck / "nowhere.safetensors")
    return Expect([SHARD1], "symlink|not found|missing")


# index entries and symlinks that leave the checkpoint


def point_index_at(ck: Path, old: str, new: str) -> None:
    def edit(index):
        index["weight_map"] = {t: (new if s == old else s) for t, s in index["weight_map"].items()}

    edit_json(ck / INDEX, edit)


@case("index-entry-parent-dir", cli=True)
def _(sandbox, ck):
    shutil.copy(ck / SHARD1, sandbox / "x.safetensors")
    point_index_at(ck, SHARD1, "../x.safetensors")
    return Expect([INDEX, "../x.safetensors"], "escapes|outside")


@case("index-entry-nested-parent-dir")
def _(sandbox, ck):
    shutil.copy(ck / SHARD1, sandbox / "x.safetensors")
    point_index_at(ck, SHARD1, "harness_truth/../../x.safetensors")
    return Expect([INDEX], "escapes|outside")


@case("index-entry-absolute", cli=True)
def _(sandbox, ck):
    target = outside_copy(sandbox, ck, SHARD1)
    point_index_at(ck, SHARD1, str(target))
    return Expect([INDEX, str(target)], "escapes|outside")


@case("index-entry-not-a-string")
def _(sandbox, ck):
    point_index_at(ck, SHARD1, 7)
    return Expect([INDEX], "file name")


@case("index-entry-with-newline")
def _(sandbox, ck):
    point_index_at(ck, SHARD1, "model\n.safetensors")
    return Expect([INDEX], "file name")


@case("shard-symlink-outside", cli=True)
def _(sandbox, ck):
    replace_with_symlink(ck / SHARD1, outside_copy(sandbox, ck, SHARD1))
    return Expect([SHARD1], "outside")


@case("shard-symlink-to-outside-fifo", cli=True)
def _(sandbox, ck):
    (sandbox / "outside").mkdir()
    os.mkfifo(sandbox / "outside" / "pipe")
    replace_with_symlink(ck / SHARD1, sandbox / "outside" / "pipe")
    return Expect([SHARD1], "outside")


@case("shard-relative-symlink-outside")
def _(sandbox, ck):
    outside_copy(sandbox, ck, SHARD1)
    replace_with_symlink(ck / SHARD1, Path("..", "outside", SHARD1))
    return Expect([SHARD1], "outside")


@case("single-file-symlink-outside", source="single")
def _(sandbox, ck):
    replace_with_symlink(ck / SINGLE, outside_copy(sandbox, ck, SINGLE))
    return Expect([SINGLE], "outside")


@case("index-symlink-outside")
def _(sandbox, ck):
    replace_with_symlink(ck / INDEX, outside_copy(sandbox, ck, INDEX))
    return Expect([INDEX], "outside")


@case("config-symlink-outside")
def _(sandbox, ck):
    replace_with_symlink(ck / "config.json", outside_copy(sandbox, ck, "config.json"))
    return Expect(["config.json"], "outside")


@case("config-is-a-fifo", cli=True)
def _(sandbox, ck):
    (ck / "config.json").unlink()
    os.mkfifo(ck / "config.json")
    return Expect(["config.json"], "regular file")


# safetensors headers


@case("header-length-2**60", cli=True)
def _(sandbox, ck):
    set_length_field(ck / SHARD1, 2**60)
    return Expect([SHARD1], "header length")


@case("header-length-2**64-1")
def _(sandbox, ck):
    set_length_field(ck / SHARD1, 2**64 - 1)
    return Expect([SHARD1], "header length")


@case("header-length-just-past-eof", cli=True)
def _(sandbox, ck):
    set_length_field(ck / SHARD1, (ck / SHARD1).stat().st_size - 7)
    return Expect([SHARD1], "header length|truncated")


@case("header-not-json", cli=True)
def _(sandbox, ck):
    _, data = read_shard(ck / SHARD1)
    write_shard(ck / SHARD1, b"{this is not json", data)
    return Expect([SHARD1], "JSON")


@case("header-not-utf8")
def _(sandbox, ck):
    _, data = read_shard(ck / SHARD1)
    write_shard(ck / SHARD1, b"\xff\xfe" * 32, data)
    return Expect([SHARD1], "JSON")


@case("header-nested-too-deeply")
def _(sandbox, ck):
    _, data = read_shard(ck / SHARD1)
    write_shard(ck / SHARD1, b"[" * 200_000 + b"]" * 200_000, data)
    return Expect([SHARD1], "JSON")


@case("header-not-an-object")
def _(sandbox, ck):
    _, data = read_shard(ck / SHARD1)
    write_shard(ck / SHARD1, b"[1, 2, 3]", data)
    return Expect([SHARD1], "object")


def last_tensor(header: dict) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


@case("data-offsets-past-end", cli=True)
def _(sandbox, ck):
    def edit(header):
        name = last_tensor(header)
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [start + 4096, end + 4096]

    edit_header(ck / SHARD2, edit)
    return Expect([SHARD2], "past|truncated")


@case("data-offsets-overlap")
def _(sandbox, ck):
    def edit(header):
        name = last_tensor(header)
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [start - 2, end - 2]

    edit_header(ck / SHARD2, edit)
    return Expect([SHARD2], "overlap")


@case("data-offsets-do-not-match-shape")
def _(sandbox, ck):
    def edit(header):
        name = last_tensor(header)
        header[name]["shape"] = [dim * 2 for dim in header[name]["shape"]]

    edit_header(ck / SHARD2, edit)
    return Expect([SHARD2], "shape")


@case("header-unknown-dtype")
def _(sandbox, ck):
    def edit(header):
        header[last_tensor(header)]["dtype"] = "Q7"

    edit_header(ck / SHARD2, edit)
    return Expect([SHARD2], "dtype")


@case("header-negative-shape")
def _(sandbox, ck):
    def edit(header):
        name = last_tensor(header)
        header[name]["shape"] = [-1, -1 * header[name]["shape"][0] * header[name]["shape"][-1]]

    edit_header(ck / SHARD2, edit)
    return Expect([SHARD2], "shape")


@case("header-entry-not-an-object")
def _(sandbox, ck):
    def edit(header):
        header[last_tensor(header)] = "garbage"

    edit_header(ck / SHARD2, edit)
    return Expect([SHARD2], "malformed")


@case("header-duplicate-key", cli=True)
def _(sandbox, ck):
    header, data = read_shard(ck / SHARD2)
    name = last_tensor(header)
    text = json.dumps(header).encode()
    write_shard(ck / SHARD2, text[:-1] + b", " + json.dumps({name: header[name]}).encode()[1:], data)
    return Expect([SHARD2, "duplicate key"], "JSON")


@case("header-name-lone-surrogate", cli=True)
def _(sandbox, ck):
    # json.loads turns the escape into a str no terminal can print: the refusal must still be one line
    header, data = read_shard(ck / SHARD2)
    name = last_tensor(header)
    write_shard(ck / SHARD2, json.dumps(header).encode().replace(name.encode(), name.encode() + b"\\udc80"), data)
    return Expect([SHARD2], "surrogate")


@case("empty-shard")
def _(sandbox, ck):
    truncate(ck / SHARD1, 0)
    return Expect([SHARD1], "truncated")


@case("header-huge-shape")
def _(sandbox, ck):
    def edit(header):
        header[last_tensor(header)]["shape"] = [2**62, 2**62, 2**62]

    edit_header(ck / SHARD2, edit)
    return Expect([SHARD2], "shape")


# scales


@case("nan-scale", source="nan", cli=True)
def _(sandbox, ck):
    return Expect([scale_shard(ck, "set to nan")], "non-finite|nan")


@case("inf-scale", source="inf", cli=True)
def _(sandbox, ck):
    return Expect([SINGLE], "non-finite|inf")


@case("scale-grid-transposed", source="transposed", cli=True)
def _(sandbox, ck):
    return Expect([SINGLE, "weight_scale_inv"], "shape|grid")


@case("scale-grid-edited")
def _(sandbox, ck):
    # store q_proj's [2, 2] grid as [1, 4]: same bytes, wrong shape
    def edit(header):
        header["model.layers.0.self_attn.q_proj.weight_scale_inv"]["shape"] = [1, 4]

    shard = json.loads((ck / INDEX).read_text())["weight_map"]["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    edit_header(ck / shard, edit)
    return Expect([shard, "q_proj"], "shape|grid")


# config.json and quantization_config


def set_quant(ck: Path, value) -> None:
    edit_json(ck / "config.json", lambda config: config.__setitem__("quantization_config", value))


@case("quant-method-exl2", cli=True)
def _(sandbox, ck):  # ExLlamaV2's format: real, and not one the harness defines
    set_quant(ck, {"quant_method": "exl2", "bits": 4.0})
    return Expect(["config.json", "exl2"], "no supported format|unknown|unsupported")


@case("quant-method-garbage", cli=True)
def _(sandbox, ck):
    set_quant(ck, {"quant_method": "\u2603garbage", "weight_block_size": [32, 32]})
    return Expect(["config.json"], "no supported format|unknown|unsupported")


@case("quant-method-not-a-string")
def _(sandbox, ck):
    set_quant(ck, {"quant_method": [1, {"x": None}], "quant_algo": 5})
    return Expect(["config.json"], "no supported format|unknown|unsupported")


@case("quant-config-compressed-tensors-garbage")
def _(sandbox, ck):
    set_quant(ck, {"quant_method": "compressed-tensors", "config_groups": ["garbage"], "format": 3})
    return Expect(["config.json"], "no supported format|unknown|unsupported|malformed|invalid|config_groups")


@case("quant-config-ct-fp8-garbage-activations")
def _(sandbox, ck):
    weights = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    set_quant(
        ck,
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights, "input_activations": "garbage"}},
        },
    )
    return Expect(["config.json"], "no supported format|unknown|unsupported|malformed|invalid|activations")


@case("quant-config-modelopt-garbage-group-size")
def _(sandbox, ck):
    set_quant(ck, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": [16]})
    return Expect(["config.json"], "no supported format|unknown|unsupported|malformed|invalid|group_size")


@case("quant-config-not-an-object")
def _(sandbox, ck):
    set_quant(ck, "garbage")
    return Expect(["config.json"], "quantization_config")


@case("missing-quantization-config", cli=True)
def _(sandbox, ck):
    edit_json(ck / "config.json", lambda config: config.pop("quantization_config"))
    return Expect(["config.json"], "quantization_config")


@case("missing-config", cli=True)
def _(sandbox, ck):
    (ck / "config.json").unlink()
    return Expect(["config.json"], "not found|missing")


@case("config-not-json", cli=True)
def _(sandbox, ck):
    (ck / "config.json").write_text('{"quantization_config": {"quant_method": "fp8",')
    return Expect(["config.json"], "JSON")


@case("config-not-an-object")
def _(sandbox, ck):
    (ck / "config.json").write_text("[1, 2, 3]\n")
    return Expect(["config.json"], "object")


@case("config-hidden-size-string")
def _(sandbox, ck):
    edit_json(ck / "config.json", lambda config: config.__setitem__("hidden_size", "64"))
    return Expect(["config.json", "hidden_size"], "positive integer")


@case("config-duplicate-key")
def _(sandbox, ck):
    text = (ck / "config.json").read_text().rstrip().removesuffix("}")
    (ck / "config.json").write_text(text + ', "hidden_size": 64}')
    return Expect(["config.json", "duplicate key"], "JSON")


@case("config-huge-file")
def _(sandbox, ck):
    truncate(ck / "config.json", 2**30)  # sparse: 1 GiB of NUL bytes, refused before it is read
    return Expect(["config.json"], "larger")


@case("index-huge-file")
def _(sandbox, ck):
    truncate(ck / INDEX, 2**30)
    return Expect([INDEX], "larger")


@case("config-huge-integer")
def _(sandbox, ck):
    (ck / "config.json").write_text('{"quantization_config": ' + "9" * 100_000 + "}")
    return Expect(["config.json"], "JSON")


def block_size_case(name: str, value, cli: bool = False) -> None:
    @case(f"weight-block-size-{name}", cli=cli)
    def _(sandbox, ck):
        edit_json(ck / "config.json", lambda c: c["quantization_config"].__setitem__("weight_block_size", value))
        return Expect(["config.json"], "weight_block_size|block")


for _name, _value in [("0", 0), ("x", "x"), ("three-values", [1, 2, 3])]:
    block_size_case(_name, _value, cli=True)
for _name, _value in [
    ("empty", []),
    ("negative", [-32, 32]),
    ("float", [32.0, 32]),
    ("bool", True),
    ("object", {"rows": 32}),
]:
    block_size_case(_name, _value)


@case("weight-block-size-null")
def _(sandbox, ck):
    # null is one scale per weight (transformers' per-tensor FineGrainedFP8): the stored block grids
    # then disagree with the config, and the shard holding the first one is named
    edit_json(ck / "config.json", lambda c: c["quantization_config"].__setitem__("weight_block_size", None))
    return Expect([".safetensors"], r"needs the grid \[1, 1\]")


@case("weight-block-size-huge", source="one-block", cli=True)
def _(sandbox, ck):
    # every grid is [1, 1], which a block of 2**40 also gives: accepting it is correct, but
    # never by materialising a 2**40-row expansion (an allocation failure or a hang)
    edit_json(ck / "config.json", lambda c: c["quantization_config"].__setitem__("weight_block_size", [2**40, 2**40]))
    return Expect(["config.json"], "weight_block_size|block", may_succeed=True)


# the index


@case("index-without-weight-map", cli=True)
def _(sandbox, ck):
    edit_json(ck / INDEX, lambda index: index.pop("weight_map"))
    return Expect([INDEX], "weight_map")


@case("index-weight-map-not-an-object")
def _(sandbox, ck):
    edit_json(ck / INDEX, lambda index: index.__setitem__("weight_map", [SHARD1, SHARD2]))
    return Expect([INDEX], "weight_map")


@case("index-weight-map-empty")
def _(sandbox, ck):
    edit_json(ck / INDEX, lambda index: index.__setitem__("weight_map", {}))
    return Expect([INDEX], "weight_map")


@case("index-duplicate-key")
def _(sandbox, ck):
    text = (ck / INDEX).read_text().rstrip().removesuffix("}")
    (ck / INDEX).write_text(text + ', "weight_map": {}}')
    return Expect([INDEX, "duplicate key"], "JSON")


@case("index-not-json")
def _(sandbox, ck):
    (ck / INDEX).write_bytes(b"\x00\x01 not json")
    return Expect([INDEX], "JSON")


@case("index-names-tensor-shard-lacks", cli=True)
def _(sandbox, ck):
    edit_json(ck / INDEX, lambda index: index["weight_map"].__setitem__("model.layers.0.bogus.weight", SHARD1))
    return Expect([SHARD1, "model.layers.0.bogus.weight"], "lacks")


# the command line


@case("directory-missing")
def _(sandbox, ck):
    shutil.rmtree(ck)
    return Expect([str(ck)], "not found|not a directory|does not exist")


@case("directory-is-a-file")
def _(sandbox, ck):
    shutil.rmtree(ck)
    ck.write_text("not a checkpoint\n")
    return Expect([str(ck)], "not a directory")


@case("out-in-missing-directory", cli=True)
def _(sandbox, ck):
    out = sandbox / "no" / "such" / "dir" / "w.safetensors"
    return Expect([str(out)], "does not exist", args=["dequant", str(ck), "--out", str(out)])


@case("out-is-a-directory")
def _(sandbox, ck):
    return Expect([str(sandbox / "out")], "directory", args=["dequant", str(ck), "--out", str(sandbox / "out")])


@case("gen-out-not-empty", cli=True)
def _(sandbox, ck):
    return Expect([str(ck)], "not empty", args=["gen", *SOURCES["sharded"], "--out", str(ck)])


@case("gen-out-is-a-file")
def _(sandbox, ck):
    return Expect(
        [str(ck / "config.json")],
        "exists|not empty|not a directory",
        args=["gen", *SOURCES["sharded"], "--out", str(ck / "config.json")],
    )


@case("gen-unknown-set-key", cli=True)
def _(sandbox, ck):
    return Expect(
        ["no_such_knob"], "unknown", args=["gen", *FP8, "--set", "no_such_knob=3", "--out", str(sandbox / "new")]
    )


@case("gen-set-without-value")
def _(sandbox, ck):
    return Expect(
        ["hidden_size"], "KEY=VALUE", args=["gen", *FP8, "--set", "hidden_size", "--out", str(sandbox / "new")]
    )


@case("gen-set-bad-choice")
def _(sandbox, ck):
    return Expect(
        ["nonfinite_scale"],
        "expected one of",
        args=["gen", *FP8, "--set", "nonfinite_scale=sometimes", "--out", str(sandbox / "new")],
    )


@case("gen-unknown-format", cli=True)
def _(sandbox, ck):
    return Expect(
        ["exl2"], "unknown format", args=["gen", "--format", "exl2", "--arch", "llama", "--out", str(sandbox / "new")]
    )


@case("gen-read-only-format", cli=True)
def _(sandbox, ck):
    return Expect(
        ["mixed-precision"],
        "is read, not written",
        args=["gen", "--format", "mixed-precision", "--arch", "llama", "--out", str(sandbox / "new")],
    )


@case("gen-unknown-arch", cli=True)
def _(sandbox, ck):
    return Expect(
        ["mamba"],
        "unknown arch",
        args=["gen", "--format", "fp8-block", "--arch", "mamba", "--out", str(sandbox / "new")],
    )


# --- running them ------------------------------------------------------------------------------------------


@dataclass
class Result:
    expect: Expect
    sandbox: Path
    process: subprocess.CompletedProcess | None = None
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)


@dataclass
class Results:
    cases: dict[str, Result]
    beside_before: list[str]
    beside_after: list[str]


def selected_cases(request) -> list[str]:
    """The cases this session runs (all of them unless deselected, e.g. with -k)."""
    names = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec and "name" in callspec.params:
            names.add(callspec.params["name"])
    return sorted(names)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> Results:
    names = selected_cases(request)
    sources_dir = tmp_path_factory.mktemp("sources")
    for source in sorted({CASES[n].source for n in names}):
        process = run_main(["gen", *SOURCES[source], "--out", str(sources_dir / source)])
        assert process.returncode == 0, f"gen {source} failed: {process}"

    root = tmp_path_factory.mktemp("cases")
    prepared = {}
    for name in names:
        sandbox = root / name
        (sandbox / "out").mkdir(parents=True)
        ck = sandbox / "checkpoint"
        shutil.copytree(sources_dir / CASES[name].source, ck, symlinks=True)
        expect = CASES[name].damage(sandbox, ck)
        expect.args = expect.args or dequant_args(sandbox, ck)
        prepared[name] = Result(expect, sandbox, before=snapshot(sandbox))
    beside_before = sorted(os.listdir(root.parent)) + sorted(os.listdir(root))
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        running = {
            name: pool.submit(run_cli, result.expect.args, result.sandbox)
            for name, result in prepared.items()
            if CASES[name].cli
        }
        for name, result in prepared.items():
            if not CASES[name].cli:
                result.process = run_main(result.expect.args)
        for name, future in running.items():
            prepared[name].process = future.result()
    for result in prepared.values():
        result.after = snapshot(result.sandbox)
    beside_after = sorted(os.listdir(root.parent)) + sorted(os.listdir(root))
    return Results(prepared, beside_before, beside_after)


def describe(result: Result) -> str:
    process = result.process
    if process is None:
        return f"hung: no exit within {TIMEOUT_S} s"
    return f"rc={process.returncode}\nstdout={process.stdout!r}\nstderr={process.stderr!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_in_one_line(name, results):
    result = results.cases[name]
    expect, process = result.expect, result.process
    assert process is not None, describe(result)
    if expect.may_succeed and process.returncode == 0:
        added = set(result.after) - set(result.before)
        assert added == {os.path.join("out", "w.safetensors")}, f"wrote {sorted(added)}"
        return
    assert process.returncode == 2, describe(result)
    assert "Traceback" not in process.stderr, describe(result)
    lines = process.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip() and process.stderr.endswith("\n"), describe(result)
    message = lines[0]
    assert not message.startswith("internal error"), f"an unhandled exception, not a refusal: {message}"
    for needed in expect.names:
        assert needed in message, f"the message does not name {needed!r}: {message}"
    assert re.search(expect.problem, message, re.IGNORECASE), f"the message does not say /{expect.problem}/: {message}"
    assert result.after == result.before, (
        f"the sandbox changed: added {sorted(set(result.after) - set(result.before))}, "
        f"removed {sorted(set(result.before) - set(result.after))}, "
        f"modified {sorted(k for k in result.before if k in result.after and result.before[k] != result.after[k])}"
    )


def test_nothing_written_beside_the_sandboxes(results):
    assert results.beside_after == results.beside_before
