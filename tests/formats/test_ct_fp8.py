"""ct-fp8-{tensor,channel,block} against compressed-tensors' own calibrate/compress/decompress."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.formats.base import FormatError
from harness.formats.ct_fp8 import BLOCK, CHANNEL, TENSOR

FORMATS = {"tensor": TENSOR, "channel": CHANNEL, "block": BLOCK}
SHAPES = [(37, 50), (1, 17), (130, 129)]
# (block_rows, block_cols): default, smaller than the tensors with partial edges, non-square
BLOCKS = [(128, 128), (16, 32), (7, 5)]


def make_weight(shape, seed=0, dtype=torch.bfloat16):
    """Weights with a wide spread of magnitudes, one all-zero row and one all-zero column."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)
    weight[0] = 0
    weight[:, -1] = 0
    return weight.to(dtype)


def cases():
    for shape in SHAPES:
        yield "tensor", shape, {}
        yield "channel", shape, {}
        for rows, cols in BLOCKS:
            yield "block", shape, {"block_rows": rows, "block_cols": cols}


CASES = [
    pytest.param(s, shape, k, id=f"{s}-{shape[0]}x{shape[1]}-{'x'.join(map(str, k.values())) or 'na'}")
    for s, shape, k in cases()
]


def ct_reference(strategy, weight, knobs, scale_dtype, activation_amax):
    """Calibrate with ct's calculate_qparams (the producer's `calibrate_module`), compress and
    decompress with ModelCompressor."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    from harness.lm.ct_producer import calibrate_module

    fmt = FORMATS[strategy]
    config = QuantizationConfig.model_validate(fmt.quantization_config(knobs, []))
    model = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    apply_quantization_config(model, config)
    module = model[0]
    calibrate_module(module, activation_amax if knobs.get("input_scale") else None, scale_dtype)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressed = {k: v.clone() for k, v in module.state_dict().items()}
    compressor.decompress_model(model)
    return compressed, module.weight.detach().clone(), compressor.quantization_config


def bits(tensor):
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize("scale_dtype", ["model", "float32"])
@pytest.mark.parametrize("strategy,shape,overrides", CASES)
def test_matches_compressed_tensors(strategy, shape, overrides, scale_dtype):
    fmt = FORMATS[strategy]
    knobs = fmt.resolve_knobs({**overrides, "scale_dtype": scale_dtype, "input_scale": True})
    weight = make_weight(shape, seed=sum(shape))
    activation_amax = 3.7
    ours = fmt.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=activation_amax)
    torch_scale_dtype = torch.bfloat16 if scale_dtype == "model" else torch.float32
    compressed, decompressed, _ = ct_reference(strategy, weight, knobs, torch_scale_dtype, activation_amax)

    assert set(compressed) == set(ours.tensors) == {"weight", "weight_scale", "input_scale"}
    for name, tensor in ours.tensors.items():
        assert tensor.dtype == compressed[name].dtype, name
        assert tensor.shape == compressed[name].shape, name
        assert torch.equal(bits(tensor), bits(compressed[name])), name

    reference = fmt.dequantize(ours.tensors, fmt.knobs_from_config(fmt.quantization_config(knobs, [])))
    # ct multiplies in the scale dtype; one rounding of the exact product is what it gives
    assert decompressed.dtype == torch_scale_dtype
    assert torch.equal(reference.to(torch_scale_dtype), decompressed)
    if scale_dtype == "model":
        assert torch.equal(reference.to(torch.bfloat16), decompressed)


@pytest.mark.parametrize("strategy,shape,overrides", CASES)
def test_dequantize_equals_truth(strategy, shape, overrides):
    fmt = FORMATS[strategy]
    knobs = fmt.resolve_knobs(overrides)
    ours = fmt.quantize(
        make_weight(shape, seed=1, dtype=torch.float32), knobs, model_dtype=torch.bfloat16, activation_amax=1.0
    )
    assert ours.tensors["weight_scale"].dtype == torch.bfloat16
    assert "input_scale" not in ours.tensors
    reference = fmt.dequantize(ours.tensors, knobs)
    assert reference.dtype == torch.float64 and reference.shape == shape
    assert torch.equal(reference, ours.truth)


@pytest.mark.parametrize("strategy", FORMATS)
@pytest.mark.parametrize("input_scale", [False, True])
def test_config_validates_and_round_trips(strategy, input_scale):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    fmt = FORMATS[strategy]
    overrides = {"block_rows": 64, "block_cols": 32} if strategy == "block" else {}
    knobs = fmt.resolve_knobs({**overrides, "input_scale": input_scale})
    config = fmt.quantization_config(knobs, ["lm_head"])
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.ignore == ["lm_head"] and parsed.format == "float-quantized"
    # what ct writes back for the parsed config is what we emit
    dumped = json.loads(json.dumps(parsed.model_dump(exclude=["quant_method"])))
    assert {k: v for k, v in config.items() if k in dumped} == dumped
    assert fmt.matches(config)
    assert [f.name for f in FORMATS.values() if f.matches(config)] == [fmt.name]
    recovered = fmt.knobs_from_config(config)
    assert recovered == {k: knobs[k] for k in recovered}


@pytest.mark.parametrize(
    "strategy,preset,input_scale",
    [("tensor", "FP8", True), ("channel", "FP8_DYNAMIC", False), ("block", "FP8_BLOCK", False)],
)
def test_config_equals_what_ct_writes(strategy, preset, input_scale, tmp_path):
    """The fragment equals ModelCompressor.update_config's output for ct's own preset scheme."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = torch.nn.ModuleDict(
        {
            "proj": torch.nn.Linear(256, 256, dtype=torch.bfloat16),
            "lm_head": torch.nn.Linear(256, 8, dtype=torch.bfloat16),
        }
    )
    apply_quantization_config(model, QuantizationConfig(config_groups={preset: ["Linear"]}, ignore=["lm_head"]))
    for name in ("weight_scale", "input_scale"):
        if hasattr(model["proj"], name):
            getattr(model["proj"], name).data.fill_(0.01)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressor.update_config(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    fmt = FORMATS[strategy]
    assert fmt.quantization_config(fmt.resolve_knobs({"input_scale": input_scale}), ["lm_head"]) == written


def test_not_matched_by_other_configs():
    nvfp4 = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "format": "nvfp4-pack-quantized",
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
            }
        },
    }
    fp8_block = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    int8 = TENSOR.quantization_config(TENSOR.resolve_knobs({}), [])
    int8["config_groups"]["group_0"]["weights"]["type"] = "int"
    for config in (nvfp4, fp8_block, int8):
        assert not any(fmt.matches(config) for fmt in FORMATS.values())


