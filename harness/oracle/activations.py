"""Activation quantization as the checkpoint's config defines it: what a quantized Linear does to
its input before the matmul. Written from the definitions (the QuantizationArgs a config states,
E4M3 and E2M1 rounding from harness.core.numerics), never from an engine's kernels.

The schemes the formats declare (`input_activations` of a config group; `activation_scheme` of
transformers' fp8 config; ModelOpt's `quant_algo`):

- FP8, static per tensor: x -> e4m3(clamp(x / s)) * s with the stored `input_scale` s;
- FP8, dynamic per token: the same with s = amax(row) / 448, per row; per tensor: over all of x;
- FP8, dynamic per group: s = amax / 448 over each row's groups of `group_size` columns (FP8_BLOCK
  and DeepSeek's 1 x 128); a last partial group is the columns that remain;
- INT8, dynamic per token, symmetric (compressed-tensors' W8A8): s = amax(row) / 127.5 (its
  `calculate_qparams`: amax / ((127 - -128) / 2)), x -> round(clamp(x / s, -128, 127)) * s;
- INT8, static per tensor, symmetric (Quark's `int8`): the same with the stored `input_scale` s (its
  zero point 0, harness.formats.quark_int8);
- NVFP4 (FP4 E2M1, tensor_group, groups of 16): with G the global scale in the divisor convention
  (compressed-tensors' `input_global_scale`; ModelOpt's `input_scale` and Quark's `input_scale_2`
  are 1 / G), each group's
  scale b = e4m3(amax / 6 * G) and x -> e2m1(x * G / b) * b / G.
- MXFP4, dynamic, groups of 32 (OCP MX v1.0, as AutoRound declares and computes it: its
  `quant_mx`): each group's scale 2**X with X = floor(log2(amax)) - 2 (2 the E2M1 maximum's
  exponent) clamped to [-127, 127], x -> e2m1(clamp(x / 2**X, -6, 6)) * 2**X. AutoRound's RCEIL
  variant (`act_data_type: mx_fp_rceil`, its `quant_mx_rceil`) takes X = ceil(log2(amax / 6)),
  computed in float32 as it computes it (`exponent="ceil"`): no element then saturates.
  Quark's MXFP4 (`scale_calculation_mode: even`, its `even_round`) rounds the float32 amax to a
  power of two first (up from a mantissa of 1.75, as ct's MX weight scales), then takes its
  exponent minus 2 (`exponent="even"`).
- MXFP4 and MXFP8 as compressed-tensors computes them (its MXFP4 and MXFP8 presets: float 4- or 8-bit
  `group` inputs of 32 with `scale_dtype: torch.uint8`, dynamic): `calculate_qparams` ->
  `generate_mx_scales`, the group amax rounded to a power of two as its MX weight scales are (up from
  a mantissa of 1.75, E2M1's rounding for both widths), its exponent minus the element maximum's
  (2 for E2M1, 8 for E4M3: floor(log2(448))), the scale 2**X, x -> element(clamp(x / 2**X)) * 2**X
  (the `even` rule: compressed-tensors rounds the amax in the activation's dtype, the same power of
  two for every amax normal there).

A group (or row) whose amax is zero stays zero. Arithmetic is float64 and the result is cast back
to the activation's dtype; `arithmetic="model"` computes the same definition in the activation's
own dtype, as engines do, so that the distance between the two says how far this checkpoint's
logits move when the definition is merely rounded differently (the reference's own noise floor).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from harness.core.errors import HarnessError
from harness.core.numerics import E2M1_MAX, E2M1_TABLE, E4M3_MAX, NVFP4_GROUP, encode_e2m1, encode_e4m3, encode_e5m2
from harness.formats import auto_round, equivalents, quark
from harness.formats.ct_mxfp4 import GROUP as MXFP4_GROUP
from harness.formats.ct_mxfp4 import round_to_power_of_two

#: compressed-tensors' symmetric int8 scale divisor: (127 - -128) / 2
INT8_HALF_RANGE = 127.5
#: OCP MX: floor(log2(6)), the E2M1 maximum's exponent, and the E8M0 scale's exponent range
MX_ELEMENT_EXPONENT = 2
MX_SCALE_EXPONENT = 127


def _e2m1_values(x: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    return E2M1_TABLE.to(work)[encode_e2m1(x)]


def _e4m3_values(x: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    return encode_e4m3(x).to(work)


#: an MX element: its maximum's exponent (floor(log2(max))), its maximum, its rounding (values in `work`)
MX_ELEMENTS = {"mxfp4": (MX_ELEMENT_EXPONENT, E2M1_MAX, _e2m1_values), "mxfp8": (8, E4M3_MAX, _e4m3_values)}


@dataclass(frozen=True)
class ActivationScheme:
    kind: str  # "fp8", "int8", "nvfp4", "mxfp4" or "mxfp8"; "fp8_e5m2" (static only: vLLM's e5m2 KV cache)
    strategy: str  # "tensor", "token", "group", "tensor_group"
    dynamic: bool  # scales computed from the activation (NVFP4's group scales always are)
    group_size: int | None = None
    static: str = ""  # the stored tensor suffix of a static scale ("input_scale", "input_global_scale")
    multiplier: bool = False  # NVFP4: the stored global is 1 / G (ModelOpt)
    arithmetic: str = "float64"  # or "model": the activation's own dtype
    exponent: str = (
        "floor"  # an MX scale's exponent: "floor" (OCP MX), "ceil" (AutoRound's RCEIL), "even" (Quark's, ct's)
    )

    def describe(self) -> str:
        how = "dynamic" if self.dynamic and not self.static else f"static {self.static}"
        group = f" of {self.group_size}" if self.group_size else ""
        return f"{self.kind.upper()} {self.strategy}{group} activations, {how}"


def scheme_of(quantization_config: Mapping) -> ActivationScheme | None:
    """The activation scheme a quantization_config declares, or None (weight-only). A scheme
    outside the definitions above is a one-line HarnessError."""
    method, original = quantization_config.get("quant_method"), quantization_config
    if quark.is_nvfp4(original) or quark.is_mxfp4(original) or quark.int8_per_tensor(original):
        return _quark_scheme(original)
    quantization_config = equivalents.read_as(quantization_config)
    if quantization_config.get("quant_method") == "fp8":
        return _finegrained_fp8_scheme(quantization_config)
    groups = [g for g in (quantization_config.get("config_groups") or {}).values() if isinstance(g, dict)]
    inputs = [g.get("input_activations") for g in groups if g.get("input_activations")]
    if not inputs:
        return None
    args = inputs[0]
    bits, strategy = args.get("num_bits"), args.get("strategy") or "tensor"  # ModelOpt states none: per tensor
    if _ct_mx(args) and method != auto_round.AUTO_ROUND:  # compressed-tensors' MXFP4 and MXFP8 presets
        if args.get("dynamic") is not True:
            raise HarnessError(f"MX activations are defined here dynamic, in groups of {MXFP4_GROUP}, only")
        return ActivationScheme(f"mxfp{bits}", "group", True, MXFP4_GROUP, exponent="even")
    if bits == 8 and args.get("type") == "float":
        dynamic = args.get("dynamic") is True
        if strategy not in ("tensor", "token", "group") or (strategy == "token" and not dynamic):
            raise HarnessError(f"FP8 activations with strategy {strategy!r} are not defined here")
        return ActivationScheme("fp8", strategy, dynamic, args.get("group_size"), "" if dynamic else "input_scale")
    if bits == 8 and args.get("type") == "int":
        if (strategy, args.get("dynamic"), args.get("symmetric", True)) != ("token", True, True):
            raise HarnessError(
                f"INT8 activations with strategy {strategy!r} are defined here dynamic, symmetric, per token only"
            )
        return ActivationScheme("int8", "token", True)
    if bits == 4 and args.get("type") == "float" and strategy == "group" and method == auto_round.AUTO_ROUND:
        if args.get("dynamic") is not True or args.get("group_size") != MXFP4_GROUP:
            raise HarnessError(f"MXFP4 activations are defined here dynamic, in groups of {MXFP4_GROUP}, only")
        rceil = str(original.get("act_data_type", "")).endswith(auto_round.RCEIL)
        return ActivationScheme("mxfp4", "group", True, MXFP4_GROUP, exponent="ceil" if rceil else "floor")
    if bits == 4 and args.get("type") == "float" and strategy in ("tensor_group", "tensor"):
        if method == "modelopt":
            return ActivationScheme("nvfp4", "tensor_group", True, NVFP4_GROUP, "input_scale", multiplier=True)
        return ActivationScheme("nvfp4", "tensor_group", True, NVFP4_GROUP, "input_global_scale")
    raise HarnessError(
        f"activations of {bits} bits, type {args.get('type')!r}, strategy {strategy!r} are not defined here"
        f" (quant_method {method!r})"
    )


def _finegrained_fp8_scheme(config: Mapping) -> ActivationScheme:
    """FineGrainedFP8 (DeepSeek): dynamic 1 x block_cols groups; per token where one scale covers
    the weight (`weight_block_size: null`: transformers' tensor-scale kernel, finegrained-fp8's
    w8a8_tensor_dynamic_fp8_matmul, takes one input scale per row); static: one per tensor. Without
    the key, vLLM's per-tensor FP8 (harness.formats.autofp8): dynamic per tensor."""
    if config.get("activation_scheme", "dynamic") != "dynamic":
        return ActivationScheme("fp8", "tensor", False, static="input_scale")
    if "weight_block_size" not in config:  # vLLM's per-tensor FP8 (AutoFP8's FP8DynamicLinear)
        return ActivationScheme("fp8", "tensor", True)
    if config["weight_block_size"] is None:
        return ActivationScheme("fp8", "token", True)
    block = config["weight_block_size"]
    cols = block[-1] if isinstance(block, list) else block
    return ActivationScheme("fp8", "group", True, int(cols))


