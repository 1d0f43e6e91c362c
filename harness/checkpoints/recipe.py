"""A recipe fully determines a generated checkpoint: architecture, sizes, format, knobs,
layout and perturbations, plus a seed. It is stored in the manifest, so any checkpoint can
be regenerated bit for bit from it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.checkpoints import foreign_configs, ignore_patterns, kv_scales
from harness.checkpoints.architectures import ARCHITECTURES
from harness.checkpoints.disagreements import CHOICES as DISAGREEMENT_CHOICES
from harness.checkpoints.fusion import CHOICES as FUSED_SCALES
from harness.checkpoints.fusion import shares_scales
from harness.checkpoints.kv_scales import CHOICES as KV_SCALES
from harness.core.errors import HarnessError
from harness.core.naming import VLM_PREFIX
from harness.formats import FORMAT_NAMES, get_format, require_formats
from harness.formats.autofp8 import is_autofp8
from harness.formats.spelling import CHOICES as SPELLINGS
from harness.formats.spelling import other_case

LAYOUT_DEFAULTS: dict[str, Any] = {
    "shards": 2,  # 1 writes a single model.safetensors without an index
    "split_scale": False,  # put each quantized weight and its scale in different shards
    "key_prefix": "model.",  # or VLM_PREFIX: keys as a vision-language checkpoint stores them
    "dtype": "bfloat16",
    "activation_amax": 4.0,  # the calibration amax behind static activation scales
    "fused_scales": "per-part",  # or shared / distinct-inputs: scales of fused parts (checkpoints.fusion)
    "quantize_lm_head": False,  # lm_head quantized (absent from the ignore list); tied: the list only
    "quantize_embeddings": False,  # embed_tokens stored quantized too
    "kv_scales": "none",  # FP8 KV-cache scales and their naming (harness.checkpoints.kv_scales)
    #: the experts' part names: "architecture" (Mixtral's w1/w3/w2) or "projections" (gate_proj/up_proj/
    #: down_proj, as llm-compressor 0.14 writes Mixtral's): architectures.MoE.other_parts
    "expert_naming": "architecture",
    #: config.json as the model's release writes it ("release") or as transformers' save_pretrained
    #: writes it ("saved": fields its config class does not define dropped, architectures.release_only)
    "config_style": "release",
    #: the ignore list by full names ("names") or as llm-compressor recipes spell it ("patterns":
    #: `re:` entries, harness.checkpoints.ignore_patterns); compressed-tensors formats only
    "ignore_style": "names",
    #: the quantization config's enum-valued fields that their readers compare without case, as
    #: producers write them ("producer") or in the other letter case ("other-case": harness.formats.spelling)
    "config_spelling": "producer",
    #: the quantization config of the format ("native") or of a producer that writes its own over
    #: the same tensors ("auto-round", "modelopt": harness.checkpoints.foreign_configs)
    "producer_config": "native",
}
LAYOUT_CHOICES: dict[str, tuple] = {
    "key_prefix": ("model.", VLM_PREFIX),
    "dtype": ("bfloat16", "float16", "float32"),
    "fused_scales": FUSED_SCALES,
    "quantize_lm_head": (False, True),
    "quantize_embeddings": (False, True),
    "kv_scales": KV_SCALES,
    "expert_naming": ("architecture", "projections"),
    "config_style": ("release", "saved"),
    "ignore_style": ignore_patterns.CHOICES,
    "config_spelling": SPELLINGS,
    "producer_config": foreign_configs.CHOICES,
}

PERTURB_DEFAULTS: dict[str, Any] = {
    "zero_block": False,  # the first scale block of every quantized weight is all zero
    "subnormal_block": False,  # the last scale block is so small its scale is subnormal
    "extreme_amax": "none",  # "tiny" (x1e-4) or "huge" (x1e3) weights: global scales at extremes
    "nonfinite_scale": "none",  # "nan" or "inf" in one scale of the first layer: must be refused
    "disagreement": "none",  # config and tensors disagree on one module (harness.checkpoints.disagreements)
}
PERTURB_CHOICES: dict[str, tuple] = {
    "extreme_amax": ("none", "tiny", "huge"),
    "nonfinite_scale": ("none", "nan", "inf"),
    "disagreement": DISAGREEMENT_CHOICES,
}


@dataclass
class Recipe:
    format: str
    arch: str
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    perturb: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Recipe:
        unknown = set(data) - {"format", "arch", "seed", "config", "knobs", "layout", "perturb"}
        if unknown:
            raise HarnessError(f"recipe has unknown keys: {sorted(unknown)}")
        return cls(**data)

    def resolved(self) -> ResolvedRecipe:
        """Check every value and fill in the defaults; a bad value is a one-line HarnessError."""
        require_formats(self.format)
        if self.arch not in ARCHITECTURES:
            raise HarnessError(f"unknown architecture '{self.arch}' (known: {', '.join(ARCHITECTURES)})")
        fmt = get_format(self.format)
        refusal = pairing_refusal(fmt, ARCHITECTURES[self.arch])
        if refusal:
            raise HarnessError(refusal)
        try:
            settings = ARCHITECTURES[self.arch].settings(self.config)
            knobs = fmt.resolve_knobs(self.knobs)
        except KeyError as error:
            raise HarnessError(f"unknown setting {error}") from None
        except ValueError as error:
            raise HarnessError(str(error)) from None
        layout = _merge("layout", LAYOUT_DEFAULTS, LAYOUT_CHOICES, self.layout)
        perturb = _merge("perturbation", PERTURB_DEFAULTS, PERTURB_CHOICES, self.perturb)
        if not isinstance(layout["shards"], int) or layout["shards"] < 1:
            raise HarnessError(f"shards must be a positive integer, got {layout['shards']!r}")
        if layout["split_scale"] and layout["shards"] < 2:
            raise HarnessError("split_scale needs shards >= 2")
        if ARCHITECTURES[self.arch].packs_experts and perturb["disagreement"] != "none":
            raise HarnessError(
                f"disagreement={perturb['disagreement']}: {self.arch} packs every expert of a projection "
                "into one tensor, so no single module can disagree with the config"
            )
        for key in (*_PACKED_FIXED, "split_scale", "expert_naming", "config_style", "ignore_style", "config_spelling"):
            refusal = layout_refusal(key, layout[key], fmt, ARCHITECTURES[self.arch], knobs)
            if refusal:
                raise HarnessError(refusal)
        for key, value in perturb.items():
            refusal = perturb_refusal(key, value, fmt)
            if refusal:
                raise HarnessError(refusal)
        refusal = layout_refusal("producer_config", layout["producer_config"], fmt, ARCHITECTURES[self.arch], knobs)
        refusal = refusal or foreign_configs.knob_refusal(layout["producer_config"], fmt.name, knobs)
        refusal = refusal or foreign_configs.conflict(layout, perturb)
        if refusal:
            raise HarnessError(refusal)
        return ResolvedRecipe(self, settings, knobs, layout, perturb)


#: architectures whose unquantized release stores its experts packed, one tensor per projection: a
#: layout the generator writes per expert (as their quantized releases store them), which is not
#: theirs unquantized (transformers reads per-expert names of an unquantized Llama-4 as unexpected)
PACKED_WHEN_UNQUANTIZED = {"llama4": "feed_forward.experts.gate_up_proj [E, H, 2I] and down_proj [E, I, H]"}


def pairing_refusal(fmt, arch) -> str | None:
    """Why this format is not written for this architecture, or None: gpt-oss ships only in its
    own MXFP4 layout (experts packed), and that format exists only for it; an unquantized
    Llama-4 stores its experts packed (PACKED_WHEN_UNQUANTIZED)."""
    if not fmt.has_scales and arch.name in PACKED_WHEN_UNQUANTIZED:
        return (
            f"{arch.name} unquantized stores its experts packed ({PACKED_WHEN_UNQUANTIZED[arch.name]}), "
            f"a layout the generator writes per expert only"
        )
    if arch.only_formats and fmt.name not in arch.only_formats:
        return f"{arch.name} is written only in {', '.join(arch.only_formats)} (its release layout)"
    owners = [a.name for a in ARCHITECTURES.values() if fmt.name in a.only_formats]
    if owners and arch.name not in owners:
        return f"{fmt.name} is the layout of {', '.join(owners)} only (experts packed on disk)"
    return None


def home_architecture(format_name: str, default: str = "llama") -> str:
    """The architecture a format is written for when it has one (mxfp4: gpt_oss), else `default`."""
    return next((a.name for a in ARCHITECTURES.values() if format_name in a.only_formats), default)


#: formats whose producers never write a quantized embedding (GPTQ and AWQ quantize nn.Linear
#: layers) or head (AutoAWQ leaves lm_head in its modules_to_not_convert; GPTQ declares it with
#: `lm_head: true`, which the generator writes)
INT_LINEAR_ONLY = {"quantize_embeddings": ("gptq", "awq"), "quantize_lm_head": ("awq",)}
INT_LINEAR_ONLY_WHY = {
    "quantize_embeddings": "Linear layers only (no embedding in their layout)",
    "quantize_lm_head": "no lm_head (AutoAWQ always leaves it unconverted)",
}

#: layout fields an architecture whose experts are packed on disk cannot vary: its release
#: quantizes nothing but the experts, declares no KV scales and stores no per-part scales
_PACKED_FIXED = ("fused_scales", "quantize_lm_head", "quantize_embeddings", "kv_scales")


#: layout fields about scales and the quantization config: a format without them (`unquantized`)
#: writes each at its default only
SCALE_LAYOUT = (
    "split_scale",
    "fused_scales",
    "quantize_lm_head",
    "quantize_embeddings",
    "kv_scales",
    "ignore_style",
    "config_spelling",
    "producer_config",
)
#: perturbations of scales or of the quantization config (all but extreme_amax, which scales the
#: weights themselves)
SCALE_PERTURBATIONS = ("zero_block", "subnormal_block", "nonfinite_scale", "disagreement")


def perturb_refusal(key: str, value: Any, fmt) -> str | None:
    """Why a perturbation's value cannot be written for this format, or None when it can."""
    if not fmt.has_scales and key in SCALE_PERTURBATIONS and value != PERTURB_DEFAULTS[key]:
        return f"{key}={value!r}: {fmt.name} stores no scales and no quantization config"
    return None


