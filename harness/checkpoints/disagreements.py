"""Checkpoints whose config and tensors disagree, each with what a correct loader does with it.

One disagreement per checkpoint (the recipe's `perturb.disagreement`), applied to one target
module: an expert's projection where the architecture has experts (per expert), else the last
layer's down projection. A correct loader either honours the tensors exactly or refuses; what it
must never do is load a weight without its scale, or stored values without their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.core.errors import HarnessError


@dataclass(frozen=True)
class Disagreement:
    expectation: str
    note: str
    needs_index: bool = False  # only a sharded checkpoint has an index to disagree with
    needs_status: bool = False  # only compressed-tensors declares a quantization_status
    needs_static_inputs: bool = False  # only a static activation scheme stores an input scale


DISAGREEMENTS = {
    "ignored-but-quantized": Disagreement(
        "exact-or-refuse",
        "stored quantized but listed in the ignore list: dequantize it by its tensors or refuse, "
        "never load its stored values as weights",
    ),
    "plain-not-ignored": Disagreement(
        "exact-or-refuse",
        "stored unquantized in the model dtype but not in the ignore list: load it as stored or refuse",
    ),
    "missing-scale": Disagreement(
        "refuse", "its scale tensor is absent: a loader must refuse, never use an initial value"
    ),
    "missing-input-scale": Disagreement(
        "refuse",
        "its static activation scale (input_scale / input_global_scale) is absent: a loader must refuse, "
        "never quantize its inputs with an initial value",
        needs_static_inputs=True,
    ),
    "scale-renamed": Disagreement(
        "refuse",
        "its scale is stored under the other convention's name (weight_scale <-> weight_scale_inv): "
        "a loader must refuse, never drop it as an unexpected key",
    ),
    "index-omits-tensor": Disagreement(
        "exact-or-refuse",
        "its scale is in a shard but the index does not list it: refuse, or find it and load exactly",
        needs_index=True,
    ),
    "index-names-absent-shard": Disagreement(
        "exact-or-refuse",
        "the index places its scale in a shard file that is not on disk (the tensor is stored in another "
        "shard, as a stale index after resharding says): refuse, or find it and load exactly",
        needs_index=True,
    ),
    "index-lists-absent-tensor": Disagreement(
        "refuse",
        "the index lists its scale but no shard holds it: a loader must refuse, never use an initial value",
        needs_index=True,
    ),
    "index-stale-duplicate": Disagreement(
        "exact-or-refuse",
        "a stale copy of its scale (other values) is stored, unlisted, in another shard; the index names "
        "the true one: load the indexed tensor, or refuse the duplicate, never load the stale copy",
        needs_index=True,
    ),
    "status-not-compressed": Disagreement(
        "exact-or-refuse",
        "quantization_status is 'frozen' while the tensors are compressed: decompress them or refuse",
        needs_status=True,
    ),
    "orphan-scale": Disagreement(
        "exact-or-refuse",
        "a scale tensor for a module the model does not have: refuse, or report it unused and load the rest exactly",
    ),
}
CHOICES = ("none", *DISAGREEMENTS)


def check(kind: str, shards: int, quantization_config: dict) -> None:
    """Refuse a disagreement the checkpoint cannot carry (one line)."""
    if kind == "none":
        return
    if DISAGREEMENTS[kind].needs_index and shards < 2:
        raise HarnessError(f"disagreement={kind} needs shards >= 2 (an index to disagree with)")
    if DISAGREEMENTS[kind].needs_status and "quantization_status" not in quantization_config:
        raise HarnessError(f"disagreement={kind} needs a compressed-tensors format (quantization_status)")
    if DISAGREEMENTS[kind].needs_static_inputs and not static_inputs(quantization_config):
        raise HarnessError(
            f"disagreement={kind} needs static activation scales (input_scale=true, ModelOpt, NVFP4 W4A4)"
        )


def static_inputs(quantization_config: dict) -> bool:
    """Whether the config declares activations quantized with a stored scale: a config group's
    input_activations not dynamic (compressed-tensors, ModelOpt; NVFP4's "local" keeps a stored
    global scale), or FineGrainedFP8's activation_scheme static."""
    if quantization_config.get("activation_scheme") == "static":
        return True
    groups = (quantization_config.get("config_groups") or {}).values()
    return any(
        isinstance(g, dict) and (g.get("input_activations") or {}).get("dynamic", True) is not True for g in groups
    )


