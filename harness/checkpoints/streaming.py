"""Write a .safetensors file one tensor at a time: memory holds one tensor, never the whole file.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte offsets into the data that follows), then the tensors' bytes back to back. The names are
known before the values, so the header's room is reserved up front from a bound on each entry's
length; data is written after that room as each tensor arrives, and the header goes in last,
padded with spaces (the format allows trailing whitespace) to the room reserved.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: an entry's length beyond its quoted name: dtype, up to 8 dimensions and 2 offsets of 20 digits each
ENTRY_BOUND = len('{"dtype":"F8_E4M3","shape":[],"data_offsets":[,]},') + 8 * 21 + 2 * 20 + 8
ALIGNMENT = 8  # the data starts on an 8-byte boundary, as safetensors' own writer does


class StreamingSafetensorsWriter:
    """`with StreamingSafetensorsWriter(path, names) as writer: writer.add(name, tensor)`, once per name."""

    def __init__(self, path: str | Path, names: list[str], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.expected = list(dict.fromkeys(names))
        self.metadata = metadata or {}
        self.entries: dict[str, dict] = {}
        self.offset = 0
        bound = sum(len(json.dumps(name)) + ENTRY_BOUND for name in self.expected)
        bound += len(json.dumps({"__metadata__": self.metadata})) + 2
        self.room = -(-bound // ALIGNMENT) * ALIGNMENT
        self.file = self.path.open("wb")
        self.file.seek(8 + self.room)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.entries or name not in self.expected:
            raise ValueError(f"{name}: {'written twice' if name in self.entries else 'not among the names declared'}")
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(data))
        self.entries[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.offset, self.offset + data.nbytes],
        }
        self.offset += data.nbytes

    def close(self) -> None:
        """Write the header; every declared name must have been added."""
        try:
            missing = [name for name in self.expected if name not in self.entries]
            if missing:
                raise ValueError(f"{len(missing)} declared tensor(s) never written, e.g. {missing[0]}")
            header = json.dumps(
                ({"__metadata__": self.metadata} if self.metadata else {}) | self.entries, separators=(",", ":")
            ).encode()
            if len(header) > self.room:  # cannot happen with ENTRY_BOUND; never write a corrupt file
                raise ValueError(f"header of {len(header)} bytes exceeds the {self.room} reserved")
            self.file.seek(0)
            self.file.write(struct.pack("<Q", self.room) + header + b" " * (self.room - len(header)))
        finally:
            self.file.close()

    def abort(self) -> None:
        self.file.close()

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
