"""What transformers' backend Linears that dequantize at every forward apply: AutoRound's
(`auto_round.experimental.qmodules`, which transformers builds for `quant_method: auto-round` FP8,
NVFP4 and MXFP4 checkpoints through the auto-round package) and AMD Quark's (`QParamsLinear`, built
for `quant_method: quark` through the amd-quark package).

Such a Linear holds the checkpoint's tensors, but not as weights: AutoRound's FP8 static one
(`WeightFP8ActFP8StaticQuantLinear`) holds `weight` as the e4m3 codes cast to the model dtype and
multiplies them by its scales at every forward; Quark's holds the stored codes (e4m3, packed int4,
e2m1 bytes) and its scales in its quantizers. Read as stored tensors, codes would pass for weights.
Each says how it dequantizes, in the method its forward calls (AutoRound's `dequant_weight_online()`,
Quark's `_get_qweight(weight)`): the weight it holds is what that returns, judged against the
reference like any held weight (the effective-weight probe judges the forward itself).
"""

from __future__ import annotations

import torch

from harness.core.naming import canonical_name

#: the method an AutoRound Linear dequantizes its held tensors with, in its forward
DEQUANTIZE = "dequant_weight_online"
#: the method a Quark QParamsLinear's forward passes its held `weight` through
QUARK_DEQUANTIZE = "_get_qweight"


def dequantizer(module):
    """The call that gives the weight a module's own forward applies, or None for any other module."""
    online = getattr(module, DEQUANTIZE, None)
    if callable(online):
        return online
    quark = getattr(module, QUARK_DEQUANTIZE, None)
    held = getattr(module, "weight", None)
    if callable(quark) and isinstance(held, torch.Tensor):
        return lambda: quark(held)
    return None


def applied_weights(model) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {canonical name: float32 tensor}} for every Linear of `model` that dequantizes
    at its forward (AutoRound's, Quark's): the weight its own dequantization computes (and its bias)."""
    applied = {}
    for name, module in model.named_modules():
        dequantize = dequantizer(module)
        if dequantize is None or offloaded(module):
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
