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
