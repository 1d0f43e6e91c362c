"""autofp8: vLLM's per-tensor FP8 as AutoFP8 writes it, told apart from transformers' FineGrainedFP8 by the
key `weight_block_size` alone, read from AutoFP8's own files (cases/producers/autofp8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.core.errors import HarnessError
from harness.formats import get_format
from harness.formats.base import FormatError
from harness.oracle.activations import scheme_of
from harness.oracle.kv_cache import declares_fp8_kv_cache
from harness.oracle.reference import format_and_knobs

FORMAT = get_format("autofp8")
CORPUS = Path(__file__).resolve().parents[2] / "cases" / "producers" / "autofp8"


def make_weight(shape=(96, 160), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("config", "name"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}, "autofp8"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}, "fp8-block"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "fp8-block"),
    ],
)
def test_the_block_size_key_tells_the_two_fp8_configs_apart(config, name):
    assert get_format("autofp8").matches(config) == (name == "autofp8")
    assert get_format("fp8-block").matches(config) == (name == "fp8-block")


@pytest.mark.parametrize("scale_shape", ["scalar", "one-element"])
@pytest.mark.parametrize("input_scale", [False, True])
def test_round_trip(scale_shape, input_scale):
    knobs = FORMAT.resolve_knobs({"scale_shape": scale_shape, "input_scale": input_scale})
    result = FORMAT.quantize(make_weight(), knobs, model_dtype=torch.bfloat16, activation_amax=4.0)
    shape = () if scale_shape == "scalar" else (1,)
    assert result.tensors["weight_scale"].shape == shape
    assert ("input_scale" in result.tensors) == input_scale
    config = FORMAT.quantization_config(knobs, ["lm_head"])
    assert config["activation_scheme"] == ("static" if input_scale else "dynamic")
    read = FORMAT.resolve_knobs(FORMAT.knobs_from_config(config))
    assert torch.equal(FORMAT.dequantize(result.tensors, read), result.truth)


def test_a_scale_of_another_shape_or_a_missing_static_input_scale_is_refused():
    knobs = FORMAT.resolve_knobs({"input_scale": True})
    result = FORMAT.quantize(make_weight(), knobs, model_dtype=torch.bfloat16, activation_amax=4.0)
    with pytest.raises(FormatError, match=r"expected \[\] or \[1\]"):
        FORMAT.dequantize(dict(result.tensors, weight_scale=torch.ones(2)), knobs)
    with pytest.raises(FormatError, match="input_scale"):
        FORMAT.dequantize({k: v for k, v in result.tensors.items() if k != "input_scale"}, knobs)


def test_inputs_are_per_tensor_static_or_dynamic():
    dynamic = scheme_of({"quant_method": "fp8", "activation_scheme": "dynamic"})
    static = scheme_of({"quant_method": "fp8", "activation_scheme": "static"})
    assert (dynamic.strategy, dynamic.dynamic) == ("tensor", True)
    assert (static.strategy, static.dynamic, static.static) == ("tensor", False, "input_scale")


def test_kv_cache_scheme_static_declares_the_fp8_cache():
    assert declares_fp8_kv_cache({"quant_method": "fp8", "activation_scheme": "static", "kv_cache_scheme": "static"})
    assert not declares_fp8_kv_cache({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(HarnessError, match="not defined here"):
        declares_fp8_kv_cache({"quant_method": "fp8", "activation_scheme": "static", "kv_cache_scheme": "dynamic"})


@pytest.mark.parametrize("case", ["fp8_dynamic", "fp8_static", "qwen2_fp8_static", "fp8_static_kv"])
def test_autofp8s_own_files_read_as_its_own_linears_apply_them(case):
    """Each weight the reference reads equals AutoFP8's in-memory codes x weight_scale (its producer
    truth, float32) to float32 rounding, and every stored scale is AutoFP8's 0-D float32."""
    directory = CORPUS / case
    fmt, knobs = format_and_knobs(directory)
    assert fmt.name == "autofp8"
    stored = load_file(directory / "model.safetensors")
    truth = load_file(directory / "producer_truth" / "weights.safetensors")
    assert truth
    for name, expected in truth.items():
        module = name.removesuffix(".weight")
        tensors = {s: stored[f"{module}.{s}"] for s in fmt.suffixes if f"{module}.{s}" in stored}
        assert tensors["weight_scale"].shape == () and tensors["weight_scale"].dtype == torch.float32
        assert ("input_scale" in tensors) == knobs["input_scale"]
        assert torch.equal(fmt.dequantize(tensors, knobs).to(torch.float32), expected), name
