"""The weights a torch module tree holds.

For engines whose model is one (transformers, compressed-tensors). transformers 5 holds a sparse
layer's experts packed (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj`
[E, H, I]; Llama-4 transposed, [E, H, 2I] and [E, I, H], under `feed_forward`): they are split back
into the checkpoint's one weight per expert and part (PACKED_EXPERTS says how transformers packs them)."""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.fp8 import dequantize_definition  # or nvfp4: the format piece
from harness.lanes.upstream.parts.parameters import PACKED_EXPERTS

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
    if PACKED_EXPERTS is None:
        return {}
    gate, up, down = PACKED_EXPERTS["parts"]
    held = {}
    for name, tensor in model.named_parameters():
        layer, _, projection = name.rpartition(".experts.")
        if tensor.dim() != 3 or projection not in ("gate_up_proj", "down_proj"):
            continue
        # the checkpoint's block name (transformers holds Mixtral's block_sparse_moe under mlp)
        base = f"{layer.rpartition('.')[0]}.{PACKED_EXPERTS['block']}.experts"
        parts = {"gate_up_proj": (gate, up) if up else (gate,), "down_proj": (down,)}[projection]
        for expert in range(tensor.shape[0]):
            weight = tensor[expert].T if PACKED_EXPERTS["transposed"] else tensor[expert]
            for part, rows in zip(parts, weight.chunk(len(parts)), strict=True):
                held[f"{base}.{expert}.{part}"] = rows
    return held
