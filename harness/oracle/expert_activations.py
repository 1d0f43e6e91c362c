"""Activation quantization inside a transformers 5 experts module, where a sparse layer's experts are
packed in 3-D parameters (`gate_up_proj` [E, 2I, H], gate rows first; `down_proj` [E, H, I]) and no
Linear exists to hook. Each expert is a checkpoint's three Linears, so each quantizes its own input
with its own scheme and scales (harness.oracle.activations): gate and up each see the token quantized
with their own static scale, down sees the activated product quantized with its own.

The experts' computation around that is the model class's eager one (Mixtral, Qwen2-MoE,
Qwen3-MoE and DeepSeek-V3 share it): the tokens routed to expert e, act(gate) * up, down, times the
routing weight, summed per token. Llama-4's (Llama4TextExperts, called with the hidden states alone)
differs: every expert runs every token, already scaled by its routing score ([E * tokens, H] in,
the block of expert e first), with x @ W (`gate_up_proj` [E, H, 2I], gate columns first; `down_proj`
[E, I, H]); the sum over experts is the caller's. A forward hook replaces the module's output with
this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from harness.core.errors import HarnessError
from harness.oracle.activations import ActivationScheme, quantize_activations

#: per expert: the static input scales of (gate, up, down), or Nones for a dynamic scheme
ExpertScales = Sequence[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]


def _forward(module, scheme: ActivationScheme, scales: ExpertScales, hidden, top_k_index, top_k_weights):
    result = torch.zeros_like(hidden)
    width = module.gate_up_proj.shape[1] // 2
    for expert, (gate_scale, up_scale, down_scale) in enumerate(scales):
        token, position = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        tokens = hidden[token]
        weights = module.gate_up_proj[expert]
        gate = torch.nn.functional.linear(quantize_activations(tokens, scheme, gate_scale), weights[:width])
        up = torch.nn.functional.linear(quantize_activations(tokens, scheme, up_scale), weights[width:])
        inner = quantize_activations(module.act_fn(gate) * up, scheme, down_scale)
        out = torch.nn.functional.linear(inner, module.down_proj[expert])
        out = out * top_k_weights[token, position, None]
        result.index_add_(0, token, out.to(result.dtype))
    return result


def _forward_every_token(module, scheme: ActivationScheme, scales: ExpertScales, hidden):
    """Llama-4's experts: expert e's block of the routing-scaled tokens through its own Linears."""
    blocks = hidden.view(module.gate_up_proj.shape[0], -1, hidden.shape[-1])
    width = module.gate_up_proj.shape[2] // 2
    outputs = []
    for expert, (gate_scale, up_scale, down_scale) in enumerate(scales):
        tokens, weights = blocks[expert], module.gate_up_proj[expert]
        gate = quantize_activations(tokens, scheme, gate_scale) @ weights[:, :width]
        up = quantize_activations(tokens, scheme, up_scale) @ weights[:, width:]
        inner = quantize_activations(up * module.act_fn(gate), scheme, down_scale)
        outputs.append(inner @ module.down_proj[expert])
    return torch.stack(outputs).view(-1, hidden.shape[-1])


def install(model: torch.nn.Module, experts: Mapping[str, ExpertScales], scheme: ActivationScheme) -> list:
    """Give each named experts module (name -> per-expert scales) the forward above; the handles."""
    modules = dict(model.named_modules())
    for name, scales in experts.items():  # all checked before any hook: none is left half-installed
        module = modules.get(name)
        if module is None or not hasattr(module, "gate_up_proj") or len(scales) != module.gate_up_proj.shape[0]:
            raise HarnessError(f"{name}: no packed experts module with {len(scales)} experts in the model")
    handles = []
    for name, scales in experts.items():
        module = modules[name]

        def hook(module, args, kwargs, output, scales=scales):
            values = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
            if len(values) == 1:  # Llama-4: the hidden states alone
                return _forward_every_token(module, scheme, scales, values[0])
            return _forward(module, scheme, scales, *values[:3])

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return handles
