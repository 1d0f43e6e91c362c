"""AMD Quark's own config (`quant_method: quark`, written by quark.torch's `export_safetensors`) read
as the defined format its tensors are laid out in (harness.formats.equivalents).

Quark's config holds one `global_quant_config` (QuantizationSpecs for `weight`, `input_tensors`,
`output_tensors`), optional per-layer overrides (`layer_quant_config`, `layer_type_quant_config`),
`exclude` (the modules left unquantized) and `export` (`weight_format`, `pack_method`,
`kv_cache_group`). Measured on amd-quark 0.13's own exports (cases/producers/quark):

- FP8 per tensor (its `fp8` scheme: weight and input fp8_e4m3 `per_tensor`, static): e4m3 `weight`,
  one bfloat16 `weight_scale` stored 0-D (a multiplier, amax / 448) and a 0-D `input_scale`. That is
  compressed-tensors' float-quantized tensor strategy with static inputs, its [1] scales stored 0-D
  (the reading knob SCALAR_SCALES).
- FP8 per channel (`ptpc_fp8`: weight `per_channel` on axis 0, input `per_channel` on axis 1 and
  dynamic, i.e. one scale per token): e4m3 `weight`, bfloat16 `weight_scale` [N]. That is
  compressed-tensors' FP8_DYNAMIC, its [N, 1] scales stored [N] (ROW_SCALES_1D).

- NVFP4 (`nvfp4`: weight and input specs each a pair, e2m1 per group of 16 and the e4m3 scales'
  own per-tensor scale): ModelOpt's tensors under Quark's names, a format of its own
  (harness.formats.quark_nvfp4; `is_nvfp4` below).

- int4 and uint4 weight-only over groups (`int4_wo_128`, `uint4_wo_128`: packed along the outputs in
  its `reorder` order, AutoAWQ's): AWQ's layout under Quark's names, signed codes where symmetric
  (harness.formats.quark_int4; `int4_weights` below); per output row (`uint4_wo_per_channel`): packed
  along the inputs instead, a format of its own (harness.formats.quark_int4_channel; `int4_per_channel`).

- MXFP4 (`mxfp4`: weight and dynamic input e2m1 per group of 32, E8M0 scales, `even` rounding):
  compressed-tensors' MXFP4 tensors under Quark's names (harness.formats.quark_mxfp4; `is_mxfp4`);
  `mxfp4_weight_only` the same weights alone, `mxfp4_fp8` with a static FP8 input per tensor
  (bfloat16 0-D `input_scale`, a multiplier as its `fp8` scheme's).

- INT8 per tensor (`int8`: weight and input int8 `per_tensor`, static, symmetric): int8 `weight`,
  float32 0-D `weight_scale` and `input_scale`, int8 0-D `weight_zero_point` and `input_zero_point`
  (zeros: symmetric), a format of its own (harness.formats.quark_int8; `int8_per_tensor` below).

- An FP8 KV cache (`kv_cache_scheme="fp8"`; measured on its FP8 and MXFP4 schemes, read beside any
  scheme defined here, each override checked against it): `kv_cache_group` `*k_proj`, `*v_proj`,
  each a per-layer override (`layer_quant_config`, and the same in `kv_cache_quant_config`) that is the
  global scheme plus static FP8 per-tensor `output_tensors`; bfloat16 0-D `k_proj.output_scale` and
  `v_proj.output_scale`. With `kv_cache_post_rope: false` Quark quantizes the projections' outputs,
  before the rotary embedding (harness.oracle.kv_cache): compressed-tensors' kv_cache_scheme beside
  the equivalent config (`kv_cache_fp8` below).

Whatever else Quark writes is UnsupportedFormat with what it declares: asymmetric int8, int4 in its
`order` packing, other per-layer overrides, fake-quantized exports, a KV cache quantized after the
rotary embedding or in another dtype, output quantization.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from harness.core.errors import UnsupportedFormat
from harness.formats.ct_common import CT_KV_SCHEME

QUANT_METHOD = "quark"
FP8 = "fp8_e4m3"
#: NVFP4's group: one e4m3 scale per 16 columns
NVFP4_GROUP = 16
#: OCP MXFP4's group: one E8M0 scale per 32 columns
MXFP4_GROUP = 32
#: Quark's int4 packing order, AutoAWQ's (vLLM's `canonicalize_quark_packed_int4` leaves it as it is)
PACK_REORDER = "reorder"
#: Quark's 4-bit integer dtypes: signed codes (symmetric) and unsigned codes with zero points
INT4_DTYPES = ("int4", "uint4")
INT8 = "int8"
#: the projections whose outputs Quark's KV-cache quantization quantizes (its `kv_cache_group`)
KV_GROUP = ("*k_proj", "*v_proj")


def from_quark(config: Mapping) -> bool:
    return config.get("quant_method") == QUANT_METHOD


def _spec(value: object, where: str) -> Mapping | None:
    """One QuantizationSpec (a list of them is a two-level scheme other than the NVFP4 one read here)."""
    if value is None or isinstance(value, Mapping):
        return value
    raise UnsupportedFormat(
        f"Quark's {where} is {type(value).__name__} of specs (a two-level scheme): not defined here"
    )


def _describe(spec: Mapping | None) -> str:
    if spec is None:
        return "none"
    dynamic = "dynamic" if spec.get("is_dynamic") else "static"
    return f"{spec.get('dtype')} {spec.get('qscheme')} {dynamic}"


def _fp8_weights(spec: Mapping) -> dict | None:
    """compressed-tensors' weight args for an FP8 weight spec Quark defines as one of ours."""
    if spec.get("dtype") != FP8 or spec.get("is_dynamic") or spec.get("symmetric") is False:
        return None
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "dynamic": False}
    if spec.get("qscheme") == "per_tensor":
        return args | {"strategy": "tensor"}
    if spec.get("qscheme") == "per_channel" and spec.get("ch_axis") == 0:
        return args | {"strategy": "channel"}
    return None


