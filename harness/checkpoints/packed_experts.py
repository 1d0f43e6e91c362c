"""Experts stored packed on disk, as gpt-oss's release stores them, seen one expert at a time.

On disk, per sparse layer and projection (`gate_up_proj`, `down_proj`):
`…mlp.experts.{proj}_blocks` uint8 [E, N, K/32, 16] (E2M1 codes, two per byte),
`…mlp.experts.{proj}_scales` uint8 [E, N, K/32] (E8M0) and `…mlp.experts.{proj}_bias` [E, N].
Everything else in the harness (the reference dequantizer, the manifest, the truth) works per
expert: `…mlp.experts.{e}.{proj}.weight_packed` [N, K/2], `.weight_scale` [N, K/32], `.bias` [N],
which is exactly expert e's slice of the stored tensors, rows unchanged. `pack` writes the disk
layout from the per-expert tensors; `expert_views` lets the reader serve the per-expert names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

#: the suffix of a packed tensor on disk -> the per-expert tensor suffix it holds
DISK_SUFFIXES = {"_blocks": "weight_packed", "_scales": "weight_scale", "_bias": "bias"}
PER_EXPERT_SUFFIXES = {value: key for key, value in DISK_SUFFIXES.items()}
_PACKED = re.compile(r"^(?P<parent>.+\.experts)\.(?P<proj>[A-Za-z0-9_]+?)(?P<suffix>_blocks|_scales|_bias)$")
_PER_EXPERT = re.compile(r"^(?P<parent>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<suffix>[a-z_]+)$")


@dataclass(frozen=True)
class ExpertView:
    """One expert's tensor inside a packed one: `stored[expert]`, flattened to `shape`."""

    stored: str
    expert: int
    shape: tuple[int, ...]


def packed_name(name: str) -> str:
    """The disk name holding a per-expert tensor (`…experts.3.down_proj.weight_scale` ->
    `…experts.down_proj_scales`); a name that is not one is returned as it is."""
    match = _PER_EXPERT.match(name)
    if not match or match["suffix"] not in PER_EXPERT_SUFFIXES:
        return name
    return f"{match['parent']}.{match['proj']}{PER_EXPERT_SUFFIXES[match['suffix']]}"


def pack(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> the packed disk layout (blocks reshaped [N, K/32, 16]); a projection
    whose experts do not all carry the same tensors is a bug in the caller, refused by ValueError."""
    result: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        target = packed_name(name)
        if target == name:
            result[name] = tensor
            continue
        expert = int(_PER_EXPERT.match(name)["expert"])
        if target.endswith("_blocks"):
            tensor = tensor.reshape(tensor.shape[0], -1, 16)
        groups.setdefault(target, {})[expert] = tensor
    for target, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{target}: experts {sorted(experts)} are not 0..{len(experts) - 1}")
        result[target] = torch.stack([experts[e] for e in range(len(experts))])
    return result


def expert_views(shapes: Mapping[str, list[int]]) -> dict[str, ExpertView]:
    """Per-expert name -> where it lies, for every packed tensor among `shapes` (disk name ->
    shape, from the safetensors headers), for the projections stored as `_blocks`. A tensor of
    the wrong rank is left as it is stored (the reader's consumers then see a name no format claims)."""
    views = {}
    rank = {"_blocks": 4, "_scales": 3, "_bias": 2}
    quantized = {name.removesuffix("_blocks") for name, shape in shapes.items() if name.endswith("_blocks")}
    for name, shape in shapes.items():
        match = _PACKED.match(name)
        if not match or len(shape) != rank[match["suffix"]] or f"{match['parent']}.{match['proj']}" not in quantized:
            continue  # e.g. the bias of experts stored packed unquantized: a model tensor as it is
        suffix = DISK_SUFFIXES[match["suffix"]]
        inner = (shape[1], shape[2] * shape[3]) if match["suffix"] == "_blocks" else tuple(shape[1:])
        for expert in range(shape[0]):
            views[f"{match['parent']}.{expert}.{match['proj']}.{suffix}"] = ExpertView(name, expert, inner)
    return views
