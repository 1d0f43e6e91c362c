"""Reading a checkpoint directory defensively: every file is checked before it is trusted.

Refused with a one-line CheckpointError: a missing or truncated shard, an index entry that
escapes the directory, an absurd safetensors header, a tensor whose bytes do not fit.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from harness.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
MAX_JSON_BYTES = 64 * 2**20

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}


def read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise CheckpointError(path, f"{what} not found")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(path, f"{what} is larger than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"{what} is not valid JSON ({error})") from None


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header without trusting it; tensor name -> entry."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(path, f"truncated: {size} bytes, not even a header length")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > MAX_HEADER_BYTES or header_length > size - 8:
            raise CheckpointError(path, f"header length {header_length} is absurd for a file of {size} bytes")
        raw = handle.read(header_length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(path, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_length
    for name, entry in header.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = 1
            for dim in shape:
                count *= int(dim)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(path, f"tensor '{name}' has a malformed header entry") from None
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(path, f"tensor '{name}' has unsupported dtype {dtype}")
        if not (0 <= start <= end) or end - start != count * DTYPE_BYTES[dtype]:
            raise CheckpointError(path, f"tensor '{name}' offsets {[start, end]} do not match shape {shape} {dtype}")
        if end > data_size:
            raise CheckpointError(path, f"truncated: tensor '{name}' ends at byte {end} of {data_size} data bytes")
    return header


def contained_file(directory: Path, name: Any, what: str) -> Path:
    """A file named by the checkpoint itself; refused if the name leaves the directory."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(directory / INDEX_FILE, f"{what} {name!r} escapes the checkpoint directory")
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(directory / INDEX_FILE, f"{what} {name!r} escapes the checkpoint directory")
    if not path.is_file():
        raise CheckpointError(path, f"{what} is missing")
    return path


class Checkpoint:
    """A checkpoint directory: config.json, and tensors in one file or shards behind an index."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(self.directory, "not a directory")
        self.config: dict = read_json(self.directory / "config.json", "config.json")
        if not isinstance(self.config, dict):
            raise CheckpointError(self.directory / "config.json", "config.json is not a JSON object")
        self.weight_map = self._resolve_weight_map()
        self.headers = {path: read_safetensors_header(path) for path in sorted(set(self.weight_map.values()))}
        for name, path in self.weight_map.items():
            if name not in self.headers[path]:
                raise CheckpointError(path, f"the index places tensor '{name}' here but the shard lacks it")

    def _resolve_weight_map(self) -> dict[str, Path]:
        index_path = self.directory / INDEX_FILE
        if index_path.exists():
            index = read_json(index_path, "index")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(index_path, "index has no weight_map")
            shards = {name: contained_file(self.directory, name, "shard") for name in set(weight_map.values())}
            return {tensor: shards[shard] for tensor, shard in weight_map.items()}
        single = self.directory / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(self.directory, f"neither {INDEX_FILE} nor {SINGLE_FILE} found")
        return {name: single for name in read_safetensors_header(single)}

    @property
    def quantization_config(self) -> dict:
        config = self.config.get("quantization_config")
        if not isinstance(config, dict):
            raise CheckpointError(self.directory / "config.json", "config.json has no quantization_config")
        return config

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def shard_of(self, name: str) -> Path:
        return self.weight_map[name]

    def tensor(self, name: str) -> torch.Tensor:
        path = self.weight_map[name]
        try:
            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(path, f"cannot read tensor '{name}': {error}") from None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """All tensors, shard by shard, each shard opened once."""
        by_shard: dict[Path, list[str]] = {}
        for name, path in self.weight_map.items():
            by_shard.setdefault(path, []).append(name)
        for path, names in sorted(by_shard.items()):
            with safe_open(str(path), framework="pt") as handle:
                for name in sorted(names):
                    yield name, handle.get_tensor(name)