def layout_refusal(key: str, value: Any, fmt, arch, knobs: Mapping) -> str | None:
    """Why a layout field's value cannot be written for this format, architecture and knobs, or
    None when it can. The one rule per field that recipes, campaign cells and drawn examples share."""
    if not fmt.has_scales and key in SCALE_LAYOUT and value != LAYOUT_DEFAULTS[key]:
        return f"{key}={value!r}: {fmt.name} stores no scales and no quantization config"
    if arch.packs_experts and key in _PACKED_FIXED and value != LAYOUT_DEFAULTS[key]:
        return f"{key}={value!r}: {arch.name}'s release layout quantizes its experts only, each with its own scales"
    if key == "fused_scales" and value == "shared" and not shares_scales(fmt, knobs):
        return (
            f"fused_scales=shared needs scales that never span two parts' rows (per tensor, per channel, "
            f"NVFP4); {fmt.name} scales blocks of rows"
        )
    if key in ("quantize_embeddings", "quantize_lm_head") and value and fmt.name in INT_LINEAR_ONLY.get(key, ()):
        return f"{key}=True: {fmt.name} producers quantize {INT_LINEAR_ONLY_WHY[key]}"
    if key == "expert_naming" and value != "architecture" and not (arch.moe and arch.moe.other_parts):
        return f"expert_naming={value!r}: {arch.name} has one naming of its experts' parts"
    if key == "config_style" and value != "release" and not arch.release_only:
        return f"config_style={value!r}: no field of {arch.name}'s release config is known to be dropped on save"
    if key == "ignore_style" and value != "names":
        quant_method = fmt.quantization_config(fmt.resolve_knobs(knobs), []).get("quant_method")
        if quant_method != "compressed-tensors":
            return (
                f"ignore_style={value!r}: `re:` ignore entries are compressed-tensors' spelling, not {quant_method}'s"
            )
    if key == "config_spelling" and value != "producer":
        config = fmt.quantization_config(fmt.resolve_knobs(knobs), [])
        if not other_case(config)[1]:
            return f"config_spelling={value!r}: {fmt.name}'s quantization config has no enum-valued field to respell"
        if is_autofp8(config):  # its reader, vLLM's Fp8Config, compares activation_scheme with case
            return (
                f"config_spelling={value!r}: vLLM, the reader of {fmt.name}, compares its activation_scheme with case"
            )
    if key == "producer_config":
        return foreign_configs.refusal(value, fmt, arch)
    if key == "kv_scales":
        try:
            kv_scales.check(value, arch, fmt.quantization_config(fmt.resolve_knobs(knobs), []))
        except HarnessError as error:
            return str(error)
    return None


