"""harness.checkpoints.reader: safetensors header checks, JSON reading, containment, single file vs index."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from harness.checkpoints import reader as ckpt
from harness.checkpoints.reader import (
    INDEX_FILE,
    SINGLE_FILE,
    Checkpoint,
    contained_file,
    read_json,
    read_safetensors_header,
)
from harness.core.errors import CheckpointError, HarnessError

TENSORS = {
    "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b": torch.tensor([1, 2, 3], dtype=torch.int8),
    "c": torch.ones(4, dtype=torch.bfloat16),
}


def raw_file(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def refusal(call, *args) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message and message.strip()
    assert isinstance(info.value, HarnessError)
    return info.value


# --- read_safetensors_header --------------------------------------------------------------------------------


def test_header_of_a_valid_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    header = read_safetensors_header(path)
    assert set(header) == {"a", "b", "c"}  # __metadata__ is not a tensor
    assert header["a"]["dtype"] == "F32" and header["a"]["shape"] == [2, 3]
    assert header["b"]["dtype"] == "I8"


def test_header_of_an_empty_safetensors_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({}, str(path))
    assert read_safetensors_header(path) == {}


def test_zero_element_tensors_are_fine(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"empty": torch.zeros(0, 5), "one": torch.ones(1)}, str(path))
    assert set(read_safetensors_header(path)) == {"empty", "one"}


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_HEADERS = {
    "not json": (b"{nope", b"", "not valid JSON"),
    "not utf-8": (b"\xff\xfe\xfd", b"", "not valid JSON"),
    "nested too deeply": (b"[" * 100_000 + b"]" * 100_000, b"", "not valid JSON"),
    "huge integer": (b'{"a": ' + b"9" * 10_000 + b"}", b"", "not valid JSON"),
    "a list": (b"[]", b"", "not a JSON object"),
    "entry not an object": ({"a": [1, 2]}, b"", "malformed"),
    "entry missing a key": ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "malformed"),
    "unknown dtype": ({"a": entry(dtype="Q7")}, b"\0" * 8, "unsupported dtype"),
    "dtype not a string": ({"a": entry(dtype=["F32"])}, b"\0" * 8, "unsupported dtype"),
    "negative dim": ({"a": entry(shape=(-2, -1))}, b"\0" * 8, "invalid shape"),
    "float dim": ({"a": entry(shape=(2.0,))}, b"\0" * 8, "invalid shape"),
    "string dim": ({"a": entry(shape=("2",))}, b"\0" * 8, "invalid shape"),
    "bool dim": ({"a": entry(shape=(True, 2))}, b"\0" * 8, "invalid shape"),
    "shape not a list": ({"a": {**entry(), "shape": 2}}, b"\0" * 8, "invalid shape"),
    "three offsets": ({"a": entry(offsets=(0, 4, 8))}, b"\0" * 8, "invalid data_offsets"),
    "float offsets": ({"a": entry(offsets=(0.0, 8.0))}, b"\0" * 8, "invalid data_offsets"),
    "reversed offsets": ({"a": entry(offsets=(8, 0))}, b"\0" * 8, "invalid data_offsets"),
    "negative offsets": ({"a": entry(offsets=(-8, 0))}, b"\0" * 8, "invalid data_offsets"),
    "offsets do not match the shape": ({"a": entry(offsets=(0, 4))}, b"\0" * 4, "needs 8"),
    "offsets past the end": ({"a": entry()}, b"\0" * 4, "extend past"),
    "huge shape": ({"a": entry(shape=(2**40, 2**40), offsets=(0, 2**82))}, b"\0" * 8, "extend past"),
    "overlap": ({"a": entry(), "b": entry(offsets=(4, 12))}, b"\0" * 12, "overlaps"),
    "gap": ({"a": entry(offsets=(8, 16))}, b"\0" * 16, "gap"),
    "trailing bytes": ({"a": entry()}, b"\0" * 12, "belong to none"),
    "metadata not a map of strings": ({"__metadata__": {"x": 1}, "a": entry()}, b"\0" * 8, "__metadata__"),
}


@pytest.mark.parametrize("header, data, problem", list(BAD_HEADERS.values()), ids=list(BAD_HEADERS))
def test_bad_headers_are_refused_naming_the_file(tmp_path, header, data, problem):
    path = raw_file(tmp_path / "bad.safetensors", header, data)
    error = refusal(read_safetensors_header, path)
    assert error.path == str(path)
    assert problem in error.problem


@pytest.mark.parametrize("length", [2**60, 2**64 - 1, ckpt.MAX_HEADER_BYTES + 1])
def test_absurd_header_length(tmp_path, length):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", length) + b"{}")
    assert "absurd" in refusal(read_safetensors_header, path).problem


def test_header_length_just_past_the_end(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(TENSORS, str(path))
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) - 7)
    path.write_bytes(bytes(raw))
    assert "truncated" in refusal(read_safetensors_header, path).problem


@pytest.mark.parametrize("keep", [0, 3, 7, 8, 20])
def test_truncated_inside_the_header(tmp_path, keep):
    path = tmp_path / "x.safetensors"
    save_file(TENSORS, str(path))
    path.write_bytes(path.read_bytes()[:keep])
    assert "truncated" in refusal(read_safetensors_header, path).problem


def test_truncated_data(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(TENSORS, str(path))
    path.write_bytes(path.read_bytes()[:-1])
    assert "truncated" in refusal(read_safetensors_header, path).problem


def test_tensor_name_with_a_newline_stays_on_one_line(tmp_path):
    path = raw_file(tmp_path / "x.safetensors", {"evil\nname": entry(dtype="Q7")}, b"\0" * 8)
    assert "evil\\nname" in refusal(read_safetensors_header, path).problem


def test_header_of_a_directory_or_fifo_is_refused(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    assert "directory" in refusal(read_safetensors_header, tmp_path / "dir.safetensors").problem
    os.mkfifo(tmp_path / "pipe.safetensors")
    assert "regular file" in refusal(read_safetensors_header, tmp_path / "pipe.safetensors").problem
    assert "not found" in refusal(read_safetensors_header, tmp_path / "missing.safetensors").problem


def test_every_accepted_dtype_round_trips_through_safetensors(tmp_path):
    """DTYPE_BYTES agrees with what safetensors itself writes."""
    dtypes = [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ]
    tensors = {str(d): torch.zeros(3, 5, dtype=d) for d in dtypes}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    header = read_safetensors_header(path)
    for entry_ in header.values():
        assert entry_["dtype"] in ckpt.DTYPE_BYTES


# --- read_json ------------------------------------------------------------------------------------------------


def test_read_json(tmp_path):
    (tmp_path / "c.json").write_text('{"a": [1, 2.5, null]}')
    assert read_json(tmp_path / "c.json", "config") == {"a": [1, 2.5, None]}


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"{", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"1" * 5000, "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_read_json_refuses_non_json(tmp_path, content, problem):
    (tmp_path / "c.json").write_bytes(content)
    error = refusal(read_json, tmp_path / "c.json", "config.json")
    assert error.path == str(tmp_path / "c.json") and problem in error.problem


def test_read_json_refuses_missing_directories_fifos_and_huge_files(tmp_path, monkeypatch):
    assert "not found" in refusal(read_json, tmp_path / "none.json", "index").problem
    (tmp_path / "dir.json").mkdir()
    assert "directory" in refusal(read_json, tmp_path / "dir.json", "index").problem
    os.mkfifo(tmp_path / "pipe.json")
    assert "regular file" in refusal(read_json, tmp_path / "pipe.json", "index").problem
    (tmp_path / "big.json").write_text("[" + "0, " * 100 + "0]")
    monkeypatch.setattr(ckpt, "MAX_JSON_BYTES", 64)
    assert "larger" in refusal(read_json, tmp_path / "big.json", "index").problem


# --- contained_file -----------------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """tmp/ck/{a.safetensors, sub/b.safetensors, link-in -> a.safetensors}, tmp/outside.safetensors."""
    ck = tmp_path / "ck"
    (ck / "sub").mkdir(parents=True)
    (ck / "a.safetensors").write_bytes(b"a")
    (ck / "sub" / "b.safetensors").write_bytes(b"b")
    (ck / "link-in").symlink_to("a.safetensors")
    (tmp_path / "outside.safetensors").write_bytes(b"o")
    return ck


def test_contained_file_accepts_files_inside(tree):
    assert contained_file(tree, "a.safetensors", "shard") == tree / "a.safetensors"
    assert contained_file(tree, "sub/b.safetensors", "shard") == tree / "sub" / "b.safetensors"
    assert contained_file(tree, "./sub/b.safetensors", "shard").resolve() == (tree / "sub" / "b.safetensors").resolve()
    assert contained_file(tree, "link-in", "shard") == tree / "link-in"


def test_contained_file_works_through_a_symlinked_checkpoint_directory(tree, tmp_path):
    (tmp_path / "alias").symlink_to(tree)
    assert contained_file(tmp_path / "alias", "a.safetensors", "shard") == tmp_path / "alias" / "a.safetensors"


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd", "sub/../../ck/a.safetensors"]
)
def test_contained_file_refuses_names_that_escape(tree, name):
    error = refusal(contained_file, tree, name, "shard")
    assert error.path == str(tree / INDEX_FILE)  # the index named it: the index is at fault
    assert "escapes" in error.problem and repr(name) in error.problem


def test_contained_file_refuses_an_absolute_path_even_inside(tree):
    error = refusal(contained_file, tree, str(tree / "a.safetensors"), "shard")
    assert "escapes" in error.problem


@pytest.mark.parametrize("name", [None, 7, ["a"], "", "a\nb", "a\0b"])
def test_contained_file_refuses_non_names(tree, name):
    assert "not a file name" in refusal(contained_file, tree, name, "shard").problem


def test_contained_file_blames_the_referrer(tree):
    error = refusal(contained_file, tree, "../x", "shard", tree / "custom.json")
    assert error.path == str(tree / "custom.json")


@pytest.mark.parametrize("target", ["../outside.safetensors", "ABS", "/dev/zero"])
def test_contained_file_refuses_symlinks_leading_outside(tree, tmp_path, target):
    target = str(tmp_path / "outside.safetensors") if target == "ABS" else target
    (tree / "s.safetensors").symlink_to(target)
    error = refusal(contained_file, tree, "s.safetensors", "shard")
    assert error.path == str(tree / "s.safetensors") and "outside" in error.problem


def test_contained_file_refuses_a_directory_symlinked_outside(tree, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.safetensors").write_bytes(b"c")
    (tree / "linkdir").symlink_to(tmp_path / "elsewhere")
    assert "outside" in refusal(contained_file, tree, "linkdir/c.safetensors", "shard").problem


def test_contained_file_refuses_loops_dangling_links_missing_and_non_files(tree):
    (tree / "loop").symlink_to("loop")
    refusal(contained_file, tree, "loop", "shard")
    (tree / "dangling").symlink_to("nowhere")
    assert "dangling" in refusal(contained_file, tree, "dangling", "shard").problem
    assert "not found" in refusal(contained_file, tree, "missing.safetensors", "shard").problem
    assert "directory" in refusal(contained_file, tree, "sub", "shard").problem
    os.mkfifo(tree / "pipe")
    assert "regular file" in refusal(contained_file, tree, "pipe", "shard").problem


# --- Checkpoint ---------------------------------------------------------------------------------------------

CONFIG = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}}


def write_config(directory: Path, config=CONFIG) -> None:
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture
def single(tmp_path):
    write_config(tmp_path)
    save_file(TENSORS, str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})
    return tmp_path


@pytest.fixture
def sharded(tmp_path):
    write_config(tmp_path)
    save_file({"a": TENSORS["a"]}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "sub").mkdir()
    save_file({"b": TENSORS["b"], "c": TENSORS["c"]}, str(tmp_path / "sub" / "s2.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {"a": "s1.safetensors", "b": "sub/s2.safetensors", "c": "sub/s2.safetensors"},
    }
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    return tmp_path


def test_single_file_checkpoint(single):
    checkpoint = Checkpoint(single)
    assert checkpoint.names() == ["a", "b", "c"]
    assert checkpoint.shard_of("b") == single / SINGLE_FILE
    assert checkpoint.quantization_config == CONFIG["quantization_config"]
    for name, tensor in TENSORS.items():
        assert torch.equal(checkpoint.tensor(name), tensor)
    assert dict(checkpoint.tensors()).keys() == TENSORS.keys()


def test_sharded_checkpoint(sharded):
    checkpoint = Checkpoint(sharded)
    assert checkpoint.names() == ["a", "b", "c"]
    assert checkpoint.shard_of("a") == sharded / "s1.safetensors"
    assert checkpoint.shard_of("c") == sharded / "sub" / "s2.safetensors"
    loaded = dict(checkpoint.tensors())
    assert all(torch.equal(loaded[n], t) for n, t in TENSORS.items())


def test_the_index_wins_over_a_stray_single_file(sharded):
    save_file({"zzz": torch.ones(1)}, str(sharded / SINGLE_FILE))
    assert Checkpoint(sharded).names() == ["a", "b", "c"]


def test_a_shard_may_hold_tensors_the_index_does_not_name(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    del index["weight_map"]["c"]
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    assert Checkpoint(sharded).names() == ["a", "b"]


def test_the_index_names_a_tensor_the_shard_lacks(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    index["weight_map"]["d"] = "s1.safetensors"
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    error = refusal(Checkpoint, sharded)
    assert error.path == str(sharded / "s1.safetensors") and "'d'" in error.problem


@pytest.mark.parametrize(
    "index, problem",
    [
        ({"metadata": {}}, "no weight_map"),
        ({"weight_map": []}, "not a JSON object"),
        ({"weight_map": {}}, "empty"),
        ([], "not a JSON object"),
        ({"weight_map": {"a": 3}}, "not a file name"),
        ({"weight_map": {"a": "../s1.safetensors"}}, "escapes"),
    ],
)
def test_bad_indexes(sharded, index, problem):
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    error = refusal(Checkpoint, sharded)
    assert error.path == str(sharded / INDEX_FILE) and problem in error.problem


def test_a_missing_shard_is_named(sharded):
    (sharded / "s1.safetensors").unlink()
    error = refusal(Checkpoint, sharded)
    assert error.path == str(sharded / "s1.safetensors") and "not found" in error.problem


def test_config_problems(single):
    (single / "config.json").write_text("[]")
    assert "not a JSON object" in refusal(Checkpoint, single).problem
    write_config(single, {"model_type": "llama"})
    checkpoint = Checkpoint(single)  # no quantization_config: an unquantized checkpoint, not a refusal
    assert checkpoint.quantization_config == {}
    write_config(single, {"model_type": "llama", "quantization_config": None})  # null, as transformers reads it
    assert Checkpoint(single).quantization_config == {}
    write_config(single, {"quantization_config": "fp8"})
    assert "not a JSON object" in refusal(lambda: Checkpoint(single).quantization_config).problem
    (single / "config.json").unlink()
    assert refusal(Checkpoint, single).path == str(single / "config.json")


def test_files_symlinked_from_outside_are_refused(single, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    for name in ("config.json", SINGLE_FILE):
        (single / name).rename(outside / name)
        (single / name).symlink_to(outside / name)
        error = refusal(Checkpoint, single)
        assert error.path == str(single / name) and "outside" in error.problem
        (single / name).unlink()
        (outside / name).rename(single / name)
    Checkpoint(single)


def test_the_checkpoint_directory_itself(tmp_path):
    assert "not found" in refusal(Checkpoint, tmp_path / "none").problem
    (tmp_path / "file").write_text("x")
    assert "not a directory" in refusal(Checkpoint, tmp_path / "file").problem
    write_config(tmp_path)
    assert "neither" in refusal(Checkpoint, tmp_path).problem


def test_an_empty_single_file_is_refused(tmp_path):
    write_config(tmp_path)
    save_file({}, str(tmp_path / SINGLE_FILE))
    assert "no tensors" in refusal(Checkpoint, tmp_path).problem


def test_a_file_damaged_after_opening_is_still_a_clean_error(single):
    checkpoint = Checkpoint(single)
    raw = (single / SINGLE_FILE).read_bytes()
    (single / SINGLE_FILE).write_bytes(raw[:-4])
    error = refusal(checkpoint.tensor, "a")
    assert error.path == str(single / SINGLE_FILE)
    with pytest.raises(CheckpointError):
        dict(checkpoint.tensors())


def test_hugging_face_cache_snapshot_symlinks_into_blobs_are_accepted(tmp_path):
    """A hub cache snapshot links each file to ../../blobs/<hash>; those blobs are its content."""
    import shutil
    import subprocess
    import sys

    from harness.checkpoints.reader import Checkpoint

    source = tmp_path / "source"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "gen",
            "--format",
            "fp8-block",
            "--arch",
            "llama",
            "--out",
            str(source),
            "--set",
            "num_hidden_layers=1",
        ],
        check=True,
        capture_output=True,
    )
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(p for p in source.iterdir() if p.is_file())):
        shutil.copy(file, blobs / f"blob{index}")
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{index}")
    checkpoint = Checkpoint(snapshot)
    assert checkpoint.names() and checkpoint.tensor(checkpoint.names()[0]).numel() > 0


def test_a_tensor_the_index_leaves_out_is_found_where_engines_find_it(tmp_path):
    """index-omits-tensor: the scale is in a shard the index names for other tensors; `unlisted`
    finds it, and the fixes' reader (misreadings' predictions) reads it as the engines do."""
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate
    from harness.fixes._redequantize import QuantizedCheckpoint

    recipe = Recipe(
        format="fp8-block",
        arch="llama",
        config={"num_hidden_layers": 1},
        layout={"shards": 2},
        perturb={"disagreement": "index-omits-tensor"},
    )
    generate(recipe, tmp_path)
    checkpoint = ckpt.Checkpoint(tmp_path)
    unlisted = checkpoint.unlisted
    assert list(unlisted) == ["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" not in checkpoint.names()
    tensors = QuantizedCheckpoint.open(tmp_path).tensors("model.layers.0.mlp.down_proj")
    assert set(tensors) == {"weight", "weight_scale_inv"}
