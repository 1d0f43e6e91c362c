"""What transformers' AutoRound Linears apply (auto-round's `auto_round.experimental.qmodules`, which
transformers builds for `quant_method: auto-round` FP8, NVFP4 and MXFP4 checkpoints through the
auto-round package).

Such a Linear holds the checkpoint's tensors under their stored names, but not always as stored: the
FP8 static one (`WeightFP8ActFP8StaticQuantLinear`) holds `weight` as the e4m3 codes cast to the
model dtype, not dequantized, and its float32 scales in the model dtype, and multiplies the two at
every forward. Read as stored tensors, its codes would pass for weights. Each of these Linears says
how it dequantizes (`dequant_weight_online`, which its forward calls): the weight it holds is what
that returns, in the model dtype, judged against the reference like any held weight (the
effective-weight probe judges the forward itself).
"""

from __future__ import annotations

import torch

from harness.core.naming import canonical_name

#: the method an AutoRound Linear dequantizes its held tensors with, in its forward
DEQUANTIZE = "dequant_weight_online"


def applied_weights(model) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {canonical name: float32 tensor}} for every AutoRound Linear of `model`: the
    weight its own dequantization computes (and its bias)."""
    applied = {}
    for name, module in model.named_modules():
        dequantize = getattr(module, DEQUANTIZE, None)
        if not callable(dequantize) or offloaded(module):
            continue
        with torch.no_grad():
            weights = {canonical_name(f"{name}.weight"): dequantize().float()}
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            weights[canonical_name(f"{name}.bias")] = bias.float()
        applied[name] = weights
    return applied


def offloaded(module) -> bool:
    """Whether the module's own tensors are not in memory (accelerate offloaded them to disk: they
    are `meta` until a forward's hook brings them in), so that there is nothing to dequantize (the
    `offload` relation compares log-probabilities only)."""
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(tensor.device.type == "meta" for tensor in own)
