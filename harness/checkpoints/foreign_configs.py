"""Producers' own configs over tensors laid out as a format the harness defines (the recipe's
`layout.producer_config`), written as each producer writes them: the inverse of
harness.formats.equivalents, which every reader goes through.

- `auto-round`: AutoRound 0.16's config (`quant_method: auto-round`, `packing_format`), as its own
  exports in cases/producers/autoround carry it: FP8_STATIC over ct-fp8-channel with static inputs
  (row scales stored 1-D [N]), FP8_BLOCK over fp8-block, MXFP4 over ct-mxfp4, NVFP4 over ct-nvfp4,
  and its int4 default, W4A16, in the packing it chooses by symmetry: symmetric over gptq
  (`auto_round:auto_gptq`: v1 zeros, no `g_idx`, float16 scales), asymmetric over awq
  (`auto_round:auto_awq`); its W8A16 in `auto_round:auto_gptq` (symmetric only: AutoRound refuses
  8-bit asymmetric there), and its `auto_round:gptqmodel` export over gptq (v2 zeros, `g_idx` of
  k // g, symmetric or not; 4 bits tried): VARIANTS.
  It has no ignore list: it quantizes the Linears of `block_name_to_quantize` (the decoder layers)
  and names each one it leaves in 16 bits in `extra_config` by a regular expression (a mixture's
  routers, as its special_model_handler keeps `.gate` modules of MoE models: its Mixtral export
  writes `.*model\\.layers\\.0\\.mlp\\.gate.*`, a name the model lacks; the generator names the
  router it has).
- `modelopt`: ModelOpt 0.47's FP8_PER_CHANNEL_PER_TOKEN over ct-fp8-channel with dynamic inputs
  (row scales stored 1-D [N]), as cases/producers/modelopt/fp8_pc_pt carries it, and its FP8_PB_WO
  (`quant_algo: fp8_pb_wo`, FP8_2D_BLOCKWISE_WEIGHT_ONLY) over ct-fp8-block in 128 x 128 blocks with
  inputs unquantized, its float32 grid stored 4-D [N/128, 1, K/128, 1] and 0-D for a weight of one
  block, as cases/producers/modelopt/fp8_pb_wo carries it.

Each pairing writes one producer's real layout only: the producer's scale dtypes and encodings,
no quantized head or embeddings, no KV scales, the ignore list by names, its own spelling, and no
config/tensor disagreement (each of those edits a config these producers do not write).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from harness.core.errors import HarnessError
from harness.formats import auto_round, awq, equivalents, gptq

NATIVE = "native"
CHOICES = (NATIVE, "auto-round", "modelopt")
AUTO_ROUND_VERSION = "0.16.1"
MODELOPT_VERSION = "0.47.0"

#: (producer, format) -> the knob values that producer's export has (checked against the recipe's)
PAIRINGS: dict[tuple[str, str], dict[str, Any]] = {
    ("auto-round", "ct-fp8-channel"): {"input_scale": True, "scale_dtype": "float32"},
    ("auto-round", "fp8-block"): {
        "block_size_style": "list",
        "scale_dtype": "float32",
        "scale_layout": "normal",
        "scale_fmt": "float",
    },
    ("auto-round", "ct-mxfp4"): {"scale_storage": "uint8"},
    ("auto-round", "ct-nvfp4"): {"global_scale_convention": "divisor"},
    ("auto-round", "gptq"): {
        "bits": 4,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
        "scale_storage": "float16",
    },
    ("auto-round", "awq"): {"scale_storage": "float16"},
    ("modelopt", "ct-fp8-channel"): {"input_scale": False, "scale_dtype": "float32"},
    ("modelopt", "ct-fp8-block"): {
        "input_scale": False,
        "scale_dtype": "float32",
        "block_rows": equivalents.MODELOPT_BLOCK[0],
        "block_cols": equivalents.MODELOPT_BLOCK[1],
        "scale_layout": "normal",
    },
}
#: ModelOpt's quant_algo per format, spelled as its exports write it in config.json
MODELOPT_ALGOS = {"ct-fp8-channel": equivalents.MODELOPT_PER_CHANNEL, "ct-fp8-block": "fp8_pb_wo"}
#: (producer, format) -> the other knob values that producer's exports have, each over PAIRINGS':
#: AutoRound 0.16.1's W8A16 and its auto_round:gptqmodel export, symmetric and not
#: (cases/producers/autoround/w8g128_sym_autoround, w4g128_*sym_autoround_gptqmodel)
VARIANTS: dict[tuple[str, str], tuple[dict[str, Any], ...]] = {
    ("auto-round", "gptq"): (
        {"bits": 8},
        {"checkpoint_format": "gptq_v2"},
        {"checkpoint_format": "gptq_v2", "sym": False},
    ),
}
#: AutoRound's packing of its GPTQ layout by zero-point convention
AUTO_ROUND_GPTQ_PACKINGS = {"gptq": gptq.AUTO_ROUND_GPTQ, "gptq_v2": gptq.AUTO_ROUND_GPTQMODEL}
#: (producer, format, checkpoint_format) -> the tensors of a module that producer's export leaves out
#: (AutoRound packs auto_round:auto_gptq without act-order and writes no `g_idx`: readers take k // g;
#: its auto_round:gptqmodel export keeps it)
OMITTED: dict[tuple[str, str, str | None], tuple[str, ...]] = {("auto-round", "gptq", "gptq"): ("g_idx",)}
#: layout fields and perturbations a foreign config keeps at their defaults (see the module's docstring)
NATIVE_ONLY_LAYOUT = ("quantize_lm_head", "quantize_embeddings", "kv_scales", "ignore_style", "config_spelling")
NATIVE_ONLY_PERTURB = ("disagreement",)
#: AutoRound's int4 packings that the int4 formats read themselves (harness.formats.gptq, .awq)
INT4_PACKINGS = (*gptq.AUTO_ROUND_PACKING, awq.AUTO_ROUND_AWQ)
#: what AutoRound writes for a Linear of a quantized block that it leaves in 16 bits
SIXTEEN_BITS = {"bits": 16, "data_type": "fp", "act_bits": 16, "act_data_type": "fp"}


def refusal(producer: str, fmt, arch) -> str | None:
    """Why `producer`'s config is never written over this format's tensors for this architecture,
    or None (the knobs it also needs: `knob_refusal`)."""
    if producer == NATIVE:
        return None
    if (producer, fmt.name) not in PAIRINGS:
        paired = sorted(name for who, name in PAIRINGS if who == producer)
        return f"producer_config={producer!r}: written over {', '.join(paired)} only, not {fmt.name}"
    if not arch.quantized_attention:
        return (
            f"producer_config={producer!r}: {arch.name}'s attention stays unquantized, which it cannot say per Linear"
        )
    return None


def producer_variants(producer: str, fmt_name: str) -> list[dict[str, Any]]:
    """The knob values `producer`'s exports have over this format: PAIRINGS', then each VARIANT."""
    base = PAIRINGS.get((producer, fmt_name), {})
    return [base, *(base | variant for variant in VARIANTS.get((producer, fmt_name), ()))]


def producer_knobs(producer: str, fmt_name: str, knobs: Mapping[str, Any]) -> dict[str, Any]:
    """`knobs` with the values `producer` writes over this format: the variant of its exports that
    agrees with the most of them (the first on a tie), and AutoRound's FP8 blocks square (its
    FP8_BLOCK scheme is 128 x 128 with activations in groups of 128; which edge a non-square
    block's activation group follows its readers disagree on: vLLM takes the first)."""
    chosen = max(
        producer_variants(producer, fmt_name), key=lambda v: sum(knobs.get(k) == value for k, value in v.items())
    )
    fixed = {**knobs, **chosen}
    if (producer, fmt_name) == ("auto-round", "fp8-block") and "block_rows" in fixed:
        fixed["block_cols"] = fixed["block_rows"]
    return fixed


