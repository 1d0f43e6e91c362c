"""What the repairs share: a per-tensor skip, FP8 storage dtypes, and finding a checkpoint module
in the live model (key_mapping, VLM prefixes) and whether its weight can be written in place."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from harness.core.naming import VLM_PREFIX, canonical_name

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


class SkipTensor(Exception):
    """One tensor cannot be repaired safely; the message is the reason put in the report."""


def apply_key_mapping(name: str, key_mapping: Mapping[str, str] | None) -> str:
    """Rename a checkpoint key as transformers 5 does with `key_mapping`: each regex in order,
    replacing its first match."""
    for pattern, replacement in (key_mapping or {}).items():
        name = re.sub(pattern, replacement, name, count=1)
    return name


def live_module_name(
    checkpoint_module: str, live_modules: Mapping[str, torch.nn.Module], key_mapping: Mapping[str, str] | None
) -> str:
    """The live module a checkpoint module maps to: the key_mapping's result if it exists, else the
    one VLM-prefix reading (`model.language_model.X` <-> `model.X`) that exists."""
    mapped = apply_key_mapping(checkpoint_module, key_mapping)
    if mapped in live_modules:
        return mapped
    candidates = {canonical_name(mapped)}
    if mapped.startswith("model.") and not mapped.startswith(VLM_PREFIX):
        candidates.add(VLM_PREFIX + mapped.removeprefix("model."))
    if mapped.startswith("language_model.model."):  # the older VLM layout
        candidates.add("model." + mapped.removeprefix("language_model.model."))
        candidates.add(VLM_PREFIX + mapped.removeprefix("language_model.model."))
    found = sorted(c for c in candidates if c in live_modules)
    if not found:
        raise SkipTensor(
            f"no module {mapped!r} (or its VLM-prefix counterpart) in the model; pass key_mapping "
            "if the load renamed it"
        )
    if len(found) > 1:
        raise SkipTensor(f"ambiguous: {mapped!r} could be any of {found}")
    return found[0]


def offload_problem(module: torch.nn.Module, weight: torch.Tensor) -> str | None:
    """Why the weight cannot be repaired in place (meta, or held by an accelerate offload hook)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    offloaded = any(getattr(h, "offload", False) for h in hooks)
    if offloaded:
        return (
            "offloaded by accelerate (its values live in the hook's weights_map and are reloaded on every "
            "forward): its dropped scale was NOT applied; load without offloading this module and apply "
            "the fix again"
        )
    if weight.device.type == "meta":
        return (
            "on the meta device (never materialized): its dropped scale was NOT applied; materialize the "
            "weight and apply the fix again"
        )
    return None
