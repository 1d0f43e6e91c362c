"""fp8-block's UE8M0 scales (`scale_fmt`) against transformers' own FineGrainedFP8 quantizer, the
producer of `scale_fmt: ue8m0` checkpoints, and the reference's reading of each storage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.formats import get_format
from harness.formats.base import FormatError

FORMAT = get_format("fp8-block")


def make_weight(shape=(256, 384), seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)
    weight[:128, :128] = 0  # an all-zero block: scale 1
    return weight.to(torch.bfloat16)


def test_ue8m0_is_bit_exact_against_transformers_quantizer():
    """transformers 5.23's Fp8Quantize (FineGrainedFP8Config(scale_fmt="ue8m0")), run on CPU as
    the conversion op it is, writes the same e4m3 codes and the same float8_e8m0fnu scales."""
    pytest.importorskip("transformers")
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    weight = make_weight()
    config = FineGrainedFP8Config(weight_block_size=(128, 128), scale_fmt="ue8m0")
    theirs = Fp8Quantize(SimpleNamespace(quantization_config=config)).convert({"w.weight": weight})
    knobs = FORMAT.resolve_knobs({"scale_fmt": "ue8m0-e8m0fnu"})
    ours = FORMAT.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert theirs["w.weight_scale_inv"].dtype == ours.tensors["weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert torch.equal(
        theirs["w.weight_scale_inv"].view(torch.uint8), ours.tensors["weight_scale_inv"].view(torch.uint8)
    )
    assert torch.equal(theirs["w.weight"].view(torch.uint8), ours.tensors["weight"].view(torch.uint8))
    assert FORMAT.quantization_config(knobs, [])["scale_fmt"] == "ue8m0"


def test_per_tensor_reads_transformers_quantizer_as_transformers_does():
    """FineGrainedFP8Config(weight_block_size=None), transformers 5.23's one scale per weight: its
    [1, 1] weight_scale_inv read by the reference exactly as transformers' own dequantization reads
    it; our quantizer's scale (amax / 448, where transformers stores 1 / (448 / amax)) within one
    float32 ulp of it; the config round trip says per tensor."""
    pytest.importorskip("transformers")
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight

    weight = make_weight()
    config = FineGrainedFP8Config(weight_block_size=None)
    theirs = Fp8Quantize(SimpleNamespace(quantization_config=config)).convert({"w.weight": weight})
    theirs = {"weight": theirs["w.weight"], "weight_scale_inv": theirs["w.weight_scale_inv"]}
    read = FORMAT.resolve_knobs(FORMAT.knobs_from_config(config.to_dict()))
    assert read["granularity"] == "tensor"
    assert FORMAT.scale_block(read, (256, 384)) == (256, 384)
    their_reading = _dequantize_fp8_weight(theirs["weight"], theirs["weight_scale_inv"], None, torch.float64)
    assert torch.equal(FORMAT.dequantize(theirs, read), their_reading)
    ours = FORMAT.quantize(
        weight, FORMAT.resolve_knobs({"granularity": "tensor"}), model_dtype=torch.bfloat16, activation_amax=1.0
    )
    assert ours.tensors["weight_scale_inv"].shape == theirs["weight_scale_inv"].shape == (1, 1)
    torch.testing.assert_close(ours.tensors["weight_scale_inv"], theirs["weight_scale_inv"], rtol=2**-23, atol=0)
    assert FORMAT.quantization_config(read, [])["weight_block_size"] is None
    assert torch.equal(FORMAT.dequantize(ours.tensors, read), ours.truth)


@pytest.mark.parametrize("shape", [(), (1,), (2, 1)])
def test_per_tensor_scale_of_another_shape_is_refused(shape):
    knobs = FORMAT.resolve_knobs({"granularity": "tensor"})
    result = FORMAT.quantize(make_weight(), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    tensors = dict(result.tensors, weight_scale_inv=torch.ones(shape))
    with pytest.raises(FormatError, match=r"needs the grid \[1, 1\]"):
        FORMAT.dequantize(tensors, knobs)


def test_per_tensor_inputs_are_quantized_per_token():
    """transformers' tensor-scale FP8 matmul (finegrained-fp8's w8a8_tensor_dynamic_fp8_matmul) takes
    one activation scale per row; a block checkpoint's are 1 x block_cols groups."""
    from harness.oracle.activations import scheme_of

    per_tensor = scheme_of({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None})
    assert (per_tensor.kind, per_tensor.strategy, per_tensor.dynamic) == ("fp8", "token", True)
    block = scheme_of({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 64]})
    assert (block.strategy, block.group_size) == ("group", 64)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "ue8m0-e8m0fnu", "ue8m0-uint8"])
def test_every_ue8m0_storage_reads_back_the_truth(scale_fmt):
    knobs = FORMAT.resolve_knobs({"scale_fmt": scale_fmt})
    result = FORMAT.quantize(make_weight(), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    if scale_fmt == "ue8m0":  # stored in float32: every value a power of two
        stored = result.tensors["weight_scale_inv"].double()
        assert torch.equal(torch.exp2(torch.log2(stored).round()), stored)
    read = FORMAT.knobs_from_config(FORMAT.quantization_config(knobs, []))
    assert read["scale_fmt"] == "ue8m0"
    assert torch.equal(FORMAT.dequantize(result.tensors, knobs | read), result.truth)
    assert result.expectation == "exact"


def test_unrounded_scales_are_read_as_stored_and_the_loader_may_refuse():
    knobs = FORMAT.resolve_knobs({"scale_fmt": "ue8m0-unrounded"})
    result = FORMAT.quantize(make_weight(), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    stored = result.tensors["weight_scale_inv"].double()
    assert not torch.equal(torch.exp2(torch.log2(stored).round()), stored)
    assert FORMAT.quantization_config(knobs, [])["scale_fmt"] == "ue8m0"
    assert torch.equal(FORMAT.dequantize(result.tensors, knobs), result.truth)
    assert result.expectation == "exact-or-refuse"


def test_e8m0_bytes_without_the_declaration_are_refused():
    knobs = FORMAT.resolve_knobs({"scale_fmt": "ue8m0-uint8"})
    result = FORMAT.quantize(make_weight(), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    with pytest.raises(FormatError, match="scale_fmt ue8m0"):
        FORMAT.dequantize(result.tensors, FORMAT.resolve_knobs({}))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "ue8m0-e8m0fnu", "ue8m0-uint8", "ue8m0-unrounded"])
def test_audit_names_declared_power_of_two_scales_that_are_not(scale_fmt, tmp_path):
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate
    from harness.oracle.audit import audit_checkpoint

    recipe = Recipe("fp8-block", "llama", config={"num_hidden_layers": 1}, knobs={"scale_fmt": scale_fmt})
    generate(recipe, tmp_path)
    reasons = [f.reason for f in audit_checkpoint(tmp_path).findings if f.check == "scale-values"]
    assert bool(reasons) == (scale_fmt == "ue8m0-unrounded"), reasons
    assert all("not a power of two" in r for r in reasons)
