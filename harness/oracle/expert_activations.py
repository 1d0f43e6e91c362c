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


#: in an activation probe's inputs (harness.differential.probe), `NAME + EXPERTS` holds the rows a
#: packed experts module NAME is run on, every row routed to one expert at a time (weight 1), and
#: `NAME + EXPERTS + ".E.specified"` / `".E.weights_only"` what expert E computes from them
EXPERTS = "#experts"


def _quantize(x, scheme: ActivationScheme | None, stored):
    """`x` as the scheme quantizes it; `x` itself for no scheme (the weight-only computation)."""
    return x if scheme is None else quantize_activations(x, scheme, stored)


def _forward(module, scheme: ActivationScheme | None, scales: ExpertScales, hidden, top_k_index, top_k_weights):
    result = torch.zeros_like(hidden)
    width = module.gate_up_proj.shape[1] // 2
    for expert, (gate_scale, up_scale, down_scale) in enumerate(scales):
        token, position = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        tokens = hidden[token]
        weights = module.gate_up_proj[expert]
        gate = torch.nn.functional.linear(_quantize(tokens, scheme, gate_scale), weights[:width])
        up = torch.nn.functional.linear(_quantize(tokens, scheme, up_scale), weights[width:])
        inner = _quantize(module.act_fn(gate) * up, scheme, down_scale)
        out = torch.nn.functional.linear(inner, module.down_proj[expert])
        out = out * top_k_weights[token, position, None]
        result.index_add_(0, token, out.to(result.dtype))
    return result


def _forward_every_token(module, scheme: ActivationScheme | None, scales: ExpertScales, hidden):
    """Llama-4's experts: expert e's block of the routing-scaled tokens through its own Linears."""
    blocks = hidden.view(module.gate_up_proj.shape[0], -1, hidden.shape[-1])
    width = module.gate_up_proj.shape[2] // 2
    outputs = []
    for expert, (gate_scale, up_scale, down_scale) in enumerate(scales):
        tokens, weights = blocks[expert], module.gate_up_proj[expert]
        gate = _quantize(tokens, scheme, gate_scale) @ weights[:, :width]
        up = _quantize(tokens, scheme, up_scale) @ weights[:, width:]
        inner = _quantize(up * module.act_fn(gate), scheme, down_scale)
        outputs.append(inner @ module.down_proj[expert])
    return torch.stack(outputs).view(-1, hidden.shape[-1])


def routes_every_token(module) -> bool:
    """Llama-4's experts (called with the hidden states alone), not the routed ones."""
    import inspect

    return len(inspect.signature(module.forward).parameters) == 1


def run_each_expert(module, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The packed experts module's output with every row of `hidden` routed to expert e (weight 1),
    for each e, as the module's own forward computes it."""
    experts = module.gate_up_proj.shape[0]
    if routes_every_token(module):  # [E * rows, H] in, expert e's block first: each expert gets every row
        return list(module(hidden.repeat(experts, 1)).view(experts, hidden.shape[0], -1))
    weights = torch.ones(hidden.shape[0], 1, dtype=hidden.dtype, device=hidden.device)
    outputs = []
    for expert in range(experts):
        index = torch.full((hidden.shape[0], 1), expert, dtype=torch.long, device=hidden.device)
        outputs.append(module(hidden, index, weights))
    return outputs


def each_expert_candidates(module, scheme: ActivationScheme, scales: ExpertScales, hidden) -> list[tuple]:
    """Per expert e: (specified, weight-only) outputs of `run_each_expert`'s calls, from the module's
    own packed weights: each expert Linear's input quantized by the scheme, or not."""
    experts, rows = len(scales), hidden.shape[0]
    candidates = []  # per scheme (specified, then none): each expert's output
    for quantized in (scheme, None):
        if routes_every_token(module):  # one call gives every expert's block
            blocks = _forward_every_token(module, quantized, scales, hidden.repeat(experts, 1))
            candidates.append(list(blocks.view(experts, rows, -1)))
            continue
        ones = torch.ones(rows, 1)
        candidates.append(
            [
                _forward(module, quantized, scales, hidden, torch.full((rows, 1), expert, dtype=torch.long), ones)
                for expert in range(experts)
            ]
        )
    return list(zip(*candidates, strict=True))


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