def test_block_size_shortcut_and_transposed_layout():
    knobs = BLOCK.resolve_knobs({"block_size": 16, "scale_layout": "transposed"})
    assert (knobs["block_rows"], knobs["block_cols"]) == (16, 16)
    result = BLOCK.quantize(make_weight((40, 70)), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert result.tensors["weight_scale"].shape == (5, 3) and result.expectation == "exact-or-refuse"
    with pytest.raises(FormatError, match="grid"):
        BLOCK.dequantize(result.tensors, knobs)


def quantized(strategy, shape=(37, 50)):
    fmt = FORMATS[strategy]
    knobs = fmt.resolve_knobs({"block_size": 16} if strategy == "block" else {})
    return fmt, knobs, fmt.quantize(make_weight(shape), knobs, model_dtype=torch.bfloat16, activation_amax=1.0).tensors


@pytest.mark.parametrize("strategy", FORMATS)
def test_malformed_tensors_raise(strategy):
    fmt, knobs, tensors = quantized(strategy)
    scale = tensors["weight_scale"]
    bad_grid = {
        "tensor": torch.ones(2, dtype=scale.dtype),
        "channel": torch.ones(37, dtype=scale.dtype),
        "block": torch.ones(3, 3, dtype=scale.dtype),
    }[strategy]
    nan_scale = scale.clone()
    nan_scale.view(-1)[0] = math.nan
    malformed = [
        ({"weight_scale": bad_grid}, "shape|grid"),
        ({"weight_scale": nan_scale}, "non-finite"),
        ({"weight_scale": scale.to(torch.float8_e4m3fn)}, "dtype"),
        ({"weight": tensors["weight"].to(torch.bfloat16)}, "dtype"),
        ({"weight": tensors["weight"][None]}, "dimensions"),
    ]
    for change, message in malformed:
        with pytest.raises(FormatError, match=message):
            fmt.dequantize({**tensors, **change}, knobs)
    with pytest.raises(FormatError, match="missing"):
        fmt.dequantize({"weight": tensors["weight"]}, knobs)
    with pytest.raises(FormatError, match="input_scale"):
        fmt.dequantize(tensors, {**knobs, "input_scale": True})
    bad_input = {**tensors, "input_scale": torch.tensor([math.inf], dtype=torch.bfloat16)}
    with pytest.raises(FormatError, match="non-finite"):
        fmt.dequantize(bad_input, {**knobs, "input_scale": True})


@pytest.mark.parametrize("strategy", FORMATS)
@pytest.mark.parametrize("scale_dtype", ["model", "float32"])
def test_all_zero_weight(strategy, scale_dtype):
    """ct replaces a zero scale by finfo(dtype).eps; the weight stays exactly zero."""
    fmt = FORMATS[strategy]
    knobs = fmt.resolve_knobs({"scale_dtype": scale_dtype, "input_scale": True})
    result = fmt.quantize(torch.zeros(9, 20), knobs, model_dtype=torch.bfloat16, activation_amax=0.0)
    dtype = torch.bfloat16 if scale_dtype == "model" else torch.float32
    assert torch.all(result.tensors["weight_scale"] == torch.finfo(dtype).eps)
    assert torch.all(result.tensors["input_scale"] == torch.finfo(dtype).eps)
    reference = fmt.dequantize(result.tensors, knobs)
    assert not reference.isnan().any() and torch.equal(reference, torch.zeros(9, 20, dtype=torch.float64))
    assert torch.equal(reference, result.truth)


@pytest.mark.parametrize("strategy", FORMATS)
@pytest.mark.parametrize("scale_dtype", ["model", "float32"])
def test_subnormal_amax_gives_subnormal_scale(strategy, scale_dtype):
    fmt = FORMATS[strategy]
    knobs = fmt.resolve_knobs({"scale_dtype": scale_dtype})
    weight = torch.zeros(4, 8)
    weight[0, 0] = fmt.subnormal_amax(knobs, 1.0)
    result = fmt.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    scale = result.tensors["weight_scale"].view(-1)[0]
    assert 0 < abs(scale.item()) < torch.finfo(scale.dtype).tiny
    assert torch.equal(fmt.dequantize(result.tensors, knobs), result.truth)


def test_scale_block():
    assert TENSOR.scale_block(TENSOR.resolve_knobs({}), (37, 50)) == (37, 50)
    assert CHANNEL.scale_block(CHANNEL.resolve_knobs({}), (37, 50)) == (1, 50)
    assert BLOCK.scale_block(BLOCK.resolve_knobs({"block_rows": 8, "block_cols": 4}), (37, 50)) == (8, 4)
