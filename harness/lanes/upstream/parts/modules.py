"""The weights a torch module tree holds.

For engines whose model is one (transformers, compressed-tensors)."""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.fp8 import dequantize_definition  # or nvfp4: the format piece

# ---- reproduce.py ----

PACKED_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def held_weights(model) -> dict[str, torch.Tensor]:
    """Each Linear's weight by module name; one still holding packed tensors is read by the
    format's definition from exactly the tensors it holds."""
    held = {}
    for name, module in model.named_modules():
        tensors = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        weight = tensors.get("weight", tensors.get("weight_packed"))
        if weight is None or weight.dim() != 2:
            continue
        packed = weight.dtype in PACKED_DTYPES or "weight_packed" in tensors
        held[name] = dequantize_definition(tensors) if packed else weight
    return held
