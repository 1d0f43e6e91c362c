"""The oracle: dequantize any checkpoint of a supported format from the format's definition.

float64 throughout; the same code runs on any torch device. It trusts nothing in the
checkpoint: files are checked by `Checkpoint`, tensors by the format's `dequantize`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from harness.checkpoints.model_layout import fused_experts
from harness.checkpoints.reader import Checkpoint
from harness.core.errors import CheckpointError, UnsupportedCheckpoint, UnsupportedFormat
from harness.formats import detect_format
from harness.formats.base import FormatError, QuantFormat

#: safetensors dtypes a quantized weight is stored in: a module whose weight is one of these is
#: quantized whatever else the checkpoint says (its scale may be missing or renamed: refused)
QUANTIZED_STORAGE = ("F8_E4M3", "F8_E5M2", "U8", "I8", "I32")


def group_modules(
    names: list[str], fmt: QuantFormat, storage: Mapping[str, str] | None = None
) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Split tensor names into quantized modules (module -> suffix -> name) and plain tensors.

    A module is quantized when it has the format's marker tensor, or when `storage` (tensor name
    -> safetensors dtype) shows its weight stored quantized: a weight without its scale is then a
    module the format cannot dequantize, not a plain tensor."""
    modules: dict[str, dict[str, str]] = {}
    stored = fmt.suffixes[0] if fmt.suffixes else ""
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix == fmt.marker or (suffix == stored and (storage or {}).get(name) in QUANTIZED_STORAGE):
            modules[module] = {}
    plain = []
    for name in names:
        module, _, suffix = name.rpartition(".")
        if module in modules and suffix in fmt.suffixes:
            modules[module][suffix] = name
        else:
            plain.append(name)
    return modules, plain


def dequantize_checkpoint(
    directory: str | Path, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, float64 tensor) for every weight: quantized Linears dequantized under
    `<module>.weight`, everything else (biases, norms, embeddings) as stored; scale tensors
    are consumed, not yielded."""
    checkpoint = Checkpoint(directory)
    fmt, knobs = format_and_knobs(checkpoint)
    modules, plain = group_modules(checkpoint.names(), fmt, checkpoint.storage_dtypes())
    for module, parts in sorted(modules.items()):  # the order dequantized_names gives
        tensors = {suffix: checkpoint.tensor(name).to(device) for suffix, name in parts.items()}
        try:
            own, own_knobs = fmt.for_module(module, knobs, tensors)
            weight = own.dequantize(tensors, own_knobs)
        except FormatError as error:
            shard = checkpoint.shard_of(parts.get(fmt.marker, next(iter(parts.values()))))
            raise CheckpointError(shard, f"{module}: {error}") from None
        yield f"{module}.weight", weight
    for name in plain:
        yield name, checkpoint.tensor(name).to(device=device, dtype=torch.float64)


def dequantized_names(directory: str | Path) -> list[str]:
    """The names dequantize_checkpoint yields, in its order, without computing anything."""
    checkpoint = Checkpoint(directory)
    modules, plain = group_modules(checkpoint.names(), format_and_knobs(checkpoint)[0], checkpoint.storage_dtypes())
    return [f"{module}.weight" for module in sorted(modules)] + plain


def format_and_knobs(source: str | Path | Checkpoint) -> tuple[QuantFormat, dict]:
    """The checkpoint's format and the parameters its dequantizer needs, from config.json; a layout
    no format reads (a mixture's experts stored fused under transformers 5's in-memory names,
    model_layout.fused_experts, from the tensor names) is unsupported here, before any format."""
    checkpoint = source if isinstance(source, Checkpoint) else Checkpoint(source)
    fused = fused_experts(checkpoint.config, checkpoint.names())
    if fused:
        raise UnsupportedCheckpoint(checkpoint.directory / "config.json", fused)
    try:
        fmt = detect_format(checkpoint.quantization_config)
        return fmt, fmt.knobs_from_config(checkpoint.quantization_config)
    except UnsupportedFormat as error:
        raise UnsupportedCheckpoint(checkpoint.directory / "config.json", str(error)) from None
    except FormatError as error:
        raise CheckpointError(checkpoint.directory / "config.json", str(error)) from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as error:
        raise CheckpointError(
            checkpoint.directory / "config.json", f"malformed quantization_config ({type(error).__name__}: {error})"
        ) from None