def _ct_mx(args: Mapping) -> bool:
    """Whether input args are compressed-tensors' MX scheme (its `should_generate_mx_scales`)."""
    return (args.get("num_bits"), args.get("type"), args.get("strategy"), args.get("group_size")) in (
        (4, "float", "group", MXFP4_GROUP),
        (8, "float", "group", MXFP4_GROUP),
    ) and args.get("scale_dtype") == "torch.uint8"


def _quark_scheme(config: Mapping) -> ActivationScheme | None:
    """The inputs of Quark's schemes read under its own names: NVFP4's are ModelOpt's, with the
    multiplier `input_scale_2`; MXFP4's are dynamic, their scales by Quark's `even` rounding, or static
    FP8 per tensor (`mxfp4_fp8`); int8's static per tensor."""
    if config["global_quant_config"].get("input_tensors") is None:
        return None
    if quark.int8_per_tensor(config):
        return ActivationScheme("int8", "tensor", False, static="input_scale")
    if quark.fp8_static_tensor(config["global_quant_config"]["input_tensors"]):  # MXFP4 weights, FP8 inputs
        return ActivationScheme("fp8", "tensor", False, static="input_scale")
    if quark.is_nvfp4(config):
        return ActivationScheme("nvfp4", "tensor_group", True, NVFP4_GROUP, "input_scale_2", multiplier=True)
    return ActivationScheme("mxfp4", "group", True, MXFP4_GROUP, exponent="even")


