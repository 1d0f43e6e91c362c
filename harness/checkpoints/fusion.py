"""Fused parts: the Linears engines fuse into one (q/k/v, gate/up, per expert) and how producers
write their scales (the recipe's `layout.fused_scales`).

- `per-part`: each part's scales from its own weights; static input scales from the one
  calibration amax (what the generators always wrote).
- `shared`: one per-tensor scale (and global scale, input scale) for the whole group, from the
  group's largest value, as llm-compressor and ModelOpt write them so that a fused kernel needs
  one scale. Written by quantizing the parts stacked by rows and splitting the rows back, so only
  formats whose scales never span rows of two parts can share (per tensor, per channel, NVFP4).
- `distinct-inputs`: per-part weight scales and static input scales that differ per part (a loader
  that fuses must merge them: the definition gives each part its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from harness.checkpoints.architectures import Architecture
from harness.formats.base import QuantizedWeight

CHOICES = ("per-part", "shared", "distinct-inputs")


def fusion_groups(arch: Architecture, settings: Mapping) -> list[tuple[str, ...]]:
    """Module names (no `.weight`) of every group of Linears engines fuse, in layer order."""
    groups = []
    for layer in range(settings["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        names = set(arch.projection_shapes(settings, layer))
        if {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} <= names:
            groups.append(tuple(f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")))
        for name in sorted(names):
            parent, _, leaf = name.rpartition(".")
            up = {"gate_proj": "up_proj", "w1": "w3"}.get(leaf)
            if up and f"{parent}.{up}" in names:
                groups.append((f"{prefix}.{name}", f"{prefix}.{parent}.{up}"))
    return groups


def shares_scales(fmt, knobs: Mapping) -> bool:
    """True when the format's scale blocks are one row or the whole tensor: parts stacked by
    rows then quantize to exactly the tensors each part would store with a shared scale."""
    probe = (4099, 4096)  # rows no block edge divides
    resolved = fmt.resolve_knobs(knobs)
    return fmt.splits_by_rows(resolved) and fmt.scale_block(resolved, probe)[0] in (1, probe[0])


def quantize_shared(
    parts: Mapping[str, torch.Tensor], quantize: Callable[[torch.Tensor], QuantizedWeight]
) -> dict[str, QuantizedWeight]:
    """Quantize the parts as one tensor stacked by rows and give each part its rows; tensors
    with one value (per-tensor scale, global scale, input scale) are the group's, shared."""
    names = list(parts)
    rows = [parts[n].shape[0] for n in names]
    whole = quantize(torch.cat([parts[n] for n in names]))
    split = {n: {} for n in names}
    for suffix, tensor in whole.tensors.items():
        if suffix == "weight_shape":  # compressed-tensors' [rows, cols] of the unpacked weight
            pieces = [torch.tensor([r, int(tensor[1])], dtype=tensor.dtype) for r in rows]
        elif tensor.numel() == 1:
            pieces = [tensor.clone() for _ in names]
        else:
            if tensor.shape[0] != sum(rows):
                raise ValueError(f"{suffix} {list(tensor.shape)} cannot be split by rows {rows}")
            pieces = torch.split(tensor, rows)
        for name, piece in zip(names, pieces, strict=True):
            split[name][suffix] = piece.contiguous()
    truths = torch.split(whole.truth, rows)
    note = f"one scale shared by the fused group {', '.join(n.rpartition('.')[2] for n in names)}"
    return {
        name: QuantizedWeight(split[name], [*whole.notes, note], truths[i].clone(), whole.expectation, parts[name])
        for i, name in enumerate(names)
    }


def input_amax(module: str, groups: list[tuple[str, ...]], amax: float) -> float:
    """`distinct-inputs`: the calibration amax of a part, 1, 1.5, 2, ... times the group's."""
    for group in groups:
        if module in group:
            return amax * (1 + 0.5 * group.index(module))
    return amax
