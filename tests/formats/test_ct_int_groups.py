"""llm-compressor's W4A8 and W4AFP8 exports (cases/producers/llmcompressor/llama-w4a8, llama-w4afp8):
int4 codes one per int8, read as `ct-w4a8` (harness/formats/ct_int_groups.py), their inputs as the
config declares them; nothing the harness writes is read as it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.core.errors import UnsupportedFormat
from harness.formats import detect_format, get_format
from harness.formats.base import FormatError
from harness.oracle.activations import scheme_of

CORPUS = Path(__file__).resolve().parents[2] / "cases" / "producers" / "llmcompressor"
FORMAT = get_format("ct-w4a8")


def quantization_config(case: str) -> dict:
    return json.loads((CORPUS / case / "config.json").read_text())["quantization_config"]


def module_tensors(case: str, module: str) -> dict[str, torch.Tensor]:
    stored = load_file(CORPUS / case / "model.safetensors")
    return {name.rpartition(".")[2]: t for name, t in stored.items() if name.rpartition(".")[0] == module}


@pytest.mark.parametrize(("case", "inputs"), [("llama-w4a8", "int8"), ("llama-w4afp8", "fp8")])
def test_llm_compressors_w4a8_exports_are_int4_codes_per_group_with_their_inputs(case, inputs):
    config = quantization_config(case)
    assert detect_format(config) is FORMAT
    assert FORMAT.knobs_from_config(config) == {"group_size": 128}
    scheme = scheme_of(config)
    assert (scheme.kind, scheme.strategy, scheme.dynamic) == (inputs, "token", True)
    tensors = module_tensors(case, "model.layers.0.mlp.down_proj")
    weight = FORMAT.dequantize(tensors, FORMAT.knobs_from_config(config))
    codes = tensors["weight"]
    assert codes.dtype == torch.int8 and -8 <= int(codes.min()) and int(codes.max()) <= 7
    assert weight.shape == codes.shape and torch.isfinite(weight).all()


def test_the_formats_the_harness_writes_are_not_read_as_it():
    for name in ("ct-w8a8", "ct-int4", "ct-int8"):
        fmt = get_format(name)
        config = fmt.quantization_config(fmt.resolve_knobs({}), ["lm_head"])
        assert detect_format(config) is fmt, name


def test_its_model_of_compressed_tensors_round_trips_exactly():
    weight = torch.randn(48, 320, dtype=torch.float64)
    knobs = {"group_size": 64}
    quantized = FORMAT.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=None)
    assert quantized.tensors["weight_scale"].shape == (48, 5)
    assert torch.equal(FORMAT.dequantize(quantized.tensors, knobs), quantized.truth)


def test_codes_outside_int4_scales_of_the_wrong_grid_and_asymmetric_weights_are_refused():
    config = quantization_config("llama-w4a8")
    knobs = FORMAT.knobs_from_config(config)
    tensors = module_tensors("llama-w4a8", "model.layers.0.mlp.down_proj")
    wide = dict(tensors, weight=tensors["weight"].clone())
    wide["weight"][0, 0] = 9
    with pytest.raises(FormatError, match="outside int4"):
        FORMAT.dequantize(wide, knobs)
    with pytest.raises(FormatError, match="weight_scale"):
        FORMAT.dequantize(dict(tensors, weight_scale=tensors["weight_scale"][:, :1].repeat(1, 3)), knobs)
    asymmetric = json.loads(json.dumps(config))
    asymmetric["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(UnsupportedFormat, match="symmetric"):
        FORMAT.knobs_from_config(asymmetric)


def test_the_fast_path_refuses_what_the_reference_refuses():
    from harness.oracle.fast import FastDequantizer

    config = quantization_config("llama-w4a8")
    knobs = FORMAT.knobs_from_config(config)
    tensors = module_tensors("llama-w4a8", "model.layers.0.mlp.down_proj")
    fast = FastDequantizer(torch.float32, verify=False)
    assert torch.equal(fast.dequantize(FORMAT, knobs, tensors), FORMAT.dequantize(tensors, knobs).float())
    wide = dict(tensors, weight=tensors["weight"].clone())
    wide["weight"][3, 5] = -9
    with pytest.raises(FormatError, match="outside int4"):
        fast.dequantize(FORMAT, knobs, wide)
    with pytest.raises(FormatError, match="weight_scale"):
        fast.dequantize(FORMAT, knobs, dict(tensors, weight_scale=tensors["weight_scale"][:1]))