def input_scale(suffixes: list[str]) -> str:
    """A module's stored static activation scale."""
    return next(s for s in suffixes if s in ("input_scale", "input_global_scale"))


def applies(kind: str, shards: int, quantization_config: dict) -> bool:
    try:
        check(kind, shards, quantization_config)
    except HarnessError:
        return False
    return True


def target_module(linear_modules: list[str]) -> str:
    """An expert's projection where there are experts, else the last quantizable module."""
    return next((m for m in linear_modules if ".experts.1." in m), linear_modules[-1])


def main_scale(suffixes: list[str], marker: str) -> str:
    """The scale a loader cannot do without: the marker when it is a scale, else the first scale."""
    scales = [s for s in suffixes if s not in ("weight", "weight_packed", "qweight", "input_scale")]
    named = [s for s in scales if "scale" in s]  # GPTQ/AWQ: `scales` before `qzeros`
    return marker if marker in scales else (named or scales)[0]


def edit_tensors(kind: str, module: str, tensors: dict[str, torch.Tensor], marker: str) -> list[str]:
    """Apply a tensor-level disagreement to `tensors` (checkpoint names) in place; the names a
    correct loader leaves unused (an orphan scale) are returned."""
    if kind not in (
        "missing-scale",
        "index-lists-absent-tensor",
        "scale-renamed",
        "orphan-scale",
        "missing-input-scale",
    ):
        return []
    suffixes = [name.removeprefix(f"{module}.") for name in tensors if name.startswith(f"{module}.")]
    if kind == "missing-input-scale":
        del tensors[f"{module}.{input_scale(suffixes)}"]
        return []
    scale = main_scale(suffixes, marker)
    if kind in ("missing-scale", "index-lists-absent-tensor"):
        del tensors[f"{module}.{scale}"]
    elif kind == "scale-renamed":
        other = "weight_scale" if scale == "weight_scale_inv" else "weight_scale_inv"
        tensors[f"{module}.{other}"] = tensors.pop(f"{module}.{scale}")
    elif kind == "orphan-scale":
        orphan = module.rpartition(".")[0] + ".unused_proj." + scale
        tensors[orphan] = tensors[f"{module}.{scale}"].clone()
        return [orphan]
    return []


#: how the index misstates the target's main scale, by disagreement: left out, placed in a shard
#: file that is not on disk, listed (in the target's weight's shard) though no shard holds it, or
#: listed truly while a stale copy sits unlisted in another shard (a loader that reads every
#: tensor of every file it opens meets both)
INDEX_EDITS = {
    "index-omits-tensor": "omit",
    "index-names-absent-shard": "absent-shard",
    "index-lists-absent-tensor": "absent-tensor",
    "index-stale-duplicate": "stale-duplicate",
}
#: index edits after which the index no longer leads to every tensor (its reader refuses)
UNREADABLE_EDITS = ("absent-shard", "absent-tensor")


def index_edits(kind: str, module: str, names: list[str], marker: str) -> dict[str, str]:
    """{the target's main scale: how the index misstates it (INDEX_EDITS)}, or {} for a kind
    that leaves the index true. `names`: the checkpoint's names before edit_tensors."""
    if kind not in INDEX_EDITS:
        return {}
    suffixes = [n.removeprefix(f"{module}.") for n in names if n.startswith(f"{module}.")]
    return {f"{module}.{main_scale(suffixes, marker)}": INDEX_EDITS[kind]}


def misstates_its_index(manifest: dict | None) -> bool:
    """Whether a checkpoint the harness wrote disagrees with its own index on purpose (its reader
    then refuses it, and the engines are judged by what the manifest expects)."""
    perturb = ((manifest or {}).get("resolved") or {}).get("perturb") or {}
    return INDEX_EDITS.get(perturb.get("disagreement")) in UNREADABLE_EDITS


def stale_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The values a stale duplicate holds: a float scale doubled, an integer's lowest bit flipped
    (an E8M0 exponent one off, one code of each packed word changed)."""
    if tensor.is_floating_point():
        return (tensor.to(torch.float64) * 2).to(tensor.dtype)
    return tensor ^ 1


def absent_shard(shards: int) -> str:
    """The shard file a stale index names: one past the last that is written."""
    return f"model-{shards + 1:05d}-of-{shards + 1:05d}.safetensors"