def _fp8_inputs(spec: Mapping | None) -> dict | None | bool:
    """compressed-tensors' input args for Quark's input spec (None: not quantized); False where
    Quark's spec is not one of ours."""
    if spec is None:
        return None
    if spec.get("dtype") != FP8 or spec.get("symmetric") is False:
        return False
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    if spec.get("qscheme") == "per_tensor":
        return args | {"strategy": "tensor", "dynamic": bool(spec.get("is_dynamic"))}
    if spec.get("qscheme") == "per_channel" and spec.get("ch_axis") == 1 and spec.get("is_dynamic"):
        return args | {"strategy": "token", "dynamic": True}  # one scale per token of the input
    return False


def _nvfp4_levels(value: object) -> bool:
    """Whether a spec is Quark's NVFP4 pair: e2m1 per group of 16, then its e4m3 scales' per-tensor scale."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, Mapping) for v in value)):
        return False
    codes, scales = value
    return (codes.get("dtype"), codes.get("qscheme"), codes.get("group_size")) == (
        "fp4",
        "per_group",
        NVFP4_GROUP,
    ) and (scales.get("dtype"), scales.get("qscheme"), bool(scales.get("is_scale_quant"))) == (FP8, "per_tensor", True)


def is_nvfp4(config: Mapping) -> bool:
    """Whether a Quark config is its NVFP4 scheme, weights and inputs or weights only, with nothing
    beyond (harness.formats.quark_nvfp4 reads it)."""
    return _one_global_scheme(config, _nvfp4_levels, _nvfp4_levels)


def _one_global_scheme(config: Mapping, weight: Callable[[object], bool], inputs: Callable[[object], bool]) -> bool:
    """Whether a Quark config is one global scheme with nothing beyond, its weight spec passing
    `weight` and its input spec absent (weights only) or passing `inputs`."""
    scheme = config.get("global_quant_config") or {}
    return (
        from_quark(config)
        and _beyond_global(config) is None
        and scheme.get("output_tensors") is None
        and weight(scheme.get("weight"))
        and (scheme.get("input_tensors") is None or inputs(scheme.get("input_tensors")))
        and _kv_defined(config)
    )


def fragment(ignore: list[str]) -> dict:
    """The fields of Quark's config the harness reads besides the scheme (no generator writes one)."""
    return {"quant_method": QUANT_METHOD, "exclude": list(ignore)}


