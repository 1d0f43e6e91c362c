"""Reading a generated checkpoint's manifest and ground truth."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from harness.checkpoints.reader import read_json
from harness.checkpoints.writer import MANIFEST_FILE
from harness.core.errors import HarnessError


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise HarnessError(f"{path}: no harness manifest (not a checkpoint written by `gen`)")
    return read_json(path, "manifest")


def read_truth(directory: str | Path, manifest: dict | None = None) -> dict[str, torch.Tensor]:
    manifest = manifest or read_manifest(directory)
    return load_file(str(Path(directory) / manifest["truth_file"]))