def declared_ignored(quantization_config: Mapping, module: str) -> bool:
    """Whether the config leaves `module` unquantized: its `ignore` (compressed-tensors, ModelOpt),
    `modules_to_not_convert` (transformers' fp8), `exclude` (Quark) or `ignored_layers` (AutoFP8) names it exactly, by `re:`
    pattern or by wildcard."""
    get = quantization_config.get
    patterns = get("ignore") or get("modules_to_not_convert") or get("exclude") or get("ignored_layers") or []
    for pattern in patterns:
        if not isinstance(pattern, str):
            continue
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], module):
                return True
        elif pattern == module or fnmatch.fnmatchcase(module, pattern):
            return True
    return False


def _fp8(x: torch.Tensor, scale: torch.Tensor, encode=encode_e4m3) -> torch.Tensor:
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = encode(x / safe).to(x.dtype) * safe
    return torch.where(scale > 0, quantized, torch.zeros_like(quantized))


def _grouped(x: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """[..., K] -> [..., ceil(K/size), size], zero-padded (zeros move no amax)."""
    columns = x.shape[-1]
    pad = (-columns) % size
    return torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, size), columns


def quantize_activations(x: torch.Tensor, scheme: ActivationScheme, stored: torch.Tensor | None = None) -> torch.Tensor:
    """`x` as the scheme quantizes it (dequantized back, float64 -> x's dtype). `stored` is the
    module's static scale tensor where the scheme has one."""
    work = torch.float64 if scheme.arithmetic == "float64" else x.dtype
    x64 = x.to(work)
    if scheme.static and stored is None:
        raise HarnessError(f"{scheme.describe()}: the module has no {scheme.static}")
    if scheme.kind == "fp8_e5m2" and scheme.static:
        return _fp8(x64, stored.to(work).reshape(()), encode_e5m2).to(x.dtype)
    if scheme.kind == "fp8":
        if scheme.static:
            result = _fp8(x64, stored.to(work).reshape(()))
        elif scheme.strategy == "tensor":
            result = _fp8(x64, x64.abs().amax() / E4M3_MAX)
        elif scheme.strategy == "token":
            result = _fp8(x64, x64.abs().amax(dim=-1, keepdim=True) / E4M3_MAX)
        else:
            groups, columns = _grouped(x64, scheme.group_size)
            result = _fp8(groups, groups.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).flatten(-2)[..., :columns]
        return result.to(x.dtype)
    if scheme.kind == "int8":
        if scheme.static:
            scale = stored.to(work).reshape(())
        else:
            scale = x64.abs().amax(dim=-1, keepdim=True) / INT8_HALF_RANGE
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        result = torch.round((x64 / safe).clamp(-128, 127)) * safe
        return torch.where(scale > 0, result, torch.zeros_like(result)).to(x.dtype)
    if scheme.kind in MX_ELEMENTS:
        return _mx(x64, scheme.group_size, work, scheme.exponent, scheme.kind).to(x.dtype)
    value = float(stored.to(torch.float64).reshape(()))
    global_scale = 1.0 / value if scheme.multiplier else value
    groups, columns = _grouped(x64, NVFP4_GROUP)
    block = encode_e4m3(groups.abs().amax(dim=-1, keepdim=True) / E2M1_MAX * global_scale).to(work)
    safe = torch.where(block > 0, block, torch.ones_like(block))
    codes = encode_e2m1(groups * global_scale / safe)
    values = E2M1_TABLE.to(work)[codes] * safe / global_scale
    values = torch.where(block > 0, values, torch.zeros_like(values))
    return values.flatten(-2)[..., :columns].to(x.dtype)


