"""The relation: a second transformers load path, which must agree with the first bit for bit.

No definition is needed: two load paths of one engine that its users take for the same model must
hold the same weights and compute the same logits. The second load is the model saved with
save_pretrained and loaded again (round-trip: weights and logits), the checkpoint loaded with its
own quantization config and dequantize=True (dequantize: weights only, as a dequantized model runs
no activation quantization by design), or loaded with a device_map that offloads half the
checkpoint's bytes to disk (offload: logits only, its weights are not all in memory)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from harness.lanes.upstream.parts.common import PROMPT, describe_error
from harness.lanes.upstream.parts.modules import held_weights
from harness.lanes.upstream.parts.parameters import CONFIG, RELATION

# ---- reproduce.py ----

RELATION_COMPARES = {"round-trip": ("weights", "logits"), "dequantize": ("weights",), "offload": ("logits",)}


def second_load(directory, model, scratch):
    from transformers import AutoModelForCausalLM

    options = {}
    if RELATION == "round-trip":
        directory = Path(scratch) / "saved"
        model.save_pretrained(directory)
    elif RELATION == "dequantize":
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

        quantization = CONFIG["quantization_config"]
        config_class = AUTO_QUANTIZATION_CONFIG_MAPPING[quantization["quant_method"]]
        options["quantization_config"] = config_class.from_dict({**quantization, "dequantize": True})
    elif RELATION == "offload":
        half = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors")) // 2
        options = {"device_map": "auto", "max_memory": {"cpu": half}, "offload_folder": str(Path(scratch) / "offload")}
    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, **options).eval()


@torch.no_grad()
def logits_of(model) -> torch.Tensor:
    """The prompt's logits (on the CPU, where an offloaded model's hooks move the inputs along)."""
    return model(input_ids=torch.tensor([PROMPT])).logits.float()


def first_difference(name, one: torch.Tensor, two: torch.Tensor) -> str | None:
    if tuple(one.shape) != tuple(two.shape):
        return f"{name}: shape {list(one.shape)} on the first load, {list(two.shape)} on the second"
    one, two = one.detach().cpu().double(), two.detach().cpu().double()
    differ = ~((one == two) | (one.isnan() & two.isnan()))
    if not differ.any():
        return None
    where = tuple(differ.nonzero()[0].tolist())
    return (
        f"{name}: {int(differ.sum())} of {one.numel()} elements differ, first at {list(where)}: "
        f"{float(one[where]):.6g} on the first load, {float(two[where]):.6g} on the second"
    )


def relation_problems(directory, loaded) -> list[str]:
    """What differs between the first load (already run once) and the second load path."""
    model = loaded[0]
    with tempfile.TemporaryDirectory(prefix="reproduce-relation-") as scratch:
        try:
            second = second_load(directory, model, scratch)
            second_logits = logits_of(second)  # compressed-tensors decompresses at the first forward
        except Exception as error:
            return [f"{RELATION}: the second load fails: {describe_error(error)}"]
        return compared(model, second, second_logits)


def compared(model, second, second_logits) -> list[str]:
    problems = []
    if "weights" in RELATION_COMPARES[RELATION]:
        first, other = held_weights(model), held_weights(second)
        for name in sorted(first.keys() | other.keys()):
            if name not in first or name not in other:
                problems.append(
                    f"{RELATION}: {name} is held by {'the first' if name in first else 'the second'} load only"
                )
                continue
            difference = first_difference(f"{RELATION}: {name}", first[name], other[name])
            if difference:
                problems.append(difference)
    if "logits" in RELATION_COMPARES[RELATION]:
        difference = first_difference(f"{RELATION}: logits", logits_of(model), second_logits)
        if difference:
            problems.append(difference)
    return problems
