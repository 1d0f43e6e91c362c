"""NVFP4 formats: our quantizers against compressed-tensors' real compress/decompress and its
ModelOpt converter, our reference against the quantizers' own truth, and refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.formats import get_format
from harness.formats.base import FormatError
from harness.formats.ct_nvfp4 import W4A4, W4A16
from harness.formats.fp8_block import FORMAT as FP8_BLOCK
from harness.formats.modelopt_nvfp4 import FORMAT as MODELOPT

CT_FORMATS = [W4A4, W4A16]
ALL_FORMATS = CT_FORMATS + [MODELOPT]
SHAPES = [(37, 48), (1, 16), (130, 160)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ACT_AMAX = 3.7


def make_weight(shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    """amax 0.9 * scale; groups of very different magnitudes, one all-zero group, and a tiny
    negative that rounds to -0."""
    rows, columns = shape
    generator = torch.Generator().manual_seed(seed)
    spread = 10.0 ** torch.empty(rows, columns // 16).uniform_(-3, 0, generator=generator)
    weight = torch.randn(rows, columns, generator=generator) * spread.repeat_interleave(16, dim=1)
    weight *= 0.9 / weight.abs().max()
    if rows * columns > 16:
        weight[0, :16] = 0.0
    if columns >= 32:
        weight[0, 16] = -1e-3 * float(weight[0, 16:32].abs().max())
    return (weight * scale).to(dtype)


def quantize(fmt, weight, knobs=None, activation_amax=ACT_AMAX):
    return fmt.quantize(
        weight, fmt.resolve_knobs(knobs or {}), model_dtype=weight.dtype, activation_amax=activation_amax
    )


def as_bits(tensor):
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def assert_same_tensors(ours, theirs):
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), name
        assert torch.equal(as_bits(a), as_bits(b)), name


# ---- compressed-tensors: the real producer path -------------------------------------------


def ct_compress(weight, activations: bool, activation_amax=ACT_AMAX):
    """What llm-compressor does with a min-max observer (the producer's `calibrate_module`), then
    ct's own compressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16

    from harness.lm.ct_producer import calibrate_module

    rows, columns = weight.shape
    linear = torch.nn.Linear(columns, rows, bias=False, dtype=weight.dtype)
    linear.weight.data.copy_(weight)
    model = torch.nn.Sequential(linear)
    scheme = QuantizationScheme(targets=["Linear"], **(NVFP4 if activations else NVFP4A16))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}))
    calibrate_module(linear, activation_amax if activations else None)
    ModelCompressor.from_pretrained_model(model, "nvfp4-pack-quantized").compress_model(model)
    return {name: tensor.detach().clone() for name, tensor in linear.state_dict().items()}, scheme


def ct_decompress(tensors, scheme):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    return NVFP4PackedCompressor.decompress(dict(tensors), scheme)["weight"]


