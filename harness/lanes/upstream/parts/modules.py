"""The weights a torch module tree holds.

For engines whose model is one (transformers, compressed-tensors). transformers 5 holds a sparse
layer's experts packed (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj`
[E, H, I]; Llama-4 transposed, [E, H, 2I] and [E, I, H], under `feed_forward`): they are split back
into the checkpoint's one weight per expert and part (PACKED_EXPERTS says how transformers packs them).
GPTQ and AWQ Linears (GPTQModel's, through optimum) hold no `weight`, and their CPU kernels repack
at the first forward: the weight each applies is read through it, from its outputs on basis inputs."""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.checkpoint import float_weights
from harness.lanes.upstream.parts.common import ENGINE_DTYPE, PROBED
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
        if hasattr(module, "qweight") and hasattr(module, "in_features"):  # GPTQ / AWQ
            held[name] = applied_weight(name, module)
            continue
        weight = tensors.get("weight", tensors.get("weight_packed"))
        if weight is None or weight.dim() != 2:
            continue
        packed = weight.dtype in PACKED_DTYPES or "weight_packed" in tensors
        try:
            held[name] = dequantize_definition(tensors) if packed else weight
        except KeyError:  # codes held without the scales the definition reads: judged as the values they are
            held[name] = weight
    return held | packed_experts(model)


@torch.no_grad()
def applied_weight(name, module) -> torch.Tensor | str:
    """The weight a Linear applies: its output on the rows of the identity (e_j: W[:, j] + bias),
    the bias taken off, in float64; or why it cannot be run. PROBED notes its bias, whose rounding
    into the output the comparison allows for (common.kernel_slack)."""
    bias = getattr(module, "bias", None)
    try:
        output = module(torch.eye(module.in_features, dtype=ENGINE_DTYPE))
    except Exception as error:
        return f"its Linear fails on basis inputs: {type(error).__name__}: {str(error)[:300]}"
    PROBED[name] = None if bias is None else bias.detach().to(torch.float64)
    output = output.to(torch.float64) - (0 if bias is None else PROBED[name])
    return output.T.contiguous()


def bias_problems(model) -> list[str]:
    """Each Linear whose bias is not the one the checkpoint stores (in the model dtype, used as it
    is: a correct loader holds it exactly)."""
    stored, problems = float_weights(), []
    for name, module in model.named_modules():
        bias, want = getattr(module, "bias", None), stored.get(f"{name}.bias")
        if want is None or not isinstance(bias, torch.Tensor):
            continue
        held, want = bias.detach().to("cpu", torch.float64), want.to(torch.float64)
        if held.shape != want.shape:
            problems.append(f"{name}.bias: held with shape {list(held.shape)}, the checkpoint's is {list(want.shape)}")
        elif not torch.equal(held, want):
            differ = held != want
            problems.append(
                f"{name}.bias: held as {str(bias.dtype)[6:]}, {int(differ.sum())} of {want.numel()} elements differ "
                f"from the checkpoint's, by up to {float((held - want).abs().max()):.3g}"
            )
    return problems


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
