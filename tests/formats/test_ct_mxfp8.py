"""llm-compressor's MXFP8A16 and MXFP8 exports (cases/producers/llmcompressor), read as `ct-mxfp8`
(harness/formats/ct_mxfp8.py), and its MXFP8 export's inputs by compressed-tensors' MX rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.formats import detect_format, get_format
from harness.formats.base import FormatError

CORPUS = Path(__file__).resolve().parents[2] / "cases" / "producers" / "llmcompressor"
FORMAT = get_format("ct-mxfp8")


def quantization_config(case: str) -> dict:
    return json.loads((CORPUS / case / "config.json").read_text())["quantization_config"]


def test_mxfp8a16_is_e4m3_codes_times_a_power_of_two_per_32_columns():
    config = quantization_config("llama-mxfp8a16")
    assert detect_format(config) is FORMAT and FORMAT.knobs_from_config(config) == {}
    stored = load_file(CORPUS / "llama-mxfp8a16" / "model.safetensors")
    tensors = {
        "weight": stored["model.layers.0.mlp.up_proj.weight"],
        "weight_scale": stored["model.layers.0.mlp.up_proj.weight_scale"],
    }
    weight = FORMAT.dequantize(tensors, {})
    powers = torch.exp2(tensors["weight_scale"].to(torch.float64) - 127)
    assert torch.equal(weight, tensors["weight"].to(torch.float64) * powers.repeat_interleave(32, 1))


def test_mxfp8_reads_the_same_weights_and_its_inputs_by_compressed_tensors_mx_rule():
    from harness.oracle.activations import scheme_of

    config = quantization_config("llama-mxfp8")
    assert detect_format(config) is FORMAT and FORMAT.knobs_from_config(config) == {}
    scheme = scheme_of(config)
    assert (scheme.kind, scheme.strategy, scheme.group_size, scheme.dynamic) == ("mxfp8", "group", 32, True)
    assert scheme_of(quantization_config("llama-mxfp8a16")) is None


def test_its_model_of_compressed_tensors_round_trips_and_nan_scales_are_refused():
    weight = torch.randn(16, 96, dtype=torch.float64) * 3
    quantized = FORMAT.quantize(weight, {}, model_dtype=torch.bfloat16, activation_amax=None)
    assert quantized.tensors["weight_scale"].shape == (16, 3)
    assert torch.equal(FORMAT.dequantize(quantized.tensors, {}), quantized.truth)
    assert (quantized.truth - weight).abs().max() <= weight.abs().max() / 8  # e4m3's relative step, saturation aside
    bad = dict(quantized.tensors, weight_scale=quantized.tensors["weight_scale"].clone())
    bad["weight_scale"][0, 0] = 0xFF
    with pytest.raises(FormatError, match="0xFF"):
        FORMAT.dequantize(bad, {})
