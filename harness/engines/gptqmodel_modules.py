"""What transformers' GPTQ and AWQ Linears hold (GPTQModel's quantized Linears, which transformers
builds for `quant_method: gptq` / `awq` through optimum and GPTQModel, and AutoRound's, which it
builds for `quant_method: auto-round` through the auto-round package).

Two states, judged at two depths:
- placed: after `from_pretrained`, before any forward, each module holds `qweight`, `qzeros`,
  `scales` (and `g_idx`) as its loader put them. GPTQModel converts a `checkpoint_format: gptq` (v1)
  checkpoint's zero points to its internal v2 (the stored value plus one) in every module whose
  kernel class declares `REQUIRES_FORMAT_V2` (its `convert_gptq_v1_to_v2_format`), so those are
  decoded as `gptq_v2`; the rest as the checkpoint says. The decoding is the format's reference.
- applied: CPU kernels repack at the first forward (TorchAtenLinear: uint8 codes for
  `aten._weight_int4pack_mm_for_cpu`, zero points and scales in bfloat16): a layout private to the
  kernel, judged through its output by the effective-weight probe (harness.differential.effective_weights),
  never decoded.
"""

from __future__ import annotations

import torch

from harness.core.errors import FormatError
from harness.core.naming import canonical_name

#: the tensor that marks a GPTQ / AWQ Linear in a model (and in a checkpoint)
MARKER = "qweight"


def is_quantized_linear(module) -> bool:
    """A GPTQ / AWQ Linear: holds packed codes and says its input width (`in_features`, as
    GPTQModel's say it, or `infeatures`, as AutoRound's `auto_round_extension` QuantLinears do)."""
    return isinstance(getattr(module, MARKER, None), torch.Tensor) and (
        hasattr(module, "in_features") or hasattr(module, "infeatures")
    )


def held_convention(module, knobs: dict) -> dict:
    """The knobs the module's held tensors follow: v2 zero points where GPTQModel converted a v1
    checkpoint for its kernel (see the module docstring)."""
    converted = knobs.get("checkpoint_format") == "gptq" and getattr(type(module), "REQUIRES_FORMAT_V2", False)
    return {**knobs, "checkpoint_format": "gptq_v2"} if converted else dict(knobs)


def placed_weights(model, fmt, knobs) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {canonical name: float32 tensor}} for every GPTQ / AWQ Linear of `model`, its
    held tensors decoded by the format's reference under the module's own convention. Call it
    before the first forward (the kernels repack then). A module whose held tensors the reference
    refuses (buffers its loader never wrote: GPTQModel allocates them uninitialised, and a g_idx
    of garbage names no group) places no weight: the judgement finds it missing, and the load
    report says which tensors never arrived."""
    if fmt is None or fmt.marker != MARKER:
        return {}
    placed = {}
    for name, module in model.named_modules():
        if not is_quantized_linear(module):
            continue
        own = dict(module.named_buffers(recurse=False)) | dict(module.named_parameters(recurse=False))
        tensors = {key: value for key, value in own.items() if key in fmt.suffixes}
        try:
            weights = {
                canonical_name(f"{name}.weight"): fmt.dequantize_held(tensors, held_convention(module, knobs)).float()
            }
        except FormatError:
            weights = {}
        if isinstance(own.get("bias"), torch.Tensor):
            weights[canonical_name(f"{name}.bias")] = own["bias"].float()
        placed[name] = weights
    return placed
