"""The forward a checkpoint specifies beyond its weights: which Linears quantize their inputs and
how (harness.oracle.activations), and whether the KV cache is FP8 with which scales
(harness.oracle.kv_cache). `plan` reads it from a checkpoint; `Plan.install` hooks it into a
transformers model whose weights are already the dequantized truth (the reference engine)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from harness.core.errors import HarnessError
from harness.core.naming import canonical_name
from harness.oracle import activations, expert_activations, kv_cache


@dataclass
class Plan:
    scheme: activations.ActivationScheme | None
    #: quantized Linear -> its static input scale (None for dynamic schemes)
    inputs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    #: attention module -> (k_scale, v_scale) of an FP8 KV cache
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: that cache's element format: "fp8" (E4M3) or "fp8_e5m2"
    kv_kind: str = "fp8"
    #: where it is quantized (harness.oracle.kv_cache.quantized_at): "cache" or "projection"
    kv_at: str = "cache"
    #: a model's packed experts module -> per expert, the (gate, up, down) static input scales
    experts: dict[str, list[tuple]] = field(default_factory=dict)
    #: a Linear or packed experts module whose inputs another scheme quantizes (a mixed checkpoint's
    #: config groups, harness.formats.mixed) -> that scheme
    own: dict[str, activations.ActivationScheme] = field(default_factory=dict)

    def quantized_outputs(self) -> set[str]:
        """The Linears whose outputs the plan quantizes (a KV cache quantized at its projections)."""
        if self.kv_at != "projection":
            return set()
        return {f"{module}.{projection}" for module in self.kv for projection in kv_cache.PROJECTIONS}

    def scheme_for(self, name: str) -> activations.ActivationScheme | None:
        """The scheme that quantizes the inputs of the Linear or packed experts module `name`."""
        return self.own.get(name, self.scheme)

    @contextmanager
    def installed(self, model: torch.nn.Module, variant: str = "float64"):
        """`install` for the duration of a with-block: the model is restored on leaving it."""
        handles = self.install(model, variant)
        try:
            yield model
        finally:
            for handle in handles:
                handle.remove()

    def install(self, model: torch.nn.Module, variant: str = "float64") -> list:
        """Hook the plan into `model`; the handles (removing them restores the model). `variant`
        (VARIANTS): the definition, or one of its rounding variants."""
        if variant not in VARIANTS:
            raise HarnessError(f"unknown variant {variant!r} of the specified forward; one of {', '.join(VARIANTS)}")
        arithmetic, _, nudge = variant.partition("+")
        handles = [_WeightsOneUlp(model, self, nudge)] if nudge else []
        try:
            for declared in dict.fromkeys(map(self.scheme_for, [*self.inputs, *self.experts])):
                inputs = {name: scale for name, scale in self.inputs.items() if self.scheme_for(name) == declared}
                experts = {name: scales for name, scales in self.experts.items() if self.scheme_for(name) == declared}
                scheme = dataclasses.replace(declared, arithmetic=arithmetic)
                handles += activations.install(model, inputs, scheme)
                handles += expert_activations.install(model, experts, scheme)
            return handles + kv_cache.install(model, self.kv, arithmetic, self.kv_kind, self.kv_at)
        except BaseException:  # a half-installed plan would change every later forward
            for handle in handles:
                handle.remove()
            raise


#: the specified forward ("float64": the definition, its arithmetic float64) and its rounding
#: variants, whose largest distance from it is the reference's own noise floor for this checkpoint:
#: "model", activations (and the KV cache) quantized in the model's dtype as engines do; "+weights-
#: toward-zero" / "+weights-away-from-zero", every quantized weight one ulp off, a weight the weight
#: tolerance accepts (2 ulps) as engines hold it (e.g. with the scale cast to the model dtype). One
#: variant alone can miss how a checkpoint amplifies rounding: an x1000-weight bfloat16 model's
#: logits moved 0.28 to 1.68 under single variants and 6.3 under "model+weights-away-from-zero",
#: as far as the engines that quantize its activations exactly as "model" does (docs/findings.md).
VARIANTS = (
    "float64",
    "model",
    "float64+weights-toward-zero",
    "float64+weights-away-from-zero",
    "model+weights-toward-zero",
    "model+weights-away-from-zero",
)


class _WeightsOneUlp:
    """Moves the quantized modules' weights (the plan's Linears and packed experts) one ulp toward
    or away from zero in place; `remove` puts them back, as a hook handle does."""

    def __init__(self, model: torch.nn.Module, plan: Plan, nudge: str):
        modules = dict(model.named_modules())
        self.saved = []
        for name in (*plan.inputs, *plan.experts):
            module = modules.get(name)
            for attribute in ("weight", "gate_up_proj", "down_proj"):
                parameter = getattr(module, attribute, None)
                if isinstance(parameter, torch.Tensor) and parameter.is_floating_point():
                    self.saved.append((parameter, parameter.detach().clone()))
                    target = torch.zeros_like(parameter) if nudge == "weights-toward-zero" else parameter * 2
                    with torch.no_grad():
                        parameter.copy_(torch.nextafter(parameter, target))

    def remove(self) -> None:
        with torch.no_grad():
            for parameter, original in self.saved:
                parameter.copy_(original)
        self.saved = []


def describe(quantization_config: dict) -> str:
    """What the config specifies beyond weights, in words (for findings)."""
    parts = []
    scheme = activations.scheme_of(quantization_config)
    if scheme is not None:
        parts.append(scheme.describe())
    if kv_cache.declares_fp8_kv_cache(quantization_config):
        parts.append("FP8 KV cache, static per-tensor scales")
    return "; ".join(parts) or "weights only"


#: engine options that change what the forward is (harness.engines.options), each as the
#: reference models it: vLLM's `kv_cache_dtype=fp8` (E4M3) or `fp8_e5m2` on a checkpoint that
#: declares no FP8 cache quantizes the cache with scale 1.0 for keys and values (its placeholder's
#: initial value; vLLM declines fp8_e5m2 where a checkpoint's method could carry KV scales)
MODELLED_OPTIONS = {"kv_cache_dtype": ("fp8", "fp8_e4m3", "fp8_e5m2")}


def modelled_option(options: dict[str, str]) -> str:
    """The one option in `options` whose forward the reference models, as `key=value`, or ''."""
    return next((f"{k}={v}" for k, v in sorted(options.items()) if v in MODELLED_OPTIONS.get(k, ())), "")


def plan(checkpoint, option: str = "") -> Plan | str:
    """The checkpoint's Plan, or why there is none: a weight-only config, a scheme the definitions
    here do not cover, a static scale or a KV pair that is absent. `option` (modelled_option): the
    forward an engine loaded with that option computes."""
    from harness.oracle.reference import format_and_knobs, group_modules

    config = checkpoint.config.get("quantization_config")
    if not isinstance(config, dict):
        return "the checkpoint is not quantized"
    try:
        fmt, knobs = format_and_knobs(checkpoint)
        scheme_of = _module_schemes(config, fmt, knobs)
        kv = kv_cache.declares_fp8_kv_cache(config)
    except HarnessError as error:
        return str(error)
    names = checkpoint.names()
    modules, _ = group_modules(names, fmt, checkpoint.storage_dtypes())
    schemes = {module: scheme_of(module, set(parts)) for module, parts in modules.items()}
    declared = [s for s in schemes.values() if s is not None] or [activations.scheme_of(config)]
    unit_kv = option.startswith("kv_cache_dtype=") and not kv  # where declared, the option changes nothing
    if declared[0] is None and not kv and not unit_kv:
        return "the config quantizes weights only"
    result = Plan(declared[0])
    for module, parts in modules.items():
        scheme = schemes[module]
        if scheme is None or activations.declared_ignored(config, module) or module.endswith("embed_tokens"):
            continue  # targets: Linear
        if scheme.static and scheme.static not in parts:
            return f"{module} has no {scheme.static} ({scheme.describe()})"
        result.inputs[canonical_name(module)] = checkpoint.tensor(parts[scheme.static]) if scheme.static else None
        if scheme != result.scheme:
            result.own[canonical_name(module)] = scheme
    refusal = _move_experts(result, checkpoint.config, names)
    if refusal:
        return refusal
    if kv:
        try:
            pairs = kv_cache.kv_scales(kv_cache.attention_modules(checkpoint.config, names), set(names))
        except HarnessError as error:
            return str(error)
        result.kv = {canonical_name(m): (checkpoint.tensor(k), checkpoint.tensor(v)) for m, (k, v) in pairs.items()}
        result.kv_at = kv_cache.quantized_at(config)
    if unit_kv:
        one = torch.tensor(1.0)
        result.kv = {canonical_name(m): (one, one) for m in kv_cache.attention_modules(checkpoint.config, names)}
        result.kv_kind = "fp8_e5m2" if option == "kv_cache_dtype=fp8_e5m2" else "fp8"
    return result


def _module_schemes(config: dict, fmt, knobs):
    """(stored module, its tensors' suffixes) -> the scheme that quantizes its input: the config's, or
    in a mixed checkpoint its config group's (harness.formats.mixed; None for a weight-only group)."""
    if not fmt.groups(knobs):
        scheme = activations.scheme_of(config)
        return lambda module, suffixes: scheme
    schemes = {group.group: activations.scheme_of(group.config) for group in fmt.groups(knobs)}

    def scheme_of(module: str, suffixes: set[str]):
        member = fmt.member(module, knobs, suffixes)
        return schemes[member.group] if member is not None else None

    return scheme_of


def _move_experts(result: Plan, config: dict, names: list[str]) -> str | None:
    """Move the routed experts' Linears from `inputs` to `experts`, grouped per packed experts module
    as the model holds them (harness.checkpoints.model_layout); why not, where an expert is not
    quantized like the others. A packed module none of whose experts' inputs are quantized (a mixed
    checkpoint's weight-only group) stays out."""
    from harness.checkpoints.model_layout import known_layout, layout_settings, packed_experts

    arch = known_layout(config, names)
    if result.scheme is None or arch is None or arch.moe is None:
        return None
    packed = packed_experts(arch, layout_settings(config))
    for target, packing in packed.items():
        if not target.endswith(".gate_up_proj") or len(packing.parts) != 2:
            continue  # gpt-oss's fused gate_up: no format of its quantizes activations
        gates, ups = packing.parts
        base = target.removesuffix(".gate_up_proj")
        (downs,) = packed[f"{base}.down_proj"].parts
        experts = [[name.removesuffix(".weight") for name in names] for names in zip(gates, ups, downs, strict=True)]
        every = [module for modules in experts for module in modules]
        absent = [module for module in every if module not in result.inputs]
        if len(absent) == len(every):
            continue
        if absent:
            return f"{absent[0]}: an expert whose input the config does not quantize like the others"
        owned = {result.own.pop(module, result.scheme) for module in every}
        if len(owned) > 1:
            return f"{base}: experts whose inputs the config quantizes in different schemes"
        if owned != {result.scheme}:
            result.own[base] = owned.pop()
        result.experts[base] = [tuple(result.inputs.pop(m) for m in modules) for modules in experts]
    return None
