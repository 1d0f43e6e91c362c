"""Load the weights transformers left random when a text model's checkpoint stores them under the
VLM prefix `model.language_model.` (known issue transformers-vlm-prefix-loads-random-weights).

The bug: LlamaForCausalLM / Qwen2ForCausalLM look for `model.layers...`; a checkpoint written by
a VLM pipeline keeps the text model under `model.language_model.layers...`. transformers lists
every such key as unexpected and the matching parameters as missing, initialises them randomly,
and loads without raising: the model prints noise. Measured on tiny-qwen2 quantized to fp8-block
with its keys prefixed: held-out perplexity 169.7 (golden 1.4498; after the fix 1.44984, the gate passes).

When it applies: the checkpoint has tensors under `model.language_model.` and the live model is a
text model (no `model.language_model` module; a VLM-shaped model loads them itself and is left
alone). Per tensor, decided before it is touched, with `canonical_name` mapping the key:
- a plain tensor (embedding, norm, bias, unquantized Linear) is copied, cast once to the live
  dtype, into the live parameter or buffer of the same shape, unless it already holds it;
- a quantized module (the harness's reference knows its format) whose live weight is dense (what
  transformers builds on CPU, where it dequantizes FP8 at load) gets the reference's float64
  dequantization rounded once to the live dtype, unless already within the dtype's weight
  tolerance of it (cases/tolerances.toml);
- a quantized module that transformers built as a quantized module (FineGrainedFP8's FP8Linear on
  an FP8-capable GPU) gets the checkpoint's tensors copied verbatim into the live tensors of the
  same name, dtype and shape (`weight` codes, `weight_scale_inv`): exactly what the loader would
  have put there. A live tensor of another dtype or shape is skipped with the reason (not measured
  here: CPU has no FP8Linear path; the copy is a plain same-dtype `copy_`).
Limits: compressed-tensors formats are not repaired: transformers fails while randomly
initialising their compressed FP8/packed parameters (the known issue's accepted refusal), so there
is no model. Offloaded or meta tensors are skipped with a warning, as in restore_fp8_scales.
Passing `key_mapping={"^model.language_model.": "model."}` to from_pretrained avoids the bug.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.checkpoints.reader import Checkpoint
from harness.core.errors import CheckpointError
from harness.core.naming import VLM_PREFIX, canonical_name
from harness.fixes._redequantize import (
    QuantizedCheckpoint,
    live_weight,
    mismatches,
    weight_tolerance,
    write_rounded_once,
)
from harness.fixes._shared import FP8_DTYPES, SkipTensor, offload_problem
from harness.fixes.base import Fix, FixReport

NAME = "vlm-prefix-weights"
KNOWN_ISSUE = "transformers-vlm-prefix-loads-random-weights"


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}


@torch.no_grad()
def copy_plain(live: dict[str, torch.Tensor], name: str, stored: torch.Tensor, modules) -> str:
    """Copy one checkpoint tensor into the live tensor of the mapped name; the repaired key."""
    key = canonical_name(name)
    target = live.get(key)
    if target is None:
        raise SkipTensor(f"the model has no tensor {key!r}")
    module = modules.get(key.rpartition(".")[0])
    problem = offload_problem(module, target) if module is not None else None
    if problem:
        raise SkipTensor(problem.replace("its dropped scale was NOT applied", "NOT loaded"))
    if tuple(target.shape) != tuple(stored.shape):
        raise SkipTensor(f"checkpoint {list(stored.shape)} vs live {list(target.shape)}")
    if target.dtype in FP8_DTYPES or stored.dtype in FP8_DTYPES:
        if target.dtype != stored.dtype:
            raise SkipTensor(f"checkpoint {stored.dtype} vs live {target.dtype}: not a verbatim copy")
    value = stored.to(device=target.device, dtype=target.dtype)
    if torch.equal(target, value):
        raise SkipTensor("already holds the checkpoint's value")
    target.copy_(value)
    return key


def load_prefixed_weights(model: torch.nn.Module, checkpoint_dir: str | Path) -> FixReport:
    """Load every `model.language_model.*` checkpoint tensor into the text model's `model.*`
    tensor (module docstring). Report keys are live names."""
    report = FixReport(NAME)
    modules = dict(model.named_modules())
    if "model.language_model" in modules:
        report.warnings.append("the model has model.language_model: it is VLM-shaped and loads these keys itself")
        return report
    checkpoint = Checkpoint(checkpoint_dir)
    if not any(name.startswith(VLM_PREFIX) for name in checkpoint.names()):
        report.warnings.append(f"no checkpoint key under {VLM_PREFIX!r}: nothing to load")
        return report
    try:
        source = QuantizedCheckpoint.open(checkpoint_dir)
        quantized, plain = source.modules, source.plain
    except CheckpointError:
        if isinstance(checkpoint.config.get("quantization_config"), dict):
            raise
        source, quantized, plain = None, {}, checkpoint.names()  # an unquantized checkpoint
    live = live_tensors(model)

    for name in sorted(n for n in plain if n.startswith(VLM_PREFIX)):
        try:
            report.repaired.append(copy_plain(live, name, checkpoint.tensor(name), modules))
        except SkipTensor as reason:
            report.skipped[canonical_name(name)] = str(reason)

    for module in sorted(m for m in quantized if m.startswith(VLM_PREFIX)):
        key = f"{canonical_name(module)}.weight"
        try:
            target = live.get(key)
            if target is not None and target.dtype in FP8_DTYPES:  # a converted module: its tensors verbatim
                copied = []
                for tensor_name in sorted(quantized[module].values()):
                    try:
                        copied.append(copy_plain(live, tensor_name, checkpoint.tensor(tensor_name), modules))
                    except SkipTensor as reason:
                        report.skipped[canonical_name(tensor_name)] = str(reason)
                report.repaired.extend(copied)
                continue
            name, _, weight = live_weight(modules, canonical_name(module))
            key = f"{name}.weight"
            value = source.reference(module)
            rel, abs_ = weight_tolerance(weight.dtype, source.fmt.name)
            if not mismatches(weight, value, rel, abs_):
                raise SkipTensor("already holds the checkpoint's dequantized weight")
            write_rounded_once(weight, value)
        except SkipTensor as reason:
            report.skipped[key] = str(reason)
            continue
        report.repaired.append(key)
    for key, reason in report.skipped.items():
        if "offloaded" in reason or "meta device" in reason:
            report.warnings.append(f"{key}: {reason}")
    return report


FIX = Fix(
    name=NAME,
    repairs=(
        "a text-model checkpoint whose keys sit under model.language_model. loads into a *ForCausalLM with "
        "every decoder weight missing and randomly initialised; transformers only lists the keys."
    ),
    engines=("transformers",),
    versions=">=5.0",
    formats=("fp8-block", "bf16"),
    detection=(
        "the checkpoint has keys under model.language_model., the live model has no model.language_model "
        "module, and the live tensor at the mapped name (canonical_name) does not hold the checkpoint's value "
        "(plain tensors: bit-equal after the cast; quantized: the reference within the weight tolerance)"
    ),
    apply=load_prefixed_weights,
    known_issues=(KNOWN_ISSUE,),
    kinds=("weights-missing", "load-report", "dropped-scale"),
)
