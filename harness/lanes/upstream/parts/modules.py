"""The weights a torch module tree holds.

For engines whose model is one (transformers, compressed-tensors). transformers 5 holds a sparse
layer's experts packed (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj`
[E, H, I]): they are split back into the checkpoint's one weight per expert and part."""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.checkpoint import MOE
from harness.lanes.upstream.parts.fp8 import dequantize_definition  # or nvfp4: the format piece
from harness.lanes.upstream.parts.parameters import CONFIG

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
    return held | packed_experts(model)


def packed_experts(model) -> dict[str, torch.Tensor]:
    """Each expert's weight, by the checkpoint's module name, from packed 3-D experts parameters."""
    if CONFIG["model_type"] not in MOE:
        return {}
    block, (gate, up, down), _, _ = MOE[CONFIG["model_type"]]
    held = {}
    for name, tensor in model.named_parameters():
        layer, _, projection = name.rpartition(".experts.")
        if tensor.dim() != 3 or projection not in ("gate_up_proj", "down_proj"):
            continue
        base = f"{layer.rpartition('.')[0]}.{block}.experts"  # transformers holds Mixtral's block under mlp
        parts = {"gate_up_proj": (gate, up), "down_proj": (down,)}[projection]
        for expert in range(tensor.shape[0]):
            for part, rows in zip(parts, tensor[expert].chunk(len(parts)), strict=True):
                held[f"{base}.{expert}.{part}"] = rows
    return held
