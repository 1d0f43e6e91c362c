"""Faults injected into a quantized checkpoint on disk, as loaders produce them, to prove that
the golden gates catch them. Each rewrites the single model.safetensors file in place."""

from __future__ import annotations

from pathlib import Path

from harness.core.errors import HarnessError

FILE = "model.safetensors"


def _rewrite(directory: Path, key: str, change) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(directory) / FILE
    tensors = load_file(str(path))
    if key not in tensors:
        raise HarnessError(f"{path}: no tensor {key}")
    with torch.no_grad():
        tensors[key] = change(tensors[key].clone()).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def drop_scale(directory: Path, module: str) -> str:
    """What a loader that drops a weight's scale computes: the raw FP8 codes (scale of one)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(directory) / FILE), "pt") as handle:
        keys = set(handle.keys())
    for suffix in ("weight_scale_inv", "weight_scale"):
        key = f"{module}.{suffix}"
        if key in keys:
            _rewrite(directory, key, lambda t: torch.ones_like(t))
            return key
    raise HarnessError(f"{directory}: {module} has no FP8 weight scale")


def corrupt_bias(directory: Path, module: str, mode: str) -> str:
    """`nonfinite`: one NaN in the bias (uninitialised memory); `stale`: the bias as allocated
    before loading (zeros), i.e. the checkpoint's value never arrived."""
    import math

    key = f"{module}.bias"
    if mode == "nonfinite":
        _rewrite(directory, key, lambda t: t.index_fill_(0, __import__("torch").tensor([0]), math.nan))
    elif mode == "stale":
        _rewrite(directory, key, lambda t: t.zero_())
    else:
        raise HarnessError(f"unknown bias fault '{mode}' (nonfinite, stale)")
    return key


def flip_global_scale_convention(directory: Path, module: str, which: str = "weight") -> str:
    """An NVFP4 global scale stored in the other convention: a ModelOpt multiplier (amax/2688)
    in compressed-tensors' divisor slot (2688/amax), or the reverse."""
    suffixes = {"weight": ("weight_global_scale", "weight_scale_2"), "input": ("input_global_scale", "input_scale")}
    if which not in suffixes:
        raise HarnessError(f"unknown global scale '{which}' (weight, input)")
    from safetensors import safe_open

    with safe_open(str(Path(directory) / FILE), "pt") as handle:
        keys = set(handle.keys())
    for suffix in suffixes[which]:
        key = f"{module}.{suffix}"
        if key in keys:
            _rewrite(directory, key, lambda t: 1.0 / t)
            return key
    raise HarnessError(f"{directory}: {module} has no {which} global scale")


def swap_parts(directory: Path, first: str, second: str) -> list[str]:
    """Two parts a loader fuses, stored in the other order (`[up; gate]` where the architecture
    says `[gate; up]`): every tensor of `first` (weight, scales, bias) exchanged with `second`'s.
    No loader can tell from the file; only the model's behaviour shows it."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(directory) / FILE
    tensors = load_file(str(path))
    suffixes = [k.removeprefix(f"{first}.") for k in tensors if k.startswith(f"{first}.")]
    if not suffixes:
        raise HarnessError(f"{path}: no tensor of {first}")
    for suffix in suffixes:
        a, b = f"{first}.{suffix}", f"{second}.{suffix}"
        if b not in tensors or tensors[a].shape != tensors[b].shape:
            raise HarnessError(f"{path}: {a} and {b} cannot change places")
        tensors[a], tensors[b] = tensors[b], torch.clone(tensors[a])
    save_file(tensors, str(path), metadata={"format": "pt"})
    return [f"{first}.{s}" for s in suffixes]


def unpermute_rotary(directory: Path, module: str, head_dim: int) -> list[str]:
    """q or k rows in Meta's original rotary order, as a converter that skips transformers' q/k
    permutation writes them (convert_llama_weights_to_hf `permute` maps each head's interleaved
    pairs to two halves; this is its inverse). Every tensor indexed by the module's output rows
    (weight, bias, per-row scales) is permuted alike; a block grid is kept where each block of rows
    holds whole heads, else refused."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(directory) / FILE
    tensors = load_file(str(path))
    weight = tensors.get(f"{module}.weight")
    if weight is None:
        raise HarnessError(f"{path}: no tensor {module}.weight")
    rows = weight.shape[0]
    if rows % head_dim or head_dim % 2:
        raise HarnessError(f"{module}: {rows} rows are not whole heads of {head_dim}")
    heads = rows // head_dim
    # halves [x0, x2, ..., x1, x3, ...] back to pairs [x0, x1, x2, x3, ...]
    order = torch.arange(rows).view(heads, 2, head_dim // 2).transpose(1, 2).reshape(rows)
    changed = []
    for key in [k for k in tensors if k.startswith(f"{module}.")]:
        tensor = tensors[key]
        if tensor.dim() >= 1 and tensor.shape[0] == rows:
            tensors[key] = tensor[order].contiguous()
            changed.append(key)
        elif tensor.dim() >= 1 and tensor.shape[0] > 1 and (rows // tensor.shape[0]) % head_dim:
            raise HarnessError(f"{key}: blocks of {rows // tensor.shape[0]} rows split heads of {head_dim}")
    save_file(tensors, str(path), metadata={"format": "pt"})
    return changed
