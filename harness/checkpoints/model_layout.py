"""How a transformers model holds the tensors a checkpoint stores, and back.

Producers write one tensor per expert (`…experts.E.gate_proj.weight`); transformers 5 holds a
sparse layer's experts packed in 3-D (`…mlp.experts.gate_up_proj` [E, 2I, H], gate rows first,
and `…mlp.experts.down_proj` [E, H, I]) and Mixtral's `block_sparse_moe` under `mlp`; Llama-4
holds them transposed under `feed_forward` (`gate_up_proj` [E, H, 2I], gate columns first); gpt-oss
holds its experts transposed (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]) with their
biases packed beside (`gate_up_proj_bias` [E, 2I]). Written
here from the architecture's own layout, not from transformers' conversion code, so the reference
engine does not borrow the loader it judges. Weights are compared under checkpoint names:
`to_checkpoint_names` splits what a model holds back into the tensors the checkpoint stores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from harness.checkpoints.architectures import Architecture, architecture_for
from harness.checkpoints.saved_config import model_settings
from harness.core.errors import HarnessError, Unsupported
from harness.core.naming import canonical_name


class LayoutError(Unsupported):
    """A registered architecture whose config.json does not give its layout: `unsupported: ...`."""


def layout_settings(config: Mapping) -> Mapping:
    """`config` with every field its architecture's layout reads as the model class reads it
    (harness.checkpoints.saved_config: a null `head_dim` derived, `num_experts` under its saved name)."""
    arch = architecture_for(str(config.get("model_type", "")))
    return model_settings(config, arch.layout_keys()) if arch else config


def known_layout(config: Mapping, names: Iterable[str] | None = None) -> Architecture | None:
    """The registered architecture of `config` with its layout computable from it; None for a model
    type that is not registered. `names`, the checkpoint's tensor names, choose among the expert
    namings real producers write (Mixtral's w1/w3/w2 or gate_proj/up_proj/down_proj). A registered
    architecture whose config lacks what its layout needs is a LayoutError, never a silent None."""
    arch = architecture_for(str(config.get("model_type", "")))
    if arch is None:
        return None
    settings = layout_settings(config)
    try:
        arch.tensor_layout(settings)
    except KeyError as error:
        raise LayoutError(f"{arch.model_type} config.json lacks {error}, which its tensor layout needs") from None
    except (TypeError, ValueError) as error:
        raise LayoutError(f"{arch.model_type} config.json does not give its tensor layout ({error})") from None
    return with_expert_naming(arch, settings, names)


def with_expert_naming(arch: Architecture, settings: Mapping, names: Iterable[str] | None) -> Architecture:
    """`arch` with its experts' part names as the checkpoint `names` write them; `arch` itself
    where they write its own naming, hold no expert, or no names are given."""
    moe = arch.moe
    if moe is None or not moe.other_parts or names is None:
        return arch
    names = {canonical_name(name) for name in names}  # a vision-language checkpoint's keys too
    for layer in range(settings["num_hidden_layers"]):
        if arch.is_sparse(settings, layer):
            break
    else:
        return arch
    for parts in moe.other_parts:
        if any(f"model.layers.{layer}.{moe.block}.experts.0.{parts[0]}.{suffix}" in names for suffix in _SUFFIXES):
            return dataclasses.replace(arch, moe=dataclasses.replace(moe, parts=parts))
    return arch


def foreign_experts(config: Mapping, names: Iterable[str]) -> list[str]:
    """The routed-expert modules whose weight `names` store in a decoder layer that the
    architecture's model has under none of the namings the reference reads: no loader of the
    architecture places them, so its experts stay as initialised (GPTQModel 7.6 saves a Mixtral's
    experts under transformers 5's in-memory `mlp.experts.E.gate_proj`). A stray scale is audit's;
    layers past num_hidden_layers (DeepSeek-V3's multi-token prediction) are not the decoder's; an
    unregistered architecture, or a config without its layout, has none."""
    names = [canonical_name(name) for name in names]
    arch = _moe_layout(config, names)
    if arch is None:
        return []
    settings = layout_settings(config)
    expected = arch.modules(settings)
    decoder = {f"model.layers.{layer}." for layer in range(settings["num_hidden_layers"])}
    stored = {module for module, _, suffix in (name.rpartition(".") for name in names) if suffix in _SUFFIXES}
    return sorted(
        module
        for module in stored - expected
        if ".experts." in module and any(module.startswith(layer) for layer in decoder)
    )


def misplaced_experts(config: Mapping, names: Iterable[str]) -> str | None:
    """Why a checkpoint cannot be loaded as its architecture (foreign_experts), or None."""
    foreign = foreign_experts(config, names)
    if not foreign:
        return None
    return (
        f"{len(foreign)} routed-expert module(s) under no naming of {config.get('model_type')}'s model "
        f"(e.g. {foreign[0]}): no loader of it places them"
    )


#: transformers 5's in-memory names of a block's fused expert tensors ([E, 2I, H] gate and up, [E, H, I] down)
FUSED_EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def fused_experts(config: Mapping, names: Iterable[str]) -> str | None:
    """Why a checkpoint's routed experts are not read: each projection's experts stored as one tensor
    under transformers 5's in-memory names (`mlp.experts.gate_up_proj`), where the architecture's
    checkpoints store a Linear per expert (AMD Quark 0.13 exports transformers 5's state dict as it
    holds it); None otherwise. gpt-oss's checkpoints pack experts so: read (packed_experts)."""
    names = [canonical_name(name) for name in names]
    fused = sorted(
        name
        for name in names
        if name.rpartition(".")[0].endswith(".experts") and name.rpartition(".")[2] in FUSED_EXPERT_TENSORS
    )
    if not fused:  # the config is not read at all then (a malformed one is audit's to report)
        return None
    arch = _moe_layout(config, names)
    if arch is None or arch.packs_experts:
        return None
    return (
        f"{len(fused)} routed-expert tensor(s) stored fused under transformers 5's in-memory names (e.g. {fused[0]}), "
        f"not a Linear per expert as {config.get('model_type')} checkpoints store them: a layout not read here"
    )


def _moe_layout(config: Mapping, names: list[str]) -> Architecture | None:
    """The registered mixture-of-experts architecture of `config` whose layout it gives; None for
    any other (unregistered, dense, or a config its layout cannot be read from: audit's to report)."""
    try:
        arch = known_layout(config, names)
    except HarnessError:  # LayoutError, or a config the model class refuses
        return None
    return arch if arch is not None and arch.moe is not None else None


#: the suffixes an expert's first projection is stored under in some format (weight, packed, GPTQ/AWQ's qweight)
_SUFFIXES = ("weight", "weight_packed", "qweight")


@dataclass(frozen=True)
class Packed:
    """How a model holds one packed experts tensor: per expert, the checkpoint tensors of each
    part concatenated along dim 1 of the stack (after `transposed`: gpt-oss holds [E, K, N])."""

    parts: tuple[list[str], ...]
    transposed: bool = False


def packed_experts(arch: Architecture, settings: Mapping) -> dict[str, Packed]:
    """model name of each packed expert tensor -> how it is made of checkpoint tensors."""
    moe = arch.moe
    if moe is None:
        return {}
    gate, up, down = moe.parts
    packed = {}
    for layer in range(settings["num_hidden_layers"]):
        if not arch.is_sparse(settings, layer):
            continue
        source = f"model.layers.{layer}.{moe.block}.experts"
        target = f"model.layers.{layer}.{moe.held_under}.experts"
        experts = range(settings[moe.experts_key])
        if moe.fused_gate_up:  # gpt-oss: x @ W.T, biases beside (GptOssExperts)
            for proj in ("gate_up_proj", "down_proj"):
                packed[f"{target}.{proj}"] = Packed(([f"{source}.{e}.{proj}.weight" for e in experts],), True)
                packed[f"{target}.{proj}_bias"] = Packed(([f"{source}.{e}.{proj}.bias" for e in experts],))
            continue
        packed[f"{target}.gate_up_proj"] = Packed(
            (
                [f"{source}.{e}.{gate}.weight" for e in experts],
                [f"{source}.{e}.{up}.weight" for e in experts],
            ),
            moe.held_transposed,
        )
        packed[f"{target}.down_proj"] = Packed(([f"{source}.{e}.{down}.weight" for e in experts],), moe.held_transposed)
    return packed


def renamed(arch: Architecture, name: str) -> str:
    """A checkpoint name as the model calls it (Mixtral's block_sparse_moe lives under mlp)."""
    if arch.moe and arch.moe.block != arch.moe.held_under:
        return name.replace(f".{arch.moe.block}.", f".{arch.moe.held_under}.")
    return name


def checkpoint_name(arch: Architecture, name: str) -> str:
    """The inverse of `renamed`: a model name as the checkpoint stores it."""
    if arch.moe and arch.moe.block != arch.moe.held_under:
        return name.replace(f".{arch.moe.held_under}.", f".{arch.moe.block}.")
    return name


def to_model_state(config: Mapping, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors -> the model's state dict names (experts packed). Tensors of
    a packed group that are absent leave the group out (the model reports it missing)."""
    arch = known_layout(config, state)
    if arch is None:
        return state
    result = dict(state)
    for target, packing in packed_experts(arch, layout_settings(config)).items():
        if not all(name in result for part in packing.parts for name in part):
            continue
        stacked = torch.cat([torch.stack([result.pop(name) for name in part]) for part in packing.parts], dim=1)
        result[target] = stacked.transpose(1, 2) if packing.transposed else stacked
    return {renamed(arch, name): tensor for name, tensor in result.items()}


def to_checkpoint_names(
    config: Mapping, held: dict[str, torch.Tensor], stored: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's names (`stored`: those names, which choose the
    experts' naming): packed experts split per expert and part."""
    arch = known_layout(config, stored)
    if arch is None:
        return held
    packed = packed_experts(arch, layout_settings(config))
    result = {}
    for name, tensor in held.items():
        packing = packed.get(name.removesuffix(".weight"))
        if packing is None:
            result[checkpoint_name(arch, name)] = tensor
            continue
        parts = packing.parts
        tensor = tensor.transpose(1, 2) if packing.transposed else tensor
        widths = [tensor.shape[1] // len(parts)] * len(parts)
        for part, piece in zip(parts, torch.split(tensor, widths, dim=1), strict=True):
            for expert, stored in enumerate(part):
                result[stored] = piece[expert]
    return result


def report_names(config: Mapping, names: list[str], stored: Iterable[str] | None = None) -> list[str]:
    """A load report's key names (the model's) as the checkpoint names them (`stored`: its tensor
    names): a packed experts tensor stands for every expert's tensors of its parts, Mixtral's `mlp`
    is `block_sparse_moe`."""
    arch = known_layout(config, stored)
    if arch is None:
        return list(names)
    packed = packed_experts(arch, layout_settings(config))
    result = []
    for name in names:
        packing = packed.get(name.removesuffix(".weight"))
        result += [n for part in packing.parts for n in part] if packing else [checkpoint_name(arch, name)]
    return result
