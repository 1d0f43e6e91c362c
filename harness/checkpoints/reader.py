"""Reading a checkpoint directory defensively: every file is checked before it is trusted.

Refused with a one-line CheckpointError naming the file: a missing, truncated or
non-regular file, a file (or symlink) that leads outside the checkpoint directory, an
absurd or malformed safetensors header, a tensor whose bytes do not fit the file, JSON
that is not JSON. Nothing here reads a byte outside the directory it was given, and
nothing reads an unbounded amount: JSON files and safetensors headers are size-capped
before they are read, and only regular files are opened (never a FIFO or a device).
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from harness.checkpoints.architectures import CONFIG_INTEGERS
from harness.checkpoints.packed_experts import expert_views
from harness.core.errors import CheckpointError, UnsupportedCheckpoint, UnsupportedFormat

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
MAX_JSON_BYTES = 64 * 2**20

#: bytes per element of each safetensors dtype this reader accepts (sub-byte dtypes are refused)
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _regular_file(path: Path, what: str) -> os.stat_result:
    """stat() a file that must exist and be a regular file (following symlinks)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise CheckpointError(path, f"{what} is a dangling symlink") from None
        raise CheckpointError(path, f"{what} not found") from None
    except OSError as error:  # a symlink loop, a permission problem, a name too long
        raise CheckpointError(path, f"{what} cannot be read ({error.strerror or error})") from None
    if stat.S_ISDIR(info.st_mode):
        raise CheckpointError(path, f"{what} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(path, f"{what} is not a regular file")
    return info


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object hook that refuses a key given twice: parsers disagree on which one wins (Python's
    and serde's keep the last, others the first), so an engine may read a different tensor."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"duplicate key {ascii(key)}")
        found[key] = value
    return found


#: a JSON escape of a UTF-16 surrogate: json.loads turns a lone one into a str no file system or
#: terminal can encode (a pair becomes one valid character)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) holding a lone surrogate, in ascii() form, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return ascii(item)[:80]
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _parse_json(data: bytes) -> Any:
    """json.loads, with every way it can fail (bad UTF, bad syntax, deep nesting, huge ints, a
    duplicate key, a string that is not Unicode text) as ValueError."""
    try:
        value = json.loads(data, object_pairs_hook=_unique_keys)
        if _SURROGATE_ESCAPE.search(data):
            bad = _lone_surrogate(value)
            if bad:
                raise ValueError(f"a string with a lone UTF-16 surrogate, not text: {bad}")
        return value
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8: {error.reason} at byte {error.start}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{error.msg}: line {error.lineno} column {error.colno}") from None
    except ValueError as error:  # e.g. an integer with more digits than Python converts
        raise ValueError(str(error).splitlines()[0] if str(error) else type(error).__name__) from None


def read_json(path: Path, what: str) -> Any:
    """A JSON file, refused if missing, not a regular file, over MAX_JSON_BYTES or not JSON."""
    path = Path(path)
    info = _regular_file(path, what)
    if info.st_size > MAX_JSON_BYTES:
        raise CheckpointError(path, f"{what} is {info.st_size} bytes, larger than the {MAX_JSON_BYTES} allowed")
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
    except OSError as error:
        raise CheckpointError(path, f"{what} cannot be read ({error.strerror or error})") from None
    if len(data) > MAX_JSON_BYTES:  # the file grew since stat()
        raise CheckpointError(path, f"{what} is larger than the {MAX_JSON_BYTES} bytes allowed")
    try:
        return _parse_json(data)
    except ValueError as error:
        raise CheckpointError(path, f"{what} is not valid JSON ({error})") from None


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header without trusting it; tensor name -> entry.

    Checks what the safetensors library would refuse later, so that the refusal names the
    tensor and happens before anything is computed: the header length against the file,
    the entries' form, dtype and shape against their byte range, and that the byte ranges
    tile the data section exactly (no overlap, no hole, nothing past the end).
    """
    path = Path(path)
    size = _regular_file(path, "safetensors file").st_size
    raw = _read_header_bytes(path, size)
    header = _parse_header(path, raw)
    data_size = size - 8 - len(raw)
    ranges = [(*_entry_range(path, name, entry, data_size), name) for name, entry in header.items()]
    _check_tiling(path, ranges, data_size)
    return header


def _read_header_bytes(path: Path, size: int) -> bytes:
    """The header's bytes, once its length field is checked against the file's `size`."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(path, f"truncated: {size} bytes, not even a header length")
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length > MAX_HEADER_BYTES:
                raise CheckpointError(
                    path,
                    f"header length {header_length} is absurd (the limit is "
                    f"{MAX_HEADER_BYTES}; the file has {size} bytes)",
                )
            if header_length > size - 8:
                raise CheckpointError(
                    path,
                    f"truncated: header length {header_length} exceeds the {size - 8} bytes after the length field",
                )
            raw = handle.read(header_length)
    except OSError as error:
        raise CheckpointError(path, f"cannot be read ({error.strerror or error})") from None
    if len(raw) != header_length:  # the file shrank since stat()
        raise CheckpointError(path, f"truncated: header of {header_length} bytes, {len(raw)} read")
    return raw


def _parse_header(path: Path, raw: bytes) -> dict:
    """The header as a JSON object, its `__metadata__` (a map of strings) checked and removed."""
    try:
        header = _parse_json(raw)
    except ValueError as error:
        raise CheckpointError(path, f"header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(path, "header __metadata__ is not a map of strings")
    return header


def _entry_range(path: Path, name: str, entry: object, data_size: int) -> tuple[int, int]:
    """Tensor `name`'s byte range, once its entry's form, dtype and shape agree with it and it
    lies within the `data_size` data bytes."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(path, f"tensor {name!r} has a malformed header entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CheckpointError(path, f"tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(path, f"tensor {name!r} has an invalid shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    start, end = offsets
    count = 1
    for dim in shape:
        count *= dim
    if end - start != count * DTYPE_BYTES[dtype]:
        raise CheckpointError(
            path,
            f"tensor {name!r} data_offsets {offsets} hold {end - start} bytes "
            f"but shape {shape} {dtype} needs {count * DTYPE_BYTES[dtype]}",
        )
    if end > data_size:
        raise CheckpointError(
            path,
            f"truncated: tensor {name!r} data_offsets {offsets} extend past the {data_size} data bytes in the file",
        )
    return start, end


def _check_tiling(path: Path, ranges: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors' byte ranges tile the data section exactly: no overlap, no hole, no leftover."""
    position = 0
    for start, end, name in sorted(ranges):
        if start != position:
            problem = "overlaps another tensor" if start < position else f"leaves a gap at byte {position}"
            raise CheckpointError(path, f"tensor {name!r} data_offsets {[start, end]} {problem}")
        position = end
    if position != data_size:
        raise CheckpointError(path, f"{data_size - position} bytes after the last tensor belong to none")


def _in_hub_cache_blobs(directory: Path, target: Path) -> bool:
    """A Hugging Face cache snapshot (`models--org--name/snapshots/<rev>/`) links its files to
    `models--org--name/blobs/`: those blobs are the snapshot's own content."""
    absolute = Path(os.path.abspath(directory))
    if absolute.parent.name != "snapshots" or not absolute.parent.parent.name.startswith("models--"):
        return False
    blobs = absolute.parent.parent / "blobs"
    return blobs.is_dir() and target.is_relative_to(blobs.resolve())


def contained_file(directory: Path, name: Any, what: str, referrer: Path | None = None) -> Path:
    """A regular file named by the checkpoint itself, refused if the name (or a symlink on
    the way) leads outside the directory. `referrer` is the file that named it (the index
    by default) and is blamed for a bad name."""
    directory = Path(directory)
    referrer = directory / INDEX_FILE if referrer is None else Path(referrer)
    if not isinstance(name, str) or not name or any(ord(c) < 32 for c in name):
        raise CheckpointError(referrer, f"{what} {name!r} is not a file name")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(referrer, f"{what} {name!r} escapes the checkpoint directory")
    path = directory / name
    try:
        real_directory = directory.resolve(strict=True)
        real_path = path.resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop (Python < 3.13)
        raise CheckpointError(path, f"{what} cannot be resolved ({error})") from None
    if not (real_path.is_relative_to(real_directory) or _in_hub_cache_blobs(directory, real_path)):
        raise CheckpointError(path, f"{what} {name!r} is a symlink to {real_path}, outside the checkpoint directory")
    _regular_file(path, what)
    return path


#: config.json fields every engine reads as names (CONFIG_INTEGERS: as positive integers); null counts as absent
CONFIG_STRINGS = ("model_type", "dtype", "torch_dtype")


def config_problems(config: dict) -> list[str]:
    """Fields of config.json with a type no engine can use (`hidden_size` as a string, a
    `quantization_config` that is a list), each as one line; [] when every present field fits."""
    problems = []
    for key in CONFIG_INTEGERS:
        value = config.get(key)
        if value is not None and not (_is_int(value) and value > 0):
            problems.append(f"config.json {key} is {_shown(value)}, not a positive integer")
    for key in CONFIG_STRINGS:
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            problems.append(f"config.json {key} is {_shown(value)}, not a string")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        problems.append(f"config.json quantization_config is {_shown(quant)}, not a JSON object")
    return problems


def _shown(value: Any) -> str:
    """A JSON value, shortened for a one-line message."""
    text = ascii(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def read_config(path: Path) -> Any:
    """config.json, its quantization_config's enum-valued fields in their producers' case (the
    formats' own readers compare them without case: harness.formats.spelling)."""
    from harness.formats.spelling import canonical

    config = read_json(path, CONFIG_FILE)
    if isinstance(config, dict) and isinstance(config.get("quantization_config"), dict):
        config["quantization_config"] = canonical(config["quantization_config"])
    return config


class Checkpoint:
    """A checkpoint directory: config.json, and tensors in one file or shards behind an index."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(self.directory, "not a directory" if self.directory.exists() else "not found")
        config_path = contained_file(self.directory, CONFIG_FILE, CONFIG_FILE, referrer=self.directory)
        self.config: dict = read_config(config_path)
        if not isinstance(self.config, dict):
            raise CheckpointError(config_path, "config.json is not a JSON object")
        problems = config_problems(self.config)
        if problems:
            raise CheckpointError(config_path, problems[0])
        self.weight_map = self._resolve_weight_map()
        self.headers = {path: read_safetensors_header(path) for path in sorted(set(self.weight_map.values()))}
        for name, path in self.weight_map.items():
            if name not in self.headers[path]:
                raise CheckpointError(path, f"the index places tensor {name!r} here but the shard lacks it")
        #: experts stored packed (gpt-oss): served one expert at a time under per-expert names
        self.views = expert_views({n: self.headers[p][n].get("shape", []) for n, p in self.weight_map.items()})
        self._packed = {view.stored for view in self.views.values()}

    def _resolve_weight_map(self) -> dict[str, Path]:
        index_path = self.directory / INDEX_FILE
        if index_path.exists() or index_path.is_symlink():
            index_path = contained_file(self.directory, INDEX_FILE, "index", referrer=self.directory)
            index = read_json(index_path, "index")
            if not isinstance(index, dict):
                raise CheckpointError(index_path, "index is not a JSON object")
            weight_map = index.get("weight_map")
            if weight_map is None:
                raise CheckpointError(index_path, "index has no weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(index_path, "index weight_map is not a JSON object")
            if not weight_map:
                raise CheckpointError(index_path, "index weight_map is empty")
            shards = {}
            for shard in weight_map.values():
                if not isinstance(shard, str):
                    raise CheckpointError(index_path, f"index weight_map names shard {shard!r}, not a file name")
                if shard not in shards:
                    shards[shard] = contained_file(self.directory, shard, "shard", referrer=index_path)
            return {tensor: shards[shard] for tensor, shard in weight_map.items()}
        if not (self.directory / SINGLE_FILE).exists() and not (self.directory / SINGLE_FILE).is_symlink():
            raise CheckpointError(self.directory, f"neither {INDEX_FILE} nor {SINGLE_FILE} found")
        single = contained_file(self.directory, SINGLE_FILE, SINGLE_FILE, referrer=self.directory)
        header = read_safetensors_header(single)
        if not header:
            raise CheckpointError(single, "holds no tensors")
        return {name: single for name in header}

    @property
    def quantization_config(self) -> dict:
        """config.json's `quantization_config`; {} where it has none (an unquantized checkpoint,
        harness.formats.unquantized)."""
        config = self.config.get("quantization_config")
        if config is None:  # absent or null, as transformers reads both
            return {}
        if not isinstance(config, dict):
            raise CheckpointError(self.directory / CONFIG_FILE, "config.json quantization_config is not a JSON object")
        return config

    def names(self) -> list[str]:
        """Every tensor's name, a packed expert tensor's as one name per expert."""
        return sorted([n for n in self.weight_map if n not in self._packed] + list(self.views))

    @functools.cached_property
    def unlisted(self) -> dict[str, Path]:
        """Tensors a shard the index names stores under a name the index does not list (what a
        loader that reads every tensor of every file it opens finds): name -> shard. A stale copy of
        a listed name is not one."""
        return {
            name: path
            for path, header in self.headers.items()
            for name in header
            if name != "__metadata__" and name not in self.weight_map
        }

    def storage_dtypes(self) -> dict[str, str]:
        """Tensor name -> its safetensors dtype (e.g. "F8_E4M3"), from the headers alone."""
        return {name: self.headers[self.shard_of(name)][self._stored(name)]["dtype"] for name in self.names()}

    def _stored(self, name: str) -> str:
        view = self.views.get(name)
        return view.stored if view else name

    def shard_of(self, name: str) -> Path:
        stored = self._stored(name)
        return self.weight_map[stored] if stored in self.weight_map else self.unlisted[stored]

    def tensor(self, name: str) -> torch.Tensor:
        path = self.shard_of(name)
        try:
            with safe_open(str(path), framework="pt") as handle:
                return self._read(handle, name)
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(path, f"cannot read tensor {name!r}: {_one_line(error)}") from None

    def _read(self, handle, name: str) -> torch.Tensor:
        view = self.views.get(name)
        if view is None:
            return handle.get_tensor(name)
        return handle.get_slice(view.stored)[view.expert].reshape(view.shape)  # that expert's bytes only

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """All tensors, shard by shard, each shard opened once."""
        by_shard: dict[Path, list[str]] = {}
        for name in self.names():
            by_shard.setdefault(self.shard_of(name), []).append(name)
        for path, names in sorted(by_shard.items()):
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as error:
                raise CheckpointError(path, f"cannot open: {_one_line(error)}") from None
            with handle:
                for name in sorted(names):
                    try:
                        tensor = self._read(handle, name)
                    except Exception as error:
                        raise CheckpointError(path, f"cannot read tensor {name!r}: {_one_line(error)}") from None
                    yield name, tensor


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


@dataclass(frozen=True)
class Hazard:
    """Something in a checkpoint's layout that makes a loader read outside its directory, or read
    an unbounded header: what `compare --hostile` then watches each engine for."""

    kind: str  # "escape" (an index entry leaves the directory), "symlink-out", "header-bomb"
    file: str  # the name the checkpoint uses for it
    detail: str  # where it leads, or the header length it declares
    tensors: tuple[str, ...] = ()  # the tensors the index places there; () for a file nothing lists

    def describe(self) -> str:
        if self.kind == "header-bomb":
            return f"{self.file} declares a {self.detail}-byte header (the limit is {MAX_HEADER_BYTES})"
        how = "index entry" if self.kind == "escape" else "symlink"
        return f"{how} {ascii(self.file)} leads to {self.detail}"


def hostile_layout(directory: str | Path) -> list[Hazard]:
    """The hazards of a checkpoint's layout, found without reading a byte outside the directory
    (names are resolved, never opened; headers are judged by their 8-byte length field)."""
    directory = Path(directory)
    real = directory.resolve()
    hazards: list[Hazard] = []
    listed: dict[str, list[str]] = {}
    index_path = directory / INDEX_FILE
    if index_path.is_symlink() and not index_path.resolve().is_relative_to(real):
        hazards.append(Hazard("symlink-out", INDEX_FILE, str(index_path.resolve())))
    elif index_path.is_file():
        try:
            index = read_json(index_path, "index")
        except CheckpointError:
            index = None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        for tensor, shard in (weight_map if isinstance(weight_map, dict) else {}).items():
            if isinstance(shard, str) and shard:
                listed.setdefault(shard, []).append(tensor)
    names = set(listed) | {p.name for p in directory.glob("*.safetensors")} | {CONFIG_FILE}
    for name in sorted(names):
        hazard = _hazard_of(directory, real, name, tuple(sorted(listed.get(name, ()))))
        if hazard:
            hazards.append(hazard)
    return hazards


def _hazard_of(directory: Path, real: Path, name: str, tensors: tuple[str, ...]) -> Hazard | None:
    path = directory / name
    try:
        target = path.resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return Hazard("escape", name, str(target), tensors)
    if not (target.is_relative_to(real) or _in_hub_cache_blobs(directory, target)):
        return Hazard("symlink-out", name, str(target), tensors)
    if not name.endswith(".safetensors"):
        return None
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        with path.open("rb") as handle:
            prefix = handle.read(8)
    except OSError:
        return None
    if len(prefix) == 8 and struct.unpack("<Q", prefix)[0] > MAX_HEADER_BYTES:
        return Hazard("header-bomb", name, str(struct.unpack("<Q", prefix)[0]), tensors)
    return None


def declared_format(directory: str | Path) -> tuple[Any, dict]:
    """The format and knobs config.json declares, read from config.json alone (contained, size-capped),
    without trusting or reading the tensor files: what an engine wrapper needs to interpret what
    its engine holds, so that the engine itself meets the layout (`compare --hostile`)."""
    from harness.formats import detect_format
    from harness.formats.base import FormatError

    config_path = contained_file(Path(directory), CONFIG_FILE, CONFIG_FILE, referrer=Path(directory))
    config = read_config(config_path)
    if not isinstance(config, dict):
        raise CheckpointError(config_path, "config.json is not a JSON object")
    quant = config.get("quantization_config")
    quant = {} if quant is None else quant  # absent or null: an unquantized checkpoint
    if not isinstance(quant, dict):
        raise CheckpointError(config_path, "config.json quantization_config is not a JSON object")
    try:
        fmt = detect_format(quant)
        return fmt, fmt.knobs_from_config(quant)
    except UnsupportedFormat as error:
        raise UnsupportedCheckpoint(config_path, str(error)) from None
    except FormatError as error:
        raise CheckpointError(config_path, str(error)) from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as error:
        raise CheckpointError(config_path, f"malformed quantization_config ({type(error).__name__}: {error})") from None