def knob_refusal(producer: str, fmt_name: str, knobs: Mapping[str, Any]) -> str | None:
    """Why these knobs are not what `producer` writes over this format (producer_knobs), or None."""
    wanted = producer_knobs(producer, fmt_name, knobs)
    differing = {key: value for key, value in wanted.items() if knobs.get(key) != value}
    if differing:
        return f"producer_config={producer!r} over {fmt_name} needs the knobs {producer} writes: set {differing}"
    return None


def conflict(layout: Mapping[str, Any], perturb: Mapping[str, Any]) -> str | None:
    """Why a foreign config cannot go with these layout fields and perturbations, or None."""
    from harness.checkpoints.recipe import LAYOUT_DEFAULTS, PERTURB_DEFAULTS  # recipe imports this module

    producer = layout["producer_config"]
    if producer == NATIVE:
        return None
    for key in NATIVE_ONLY_LAYOUT:
        if layout[key] != LAYOUT_DEFAULTS[key]:
            return f"producer_config={producer!r} writes no {key}={layout[key]!r}"
    for key in NATIVE_ONLY_PERTURB:
        if perturb[key] != PERTURB_DEFAULTS[key]:
            return f"producer_config={producer!r} with perturbation {key}={perturb[key]!r}"
    return None


def quantization_config(producer: str, fmt_name: str, knobs: Mapping[str, Any], ignored: list[str], prefix: str):
    """`producer`'s quantization_config for this format's tensors; `ignored` are the modules left
    unquantized by their full stored names, `prefix` the checkpoint's key prefix."""
    if producer == "modelopt":
        return {
            "ignore": list(ignored),
            "quant_algo": MODELOPT_ALGOS[fmt_name],
            "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quant_method": "modelopt",
        }
    config = {"sym": True, **_auto_round_scheme(fmt_name, knobs), "amp": False}
    config |= {"autoround_version": AUTO_ROUND_VERSION, "block_name_to_quantize": f"{prefix}layers"}
    config |= {"enable_quanted_input": False, "quant_method": auto_round.AUTO_ROUND}
    unquantized = {key: value for key, value in SIXTEEN_BITS.items() if config.get(key) != value}
    in_blocks = [name for name in ignored if name.startswith(f"{prefix}layers.")]
    if in_blocks:  # keyed by regular expressions, as its export writes its predefined ignore layers
        config["extra_config"] = {f".*{re.escape(name)}.*": dict(unquantized) for name in in_blocks}
    return dict(sorted(config.items()))


