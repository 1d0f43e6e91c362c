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
