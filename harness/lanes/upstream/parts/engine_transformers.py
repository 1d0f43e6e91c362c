"""The engine: transformers.

As users load a checkpoint: AutoModelForCausalLM.from_pretrained, the checkpoint's dtype (or the
one ENGINE_OPTIONS names), CPU."""

from __future__ import annotations

import torch

from harness.lanes.upstream.parts.common import ENGINE_DTYPE, PROMPT, describe_error
from harness.lanes.upstream.parts.modules import bias_problems, held_weights
from harness.lanes.upstream.parts.parameters import ENGINE_OPTIONS

# ---- reproduce.py ----

ENGINE_PACKAGE, ENGINE_DISTRIBUTIONS = "transformers", ("transformers",)
ENGINE_LOGGERS = ("transformers", "compressed_tensors")


def load_model(directory):
    from transformers import AutoModelForCausalLM

    dtype = {"dtype": ENGINE_DTYPE} if "dtype" in ENGINE_OPTIONS else {}  # else the checkpoint's, as by default
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, local_files_only=True, **dtype
    )
    return model.eval(), info


def check_loaded(loaded, expected):
    """(held weights, problems, notes); every weight is read (`expected` is judged by main), every
    Linear bias judged against the checkpoint's. compressed-tensors formats decompress on the first
    forward, so the weights are read after it."""
    model, info = loaded
    notes = [
        f"load report: {len(info[key])} {key.replace('_', ' ')}, e.g. {sorted(map(str, info[key]))[:3]}"
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
        if info.get(key)
    ]
    # a scale the engine reports unexpected is a scale it dropped (its weight may still look right);
    # one it reports missing is one its module runs with at the initial value
    problems = [
        f"{what}: {key}"
        for report, what in (
            ("unexpected_keys", "scale tensor dropped as unexpected"),
            ("missing_keys", "scale tensor missing, its module runs with the initial value"),
        )
        for key in sorted(map(str, info.get(report) or ()))[:8]
        if "scale" in key.rpartition(".")[2]
    ]
    problems += bias_problems(model)
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT])).logits
        if not torch.isfinite(logits).all():
            problems.append(f"the forward pass yields {int((~torch.isfinite(logits)).sum())} non-finite logits")
    except Exception as error:
        problems.append(f"the forward pass fails: {describe_error(error)}")
    return held_weights(model), problems, notes