def _auto_round_scheme(fmt_name: str, knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The scheme fields of AutoRound's config for each format, as its exports write them."""
    if fmt_name == "ct-fp8-channel":  # FP8_STATIC
        return {
            "act_bits": 8,
            "act_data_type": "fp",
            "act_dynamic": False,
            "act_group_size": 0,
            "act_sym": True,
            "activation_scheme": "static",
            "bits": 8,
            "data_type": "fp",
            "fmt": "e4m3",
            "group_size": -1,
            "packing_format": auto_round.FP8_STATIC,
        }
    if fmt_name == "fp8-block":  # FP8_BLOCK
        block = [knobs["block_rows"], knobs["block_cols"]]
        return {
            "act_bits": 8,
            "act_data_type": "fp",
            "act_dynamic": True,
            "act_group_size": block[1],
            "act_sym": True,
            "activation_scheme": "dynamic",
            "bits": 8,
            "data_type": "fp",
            "fmt": "e4m3",
            "group_size": block,
            "packing_format": auto_round.FP8_BLOCK,
            "weight_block_size": block,
        }
    if fmt_name in ("gptq", "awq"):  # W4A16 / W8A16: the packing as the module docstring says
        gptq_packing = fmt_name == "gptq" and AUTO_ROUND_GPTQ_PACKINGS[knobs["checkpoint_format"]]
        return {
            "bits": knobs["bits"] if fmt_name == "gptq" else 4,
            "data_type": "int",
            "group_size": knobs["group_size"],
            "packing_format": gptq_packing or awq.AUTO_ROUND_AWQ,
            "sym": fmt_name == "gptq" and knobs["sym"],
        }
    data_type, act_data_type, group = {
        "ct-mxfp4": ("mx_fp", "mx_fp", 32),
        "ct-nvfp4": ("nv_fp", auto_round.STATIC_NVFP4_INPUTS, 16),
    }[fmt_name]
    return {
        "act_bits": 4,
        "act_data_type": act_data_type,
        "act_dynamic": True,
        "act_group_size": group,
        "act_sym": True,
        "bits": 4,
        "data_type": data_type,
        "group_size": group,
        "packing_format": auto_round.LLM_COMPRESSOR,
    }


#: the formats whose per-row scales [N, 1] the foreign producers store 1-D [N] (AutoRound's
#: FP8_STATIC and ModelOpt's per-channel FP8 both do: harness.formats.equivalents.ROW_SCALES_1D)
ROW_SCALES_1D_FORMATS = ("ct-fp8-channel",)
#: the formats whose block grid [N/bn, K/bk] the foreign producers store as ModelOpt does
#: ([N/bn, 1, K/bk, 1], 0-D for a single block: harness.formats.equivalents.BLOCK_GRID_4D)
BLOCK_GRID_4D_FORMATS = ("ct-fp8-block",)


def modelopt_block_grid(grid: torch.Tensor) -> torch.Tensor:
    """A [N/bn, K/bk] scale grid as ModelOpt 0.47's export stores it (cases/producers/modelopt/fp8_pb_wo:
    a [256, 128] weight's grid [2, 1, 1, 1], a [128, 256] one's [1, 1, 2, 1], a [64, 128] one's [])."""
    if grid.numel() == 1:
        return grid.reshape(())
    return grid.reshape(grid.shape[0], 1, grid.shape[1], 1)


def stored(
    producer: str, fmt_name: str, tensors: Mapping[str, torch.Tensor], knobs: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """One module's quantized tensors as `producer` stores them."""
    if producer == NATIVE:
        return dict(tensors)
    omitted = OMITTED.get((producer, fmt_name, knobs.get("checkpoint_format")), ())
    tensors = {suffix: t for suffix, t in tensors.items() if suffix not in omitted}
    if fmt_name in ROW_SCALES_1D_FORMATS:
        tensors["weight_scale"] = tensors["weight_scale"].reshape(-1)
    elif fmt_name in BLOCK_GRID_4D_FORMATS:
        tensors["weight_scale"] = modelopt_block_grid(tensors["weight_scale"])
    return tensors


def producer_config_of(config: Mapping[str, Any]) -> str:
    """What `layout.producer_config` a checkpoint's quantization_config amounts to: the producer
    whose own config is read through harness.formats.equivalents or by the int4 formats (AutoRound's
    GPTQ and AWQ packings), else "native"."""
    if config.get("quant_method") == auto_round.AUTO_ROUND and config.get("packing_format") in INT4_PACKINGS:
        return "auto-round"
    try:
        if not equivalents.equivalent_config(config):
            return NATIVE
    except (HarnessError, ValueError):  # beyond the definitions (UnsupportedFormat, FormatError)
        return NATIVE
    return "auto-round" if config.get("quant_method") == auto_round.AUTO_ROUND else "modelopt"
