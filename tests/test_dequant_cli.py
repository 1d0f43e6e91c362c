"""`python -m harness dequant`: the streamed file holds exactly the reference's values, and the
streaming writer refuses to leave a file that is not what was declared."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from harness.checkpoints.recipe import Recipe, apply_settings
from harness.checkpoints.streaming import DTYPE_NAMES, StreamingSafetensorsWriter
from harness.checkpoints.writer import TRUTH_FILE, generate
from harness.commands.cli import main
from harness.oracle.reference import dequantize_checkpoint, dequantized_names


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """Odd shapes, partial edge blocks, two shards, a VLM key prefix: the writer sees every layout."""
    directory = tmp_path_factory.mktemp("dequant") / "ckpt"
    recipe = apply_settings(
        Recipe(format="fp8-block", arch="qwen2", seed=3),
        ["hidden_size=200", "intermediate_size=160", "block_size=64", "shards=2", "key_prefix=model.language_model."],
    )
    generate(recipe, directory)
    return directory


@pytest.mark.parametrize("dtype", ("float64", "float32", "bfloat16"))
def test_dequant_writes_the_reference_values(sharded_checkpoint, tmp_path, dtype, capsys):
    out = tmp_path / "w.safetensors"
    assert main(["dequant", str(sharded_checkpoint), "--out", str(out), "--dtype", dtype]) == 0
    assert capsys.readouterr().out.strip().endswith(dtype)
    written = load_file(str(out))
    expected = dict(dequantize_checkpoint(sharded_checkpoint))
    assert list(written) != [] and set(written) == set(expected) == set(dequantized_names(sharded_checkpoint))
    for name, tensor in expected.items():
        assert written[name].dtype == getattr(torch, dtype)
        assert torch.equal(written[name], tensor.to(getattr(torch, dtype))), name
    assert not (tmp_path / "w.safetensors.partial").exists()


def test_float64_dequant_equals_the_generators_truth(sharded_checkpoint, tmp_path):
    """The oracle from disk equals the generator's ground truth, through the streamed file."""
    out = tmp_path / "w.safetensors"
    assert main(["dequant", str(sharded_checkpoint), "--out", str(out), "--dtype", "float64"]) == 0
    written, truth = load_file(str(out)), load_file(str(sharded_checkpoint / TRUTH_FILE))
    quantized = [name for name in written if name in truth]
    assert len(quantized) >= 7  # q, k, v, o, gate, up, down
    for name in quantized:
        assert torch.equal(written[name], truth[name].to(torch.float64)), name


def test_streamed_file_reads_like_one_safetensors_writes(tmp_path):
    tensors = {
        f"t.{dtype}": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
        for dtype in DTYPE_NAMES
        if dtype.is_floating_point
    } | {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "flags": torch.tensor([True, False])}
    path = tmp_path / "s.safetensors"
    with StreamingSafetensorsWriter(path, list(tensors), {"producer": "test"}) as writer:
        for name, tensor in reversed(tensors.items()):  # any order
            writer.add(name, tensor)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"producer": "test"}
    header_length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_length % 8 == 0
    json.loads(path.read_bytes()[8 : 8 + header_length])  # valid JSON, padding included


def test_writer_refuses_what_was_not_declared(tmp_path):
    writer = StreamingSafetensorsWriter(tmp_path / "a.safetensors", ["a", "b"])
    writer.add("a", torch.ones(2))
    with pytest.raises(ValueError, match="written twice"):
        writer.add("a", torch.ones(2))
    with pytest.raises(ValueError, match="not among the names declared"):
        writer.add("c", torch.ones(2))
    with pytest.raises(ValueError, match="never written"):
        writer.close()
    with pytest.raises(Exception):  # noqa: B017 - no header was written: not a safetensors file
        load_file(str(tmp_path / "a.safetensors"))