def int4_weights(config: Mapping) -> Mapping | None:
    """The weight spec of a Quark config that is its int4 or uint4 weight-only scheme over groups,
    with nothing beyond (harness.formats.quark_int4 reads it); None for any other config."""
    return _int4_weight_only(config, _int4_groups)


def int4_per_channel(config: Mapping) -> Mapping | None:
    """The weight spec of a Quark config that is its int4 or uint4 weight-only scheme per output row,
    with nothing beyond (harness.formats.quark_int4_channel reads it); None for any other config."""
    return _int4_weight_only(config, _int4_rows)


def _int4_weight_only(config: Mapping, weight: Callable[[object], bool]) -> Mapping | None:
    """The weight spec of a weight-only Quark config whose spec passes `weight`, packed in its `reorder` order."""
    if not _one_global_scheme(config, weight, lambda inputs: False):
        return None
    if (config.get("export") or {}).get("pack_method", PACK_REORDER) != PACK_REORDER:
        return None
    return config["global_quant_config"]["weight"]


def _int4_rows(spec: object) -> bool:
    """Whether a spec is Quark's int4 or uint4 per output row (one scale per channel of axis 0)."""
    return isinstance(spec, Mapping) and (
        spec.get("dtype") in INT4_DTYPES and (spec.get("qscheme"), spec.get("ch_axis")) == ("per_channel", 0)
    )


def _int4_groups(spec: object) -> bool:
    """Whether a spec is Quark's int4 or uint4 over groups of inputs."""
    if not isinstance(spec, Mapping):
        return False
    group = spec.get("group_size")
    return (
        spec.get("dtype") in INT4_DTYPES
        and (spec.get("qscheme"), spec.get("ch_axis")) == ("per_group", -1)
        and isinstance(group, int)
        and not isinstance(group, bool)
        and group > 0
    )


def _static_per_tensor(spec: object, dtype: str) -> bool:
    """Whether a spec is symmetric, static, per tensor, of `dtype`."""
    return isinstance(spec, Mapping) and (
        spec.get("dtype"),
        spec.get("qscheme"),
        bool(spec.get("is_dynamic")),
        spec.get("symmetric"),
    ) == (dtype, "per_tensor", False, True)


def int8_per_tensor(config: Mapping) -> bool:
    """Whether a Quark config is its int8 scheme: symmetric static int8 per tensor for the weight and,
    where quantized, the input, with nothing beyond (harness.formats.quark_int8 reads it)."""
    return _one_global_scheme(config, lambda w: _static_per_tensor(w, INT8), lambda i: _static_per_tensor(i, INT8))


def _mxfp4_spec(spec: object, dynamic: bool) -> bool:
    """Whether a spec is OCP MXFP4 as Quark writes it: e2m1 per group of 32, E8M0 scales, `even` rounding."""
    return isinstance(spec, Mapping) and (
        spec.get("dtype"),
        spec.get("qscheme"),
        spec.get("group_size"),
        spec.get("ch_axis"),
        spec.get("scale_format"),
        spec.get("scale_calculation_mode"),
        bool(spec.get("is_dynamic")),
    ) == ("fp4", "per_group", MXFP4_GROUP, -1, "e8m0", "even", dynamic)


def is_mxfp4(config: Mapping) -> bool:
    """Whether a Quark config is its MXFP4 scheme, weights with dynamic MXFP4 or static FP8 per-tensor
    inputs or weights only, with nothing beyond (harness.formats.quark_mxfp4 reads it)."""
    return _one_global_scheme(
        config,
        lambda w: _mxfp4_spec(w, dynamic=False),
        lambda i: _mxfp4_spec(i, dynamic=True) or fp8_static_tensor(i),
    )


def fp8_static_tensor(spec: object) -> bool:
    """Whether a spec is static symmetric FP8 (e4m3) per tensor."""
    return _static_per_tensor(spec, FP8)