@pytest.mark.parametrize("fmt", CT_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ct_quantize_is_bit_identical_to_compressed_tensors(fmt, dtype, shape):
    pytest.importorskip("compressed_tensors")
    for seed in range(4):
        weight = make_weight(shape, dtype, seed)
        theirs, _ = ct_compress(weight, fmt.activations)
        assert_same_tensors(quantize(fmt, weight).tensors, theirs)


@pytest.mark.parametrize("scale", [1e-4, 1e3], ids=str)
def test_ct_extreme_amax_is_bit_identical_and_exact(scale):
    pytest.importorskip("compressed_tensors")
    weight = make_weight((37, 48), torch.bfloat16, 7, scale)
    theirs, _ = ct_compress(weight, True)
    result = quantize(W4A4, weight)
    assert_same_tensors(result.tensors, theirs)
    assert torch.equal(W4A4.dequantize(result.tensors, {}), result.truth)


@pytest.mark.parametrize("fmt", CT_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ct_decompress_equals_reference_in_bf16(fmt, dtype, shape):
    pytest.importorskip("compressed_tensors")
    for seed in range(4):
        weight = make_weight(shape, dtype, seed)
        theirs, scheme = ct_compress(weight, fmt.activations)
        ours = fmt.dequantize(quantize(fmt, weight).tensors, {})
        assert torch.equal(ct_decompress(theirs, scheme), ours.to(torch.bfloat16))


@pytest.mark.parametrize("columns", [40, 33])
def test_partial_last_group_is_refused_like_compressed_tensors(columns):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    weight = torch.randn(4, columns, dtype=torch.bfloat16)
    state = {
        "weight": weight,
        "weight_scale": torch.ones(4, -(-columns // 16), dtype=torch.bfloat16),
        "weight_global_scale": torch.ones(1),
    }
    with pytest.raises(ValueError):
        NVFP4PackedCompressor.compress(state, QuantizationScheme(targets=["Linear"], **NVFP4))
    for fmt in ALL_FORMATS:
        with pytest.raises(FormatError, match="multiple of the NVFP4 group size"):
            quantize(fmt, weight)


def test_ct_config_validates_and_matches_what_ct_writes():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    for fmt in CT_FORMATS:
        fragment = fmt.quantization_config(fmt.resolve_knobs({}), ["lm_head"])
        parsed = QuantizationConfig.model_validate(fragment)
        assert parsed.format == "nvfp4-pack-quantized" and parsed.ignore == ["lm_head"]
        scheme = parsed.config_groups["group_0"]
        assert scheme.weights.group_size == 16 and scheme.weights.scale_dtype == torch.float8_e4m3fn
        assert (scheme.input_activations is not None) == fmt.activations
        dumped = parsed.model_dump(exclude=["quant_method"])
        for key in ("config_groups", "format", "ignore", "kv_cache_scheme", "quantization_status"):
            assert dumped[key] == fragment[key], key
        from transformers.utils.quantization_config import CompressedTensorsConfig

        assert CompressedTensorsConfig.from_dict(fragment).quantization_config.format == "nvfp4-pack-quantized"


# ---- ModelOpt: through compressed-tensors' own ModelOpt -> ct converter ----------------------


def ct_converted(result, scalar_shape: str):
    """Our ModelOpt tensors through compressed-tensors' ModelOpt -> ct converter (1/weight_scale_2,
    1/input_scale), as local names; `scalar_shape` "[1]" reshapes its 0-dim outputs as ct writes them."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    named = {f"model.proj.{name}": tensor.clone() for name, tensor in result.tensors.items()}
    converted = ModelOptNvfp4Converter(targets=["Linear"]).validate(named)
    local = {name.rpartition(".")[2]: tensor for name, tensor in converted.items()}
    assert sorted(local) == ["input_global_scale", "weight_global_scale", "weight_packed", "weight_scale"]
    if scalar_shape == "[1]":
        local = {name: tensor.reshape(1) if tensor.dim() == 0 else tensor for name, tensor in local.items()}
    return local


def ct_nvfp4_scheme():
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    return QuantizationScheme(targets=["Linear"], **NVFP4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_modelopt_converted_by_ct_decompresses_to_reference(shape, dtype):
    pytest.importorskip("compressed_tensors")
    for seed in range(4):
        result = quantize(MODELOPT, make_weight(shape, dtype, seed))
        theirs = ct_decompress(ct_converted(result, "[1]"), ct_nvfp4_scheme())
        assert torch.equal(theirs, MODELOPT.dequantize(result.tensors, {}).to(torch.bfloat16))


@pytest.mark.xfail(
    strict=True,
    reason=(
        "compressed-tensors 0.20: the ModelOpt converter keeps weight_scale_2's 0-dim shape, and "
        "decompress then computes weight_scale / weight_global_scale in bfloat16 (a 0-dim float32 "
        "does not promote a bf16 tensor), off by up to 1 bf16 ulp; ct's own [1] scales promote to float32"
    ),
)
def test_modelopt_converted_keeps_scalar_scales_and_ct_decompresses_exactly():
    pytest.importorskip("compressed_tensors")
    result = quantize(MODELOPT, make_weight((130, 160)))
    theirs = ct_decompress(ct_converted(result, "[]"), ct_nvfp4_scheme())
    assert torch.equal(theirs, MODELOPT.dequantize(result.tensors, {}).to(torch.bfloat16))


def test_modelopt_tensor_layout():
    result = quantize(MODELOPT, make_weight((37, 48)))
    layout = {name: (t.dtype, tuple(t.shape)) for name, t in result.tensors.items()}
    assert layout == {
        "weight": (torch.uint8, (37, 24)),
        "weight_scale": (torch.float8_e4m3fn, (37, 3)),
        "weight_scale_2": (torch.float32, ()),
        "input_scale": (torch.float32, ()),
    }
    assert float(result.tensors["input_scale"]) == pytest.approx(ACT_AMAX / 2688, rel=2**-7)


def test_modelopt_config_is_what_vllm_reads():
    fragment = MODELOPT.quantization_config(MODELOPT.resolve_knobs({}), ["lm_head"])
    assert fragment["quant_method"] == "modelopt" and fragment["quant_algo"] == "NVFP4"
    assert fragment["ignore"] == ["lm_head"]  # vLLM's exclude list in config.json's flat form
    assert fragment["config_groups"]["group_0"]["weights"]["group_size"] == 16
    nested = {
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
    }
    assert MODELOPT.matches(nested) and MODELOPT.knobs_from_config(nested) == {"global_scale_convention": "multiplier"}
    with pytest.raises(FormatError, match="group_size"):
        MODELOPT.knobs_from_config({**fragment, "group_size": 32})


# ---- all formats ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3], ids=str)
def test_dequantize_equals_truth(fmt, dtype, scale):
    for shape in SHAPES:
        result = quantize(fmt, make_weight(shape, dtype, 3, scale))
        assert result.expectation == "exact"
        assert torch.equal(fmt.dequantize(result.tensors, {}), result.truth)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_all_zero_groups_give_zeros(fmt):
    weight = make_weight((8, 64))
    weight[:, 16:32] = 0.0
    result = quantize(fmt, weight)
    values = fmt.dequantize(result.tensors, {})
    assert not values.isnan().any() and torch.equal(values[:, 16:32], torch.zeros(8, 16, dtype=torch.float64))
    assert torch.equal(values, result.truth)


def test_all_zero_weight():
    zero = torch.zeros(4, 32, dtype=torch.bfloat16)
    for fmt in CT_FORMATS:  # ct falls back to a global scale of 1 and a group scale of 0.125
        result = quantize(fmt, zero)
        assert float(result.tensors["weight_global_scale"]) == 1.0
        assert torch.equal(fmt.dequantize(result.tensors, {}), torch.zeros(4, 32, dtype=torch.float64))
    with pytest.raises(FormatError, match="all-zero"):
        quantize(MODELOPT, zero)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_swapped_convention_is_refused_with_intended_truth(fmt):
    weight = make_weight((37, 48))
    correct = quantize(fmt, weight)
    swapped = quantize(fmt, weight, {"global_scale_convention": "swapped"})
    assert swapped.expectation == "exact-or-refuse" and swapped.notes
    assert torch.equal(swapped.truth, correct.truth)
    with pytest.raises(FormatError, match="looks like"):
        fmt.dequantize(swapped.tensors, {})


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_subnormal_amax_gives_a_subnormal_scale(fmt):
    weight = make_weight((4, 64), torch.bfloat16, 5)
    amax = float(weight.abs().amax())
    group = torch.linspace(-1, 1, 16) * fmt.subnormal_amax({}, amax)
    weight[1, 32:48] = group.to(torch.bfloat16)
    result = quantize(fmt, weight)
    scale = float(result.tensors["weight_scale"][1, 2].to(torch.float64))
    assert 0 < scale < 2.0**-6
    assert torch.equal(fmt.dequantize(result.tensors, {}), result.truth)
    assert fmt.scale_block({}, (4, 64)) == (1, 16)


def packed_name(fmt):
    return "weight" if fmt is MODELOPT else "weight_packed"


def global_name(fmt):
    return "weight_scale_2" if fmt is MODELOPT else "weight_global_scale"


MALFORMED = {
    "packed dtype": lambda t, p, g: t.update({p: t[p].to(torch.int8)}),
    "packed 1-D": lambda t, p, g: t.update({p: t[p].reshape(-1)}),
    "packed K not whole groups": lambda t, p, g: t.update({p: t[p][:, :20]}),
    "scale dtype": lambda t, p, g: t.update(weight_scale=t["weight_scale"].to(torch.bfloat16)),
    "scale shape": lambda t, p, g: t.update(weight_scale=t["weight_scale"][:, :2]),
    "scale NaN": lambda t, p, g: t["weight_scale"].view(torch.uint8).__setitem__((0, 0), 0x7F),
    "global inf": lambda t, p, g: t.update({g: torch.full_like(t[g], float("inf"))}),
    "global zero": lambda t, p, g: t.update({g: torch.zeros_like(t[g])}),
    "global negative": lambda t, p, g: t.update({g: -t[g]}),
    "global shape": lambda t, p, g: t.update({g: t[g].reshape(-1).repeat(2)}),
    "global dtype": lambda t, p, g: t.update({g: t[g].to(torch.float64)}),
    "missing scale": lambda t, p, g: t.pop("weight_scale"),
    "missing global": lambda t, p, g: t.pop(g),
}


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("mutation", list(MALFORMED))
def test_malformed_inputs_raise_format_error(fmt, mutation):
    tensors = dict(quantize(fmt, make_weight((37, 48))).tensors)
    MALFORMED[mutation](tensors, packed_name(fmt), global_name(fmt))
    with pytest.raises(FormatError):
        fmt.dequantize(tensors, {})


@pytest.mark.parametrize("fmt", [W4A4, MODELOPT], ids=lambda f: f.name)
def test_input_scale_is_required_and_checked(fmt):
    name = "input_scale" if fmt is MODELOPT else "input_global_scale"
    tensors = dict(quantize(fmt, make_weight((37, 48))).tensors)
    with pytest.raises(FormatError, match="missing"):
        fmt.dequantize({k: v for k, v in tensors.items() if k != name}, {})
    with pytest.raises(FormatError, match="non-finite"):
        fmt.dequantize({**tensors, name: torch.full_like(tensors[name], float("nan"))}, {})


def test_weight_amax_beyond_2688_is_refused():
    for fmt in ALL_FORMATS:
        with pytest.raises(FormatError, match="2688"):
            quantize(fmt, torch.full((2, 16), 3000.0))


def test_configs_are_mutually_exclusive_and_round_trip():
    configs = {fmt.name: fmt.quantization_config(fmt.resolve_knobs({}), ["lm_head"]) for fmt in ALL_FORMATS}
    configs["fp8-block"] = FP8_BLOCK.quantization_config(FP8_BLOCK.resolve_knobs({}), [])
    configs["ct-fp8"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            }
        },
    }
    for name, config in configs.items():
        matching = [fmt.name for fmt in ALL_FORMATS + [FP8_BLOCK] if fmt.matches(config)]
        assert matching == ([name] if name != "ct-fp8" else []), name
    for fmt in ALL_FORMATS:
        knobs = fmt.resolve_knobs({})
        read = fmt.knobs_from_config(fmt.quantization_config(knobs, []))
        assert read == {key: knobs[key] for key in read}
        assert get_format(fmt.name) is fmt
    with pytest.raises(FormatError):
        W4A4.knobs_from_config(configs["fp8-block"])


def test_format_modules_import_no_engine():
    code = (
        "import sys, harness.formats.ct_nvfp4, harness.formats.modelopt_nvfp4;"
        "print(sorted(m for m in ('compressed_tensors', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