@dataclass
class ResolvedRecipe:
    recipe: Recipe
    settings: dict[str, Any]
    knobs: dict[str, Any]
    layout: dict[str, Any]
    perturb: dict[str, Any]

    @property
    def arch(self):
        """The recipe's architecture, its experts' parts named as the layout says."""
        arch = ARCHITECTURES[self.recipe.arch]
        if self.layout["expert_naming"] == "projections":
            return dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, parts=arch.moe.other_parts[0]))
        return arch


def _merge(what: str, defaults: Mapping, choices: Mapping, overrides: Mapping) -> dict:
    values = dict(defaults)
    for key, value in overrides.items():
        if key not in defaults:
            raise HarnessError(f"unknown {what} setting '{key}'")
        if key in choices and value not in choices[key]:
            raise HarnessError(f"{key}={value!r}: expected one of {list(choices[key])}")
        values[key] = value
    return values


def parse_value(text: str) -> Any:
    """`--set` values: JSON where it parses (numbers, booleans, lists), a string otherwise."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_settings(recipe: Recipe, assignments: list[str]) -> Recipe:
    """Route each `KEY=VALUE` to the architecture config, the format knobs, the layout or a perturbation."""
    fmt = get_format(recipe.format) if recipe.format in FORMAT_NAMES else None
    arch = ARCHITECTURES.get(recipe.arch)
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        if not sep or not key:
            raise HarnessError(f"--set expects KEY=VALUE, got '{assignment}'")
        value = parse_value(text)
        if arch and (key in arch.settings({})):
            recipe.config[key] = value
        elif fmt and (key in fmt.knobs or key == "block_size"):
            recipe.knobs[key] = value
        elif key in LAYOUT_DEFAULTS:
            recipe.layout[key] = value
        elif key in PERTURB_DEFAULTS:
            recipe.perturb[key] = value
        else:
            known = sorted(
                {*(arch.settings({}) if arch else {}), *(fmt.knobs if fmt else {}), *LAYOUT_DEFAULTS, *PERTURB_DEFAULTS}
            )
            raise HarnessError(f"unknown setting '{key}' (known: {', '.join(known)})")
    return recipe
