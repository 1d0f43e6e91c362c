"""modelopt-fp8: our quantizer against ModelOpt's own export functions (where ModelOpt is
installed) and against compressed-tensors' FP8 per-tensor compressor with float32 scales (the
same arithmetic, on CPU here); our reference against the quantizer's own truth; refusals."""

from __future__ import annotations

import math

import pytest
import torch

from harness.formats import detect_format
from harness.formats.base import FormatError
from harness.formats.ct_fp8 import TENSOR
from harness.formats.modelopt_fp8 import FORMAT

SHAPES = [(37, 50), (1, 17), (130, 129)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FACTORS = [1e-4, 1.0, 1e2]
ACT_AMAX = 3.7


def make_weight(shape, seed=0, dtype=torch.bfloat16, factor=1.0):
    """Weights with a wide spread of magnitudes and, below several rows, one all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen))
    if shape[0] > 1:
        weight[0] = 0
    return (weight * factor).to(dtype)


def quantize(weight, dtype=torch.bfloat16, activation_amax=ACT_AMAX):
    return FORMAT.quantize(weight, FORMAT.resolve_knobs({}), model_dtype=dtype, activation_amax=activation_amax)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [1.0, 0.0], ids=["weight", "all-zero"])
def test_matches_modelopt_export(dtype, factor):
    """ModelOpt's TensorQuantizer (max calibration), get_scaling_factor and to_quantized_weight,
    as its unified HF export calls them. Measured bit-exact against nvidia-modelopt 0.39.0 in
    every dtype, for amax scaled 1e-4 and 1e3 too, and for an all-zero weight (scale 1.0)."""
    pytest.importorskip("modelopt.torch.export")
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import get_scaling_factor, to_quantized_weight
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    def calibrated(tensor):
        quantizer = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
        quantizer.enable_calib()
        quantizer.disable_quant()
        quantizer(tensor)
        quantizer.load_calib_amax()
        return quantizer

    weight = make_weight((37, 50), dtype=dtype, factor=factor)
    scale = get_scaling_factor(calibrated(weight))
    activations = calibrated(torch.tensor([-ACT_AMAX, 1.0], dtype=dtype))
    activations._amax = activations._amax.to(torch.float32)  # as the exporter does
    ours = quantize(weight, dtype).tensors
    assert torch.equal(
        to_quantized_weight(weight, scale, QUANTIZATION_FP8).view(torch.uint8), ours["weight"].view(torch.uint8)
    )
    assert scale.dtype == ours["weight_scale"].dtype and torch.equal(scale, ours["weight_scale"])
    input_scale = get_scaling_factor(activations).squeeze()
    assert input_scale.shape == ours["input_scale"].shape and torch.equal(input_scale, ours["input_scale"])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_same_bytes_as_compressed_tensors_fp8_tensor_float32(shape):
    """ModelOpt FP8 and compressed-tensors' FP8 per-tensor scheme with float32 scales share the
    arithmetic (amax/448 in float32, e4m3(w / scale)): ct's own calibration and ModelCompressor
    give our bytes and, decompressed, our reference rounded once. (They part only on an all-zero
    weight: ct's scale is then finfo(float32).eps, ModelOpt's 1.0.)"""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    from harness.lm.ct_producer import calibrate_module

    weight = make_weight(shape, seed=sum(shape))
    knobs = TENSOR.resolve_knobs({"scale_dtype": "float32", "input_scale": True})
    config = QuantizationConfig.model_validate(TENSOR.quantization_config(knobs, []))
    model = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    apply_quantization_config(model, config)
    calibrate_module(model[0], ACT_AMAX, torch.float32)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressed = {k: v.clone() for k, v in model[0].state_dict().items()}
    compressor.decompress_model(model)

    ours = quantize(weight)
    assert torch.equal(ours.tensors["weight"].view(torch.uint8), compressed["weight"].view(torch.uint8))
    assert torch.equal(ours.tensors["weight_scale"], compressed["weight_scale"])
    assert torch.equal(ours.tensors["input_scale"].reshape(1), compressed["input_scale"])
    reference = FORMAT.dequantize(ours.tensors, {})
    assert torch.equal(reference.to(torch.float32), model[0].weight.detach())


@pytest.mark.parametrize("factor", FACTORS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_equals_truth(shape, dtype, factor):
    ours = quantize(make_weight(shape, seed=1, dtype=torch.float32, factor=factor), dtype)
    reference = FORMAT.dequantize(ours.tensors, {})
    assert reference.dtype == torch.float64 and reference.shape == shape
    assert torch.equal(reference, ours.truth)
    assert ours.expectation == "exact"


def test_tensor_layout_and_scales():
    ours = quantize(make_weight((37, 50)))
    layout = {name: (t.dtype, tuple(t.shape)) for name, t in ours.tensors.items()}
    assert layout == {
        "weight": (torch.float8_e4m3fn, (37, 50)),
        "weight_scale": (torch.float32, (1,)),
        "input_scale": (torch.float32, ()),
    }
    amax = float(make_weight((37, 50)).abs().max())
    assert float(ours.tensors["weight_scale"]) == pytest.approx(amax / 448, rel=1e-6)
    assert float(ours.tensors["input_scale"]) == pytest.approx(ACT_AMAX / 448, rel=2**-7)
    # a scalar weight_scale (older exports) reads the same
    scalar = {**ours.tensors, "weight_scale": ours.tensors["weight_scale"].reshape(())}
    assert torch.equal(FORMAT.dequantize(scalar, {}), ours.truth)


def test_all_zero_weight_and_subnormal_scale():
    """ModelOpt's export_amax turns a zero amax into 448 (scale 1.0); a subnormal amax gives a
    subnormal float32 scale, still read exactly."""
    zero = quantize(torch.zeros(4, 8), activation_amax=0.0)
    assert float(zero.tensors["weight_scale"]) == 1.0 and float(zero.tensors["input_scale"]) == 1.0
    assert torch.equal(FORMAT.dequantize(zero.tensors, {}), torch.zeros(4, 8, dtype=torch.float64))
    weight = torch.zeros(4, 8)
    weight[1, 3] = FORMAT.subnormal_amax({}, 1.0)
    result = quantize(weight)
    assert 0 < float(result.tensors["weight_scale"]) < torch.finfo(torch.float32).tiny
    assert torch.equal(FORMAT.dequantize(result.tensors, {}), result.truth)


def test_config_is_what_modelopt_and_vllm_read():
    """config.json's form (convert_hf_quant_config_format) and hf_quant_config.json's nested form;
    vLLM reads `quant_algo` and `ignore` (flat) or `quantization.exclude_modules` (nested)."""
    config = FORMAT.quantization_config(FORMAT.resolve_knobs({}), ["lm_head"])
    assert config == {
        "config_groups": {
            "group_0": {
                "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                "targets": ["Linear"],
            }
        },
        "ignore": ["lm_head"],
        "quant_algo": "FP8",
        "producer": {"name": "modelopt", "version": "0.39.0"},
        "quant_method": "modelopt",
    }
    assert detect_format(config) is FORMAT and FORMAT.knobs_from_config(config) == {}
    nested = {
        "producer": {"name": "modelopt", "version": "0.19.0"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
    }
    assert detect_format(nested) is FORMAT
    for algo in ("NVFP4", "FP8_PB_WO", "FP8_PER_CHANNEL_PER_TOKEN"):
        assert not FORMAT.matches({**config, "quant_algo": algo})
    bad = {**config, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float"}}}}
    with pytest.raises(FormatError, match="8-bit float"):
        FORMAT.knobs_from_config(bad)


def test_malformed_tensors_raise():
    tensors = quantize(make_weight((6, 20))).tensors
    scale = tensors["weight_scale"]
    malformed = [
        ({"weight_scale": torch.ones(2)}, "weight_scale has shape"),
        ({"weight_scale": torch.tensor([math.nan])}, "weight_scale has 1 non-finite"),
        ({"weight_scale": torch.tensor([0.0])}, "must be positive"),
        ({"weight_scale": -scale}, "must be positive"),
        ({"weight_scale": scale.to(torch.bfloat16)}, "weight_scale has dtype"),
        ({"input_scale": torch.tensor(math.inf)}, "input_scale has 1 non-finite"),
        ({"input_scale": torch.ones(3)}, "input_scale has shape"),
        ({"weight": tensors["weight"].to(torch.bfloat16)}, "weight has dtype"),
        ({"weight": tensors["weight"][None]}, "dimensions"),
    ]
    for change, message in malformed:
        with pytest.raises(FormatError, match=message) as caught:
            FORMAT.dequantize({**tensors, **change}, {})
        assert "\n" not in str(caught.value)
    for missing in ("weight", "weight_scale", "input_scale"):
        with pytest.raises(FormatError, match=f"missing tensor '{missing}'"):
            FORMAT.dequantize({k: v for k, v in tensors.items() if k != missing}, {})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("sizes", [(128, 256), (200, 333)], ids=str)
def test_generated_checkpoint_dequantizes_to_truth(tmp_path, arch, sizes):
    """`gen` then `dequant` at aligned and odd sizes: every tensor equals the truth."""
    from safetensors.torch import load_file

    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import TRUTH_FILE, generate
    from harness.oracle.reference import dequantize_checkpoint

    config = {"hidden_size": sizes[0], "intermediate_size": sizes[1], "num_hidden_layers": 1, "head_dim": 32}
    manifest = generate(Recipe("modelopt-fp8", arch, seed=2, config=config), tmp_path / "c")
    truth = load_file(str(tmp_path / "c" / TRUTH_FILE))
    got = dict(dequantize_checkpoint(tmp_path / "c"))
    assert set(got) == set(truth) and all(torch.equal(got[n], truth[n]) for n in truth)
    assert manifest["expectation"] == "exact"