def kv_cache_fp8(config: Mapping) -> bool:
    """Whether a Quark config quantizes its KV cache as defined here: `kv_cache_group` k_proj and
    v_proj, each override the global scheme plus static FP8 per-tensor outputs, before the rotary
    embedding. Another KV-cache declaration is UnsupportedFormat, in its words."""
    export = config.get("export") or {}
    kv, layers = _kv_layers(config), config.get("layer_quant_config") or {}
    if not _declares_kv(config):
        return False
    scheme = config.get("global_quant_config") or {}
    beside = {key: value for key, value in scheme.items() if key != "output_tensors"}
    defined = (
        sorted(export.get("kv_cache_group") or ()) == sorted(KV_GROUP) == sorted(kv)
        and layers == kv
        and all(
            isinstance(entry, Mapping)
            and {key: value for key, value in entry.items() if key != "output_tensors"} == beside
            and fp8_static_tensor(entry.get("output_tensors"))
            for entry in kv.values()
        )
    )
    if not defined:
        return _unsupported("Quark's KV-cache quantization other than static FP8 per tensor on k_proj and v_proj")
    if config.get("kv_cache_post_rope"):
        return _unsupported("Quark's KV-cache quantization after the rotary embedding (kv_cache_post_rope)")
    return True


def _kv_defined(config: Mapping) -> bool:
    """True where the config's KV cache is none or defined here (kv_cache_fp8); else UnsupportedFormat."""
    kv_cache_fp8(config)
    return True


def _kv_layers(config: Mapping) -> Mapping:
    """The KV-cache overrides: `kv_cache_quant_config`, or where an export lacks it (it repeats them) the
    `layer_quant_config` that holds them, as vLLM's QuarkConfig reads them."""
    return config.get("kv_cache_quant_config") or config.get("layer_quant_config") or {}


def _declares_kv(config: Mapping) -> bool:
    return bool(config.get("kv_cache_quant_config") or (config.get("export") or {}).get("kv_cache_group"))


def _unsupported(what: str) -> bool:
    raise UnsupportedFormat(f"{what}: not defined here")


def _beyond_global(config: Mapping) -> str | None:
    """What a Quark config declares beyond its one global scheme, in words; None where nothing (its
    KV-cache overrides are read by kv_cache_fp8, not here)."""
    export = config.get("export") or {}
    if export.get("weight_format", "real_quantized") != "real_quantized":
        return f"Quark's weight_format {export.get('weight_format')!r}: only real_quantized is defined"
    kv_overrides = _declares_kv(config) and config.get("layer_quant_config") == _kv_layers(config)
    for key in ("layer_quant_config", "layer_type_quant_config"):
        if config.get(key) and not (key == "layer_quant_config" and kv_overrides):
            return f"Quark's {key} (per-layer overrides of the global scheme): not defined here"
    return None


def equivalent_config(config: Mapping) -> dict | None:
    """The compressed-tensors config a Quark config is equivalent to; None for any other config and
    for Quark's NVFP4, MXFP4, int8 and int4 (formats of their own). What Quark declares beyond the definitions above is
    UnsupportedFormat, in its words."""
    if not from_quark(config) or is_nvfp4(config) or is_mxfp4(config) or int8_per_tensor(config):
        return None
    if int4_weights(config) is not None or int4_per_channel(config) is not None:
        return None
    beyond = _beyond_global(config)
    if beyond:
        raise UnsupportedFormat(beyond)
    scheme = config.get("global_quant_config") or {}
    weight = _spec(scheme.get("weight"), "weight")
    inputs = _spec(scheme.get("input_tensors"), "input_tensors")
    if _spec(scheme.get("output_tensors"), "output_tensors") is not None:
        raise UnsupportedFormat("Quark's output_tensors quantization: not defined here")
    weights = _fp8_weights(weight) if weight is not None else None
    activations = _fp8_inputs(inputs)
    if weights is None or activations is False:
        raise UnsupportedFormat(
            f"Quark's scheme (weight {_describe(weight)}, input {_describe(inputs)}): only FP8 weights per tensor "
            "or per channel, with static per-tensor or dynamic per-token FP8 inputs or none, are defined here"
        )
    group = {"format": "float-quantized", "weights": weights, "input_activations": activations, "targets": ["Linear"]}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": list(config.get("exclude") or []),
        "kv_cache_scheme": dict(CT_KV_SCHEME) if kv_cache_fp8(config) else None,
        "quantization_status": "compressed",
    }