def _mx(x: torch.Tensor, size: int, work: torch.dtype, rule: str, kind: str) -> torch.Tensor:
    """MX FP4 or FP8 (`kind`, MX_ELEMENTS) of `x` in groups of `size`. OCP's floor rule: the scale
    exponent from frexp (floor(log2) exactly, in any dtype); the ceil rule as AutoRound computes it,
    in float32; the even rule as Quark computes it (the float32 amax rounded to a power of two, as
    ct's MX weights' scales are: a zero amax counts as the smallest normal), which is compressed-tensors'
    too (it rounds in the activation's dtype: the same power of two for every amax normal there).
    Powers of two and element values are exact in `work`."""
    element_exponent, element_max, encode = MX_ELEMENTS[kind]
    groups, columns = _grouped(x, size)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    if rule == "ceil":  # ceil(log2(amax / 6)), float32 as quant_mx_rceil (a zero amax: its values stay 0)
        shared = torch.ceil(torch.log2(amax.to(torch.float32) / element_max)).to(torch.int64)
        shared = torch.where(amax > 0, shared, 0)
    elif rule == "even":  # Quark's `even_round` and ct's MX scales: the amax rounded to a power of two (up from 1.75)
        power = round_to_power_of_two(amax.to(torch.float32)).to(torch.float64)
        shared = torch.where(power > 0, torch.log2(power.clamp(min=2.0**-149)), -126.0).to(torch.int64)
        shared = shared - element_exponent
    else:
        _, exponent = torch.frexp(amax.to(torch.float64))  # amax = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
        shared = exponent - 1 - element_exponent
    shared = shared.clamp(-MX_SCALE_EXPONENT, MX_SCALE_EXPONENT)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), shared).to(work)
    values = encode((groups / scale).clamp(-element_max, element_max), work) * scale
    values = torch.where(amax > 0, values, torch.zeros_like(values))
    return values.flatten(-2)[..., :columns]


def install(model: torch.nn.Module, modules: Mapping[str, torch.Tensor | None], scheme: ActivationScheme) -> list:
    """Quantize the input of each named Linear of `model` (name -> its static scale, or None) with
    forward pre-hooks; the handles, to remove them. A name the model has no Linear for is a
    HarnessError: a partly quantized forward would be neither candidate."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    absent = sorted(set(modules) - set(linears))
    if absent:
        raise HarnessError(f"no Linear in the model for {len(absent)} quantized module(s), e.g. {absent[0]}")
    handles = []
    for name, stored in modules.items():

        def hook(module, args, stored=stored):
            return (quantize_activations(args[0], scheme, stored), *args[1:])

        handles.append(linears[name].register_forward_pre_hook(hook))
    return handles
