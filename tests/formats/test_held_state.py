"""An engine's held state is decoded as it is: a non-finite scale it holds (a slot never written)
becomes non-finite weights to judge, where the same scale in a checkpoint is refused."""

from __future__ import annotations

import pytest
import torch

from harness.formats import get_format
from harness.formats.base import FormatError

#: format -> (its scale tensor, the value that makes one entry non-finite)
SCALES = {
    "ct-fp8-channel": ("weight_scale", float("nan")),
    "fp8-block": ("weight_scale_inv", float("inf")),
    "ct-int4": ("weight_scale", float("nan")),
    "ct-w8a8": ("weight_scale", float("nan")),
    "ct-mxfp4": ("weight_scale", 255),  # E8M0's NaN code
    "gptq": ("scales", float("nan")),
    "awq": ("scales", float("nan")),
}


@pytest.mark.parametrize("name", SCALES)
def test_a_nonfinite_scale_is_refused_from_a_file_and_decoded_when_held(name):
    fmt = get_format(name)
    knobs = fmt.resolve_knobs({})
    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tensors = dict(fmt.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=1.0).tensors)
    suffix, bad = SCALES[name]
    scale = tensors[suffix].clone()
    scale.view(-1)[0] = bad
    tensors[suffix] = scale
    with pytest.raises(FormatError, match="non-finite"):
        fmt.dequantize(tensors, knobs)
    held = fmt.dequantize_held(tensors, knobs)
    assert held.shape == weight.shape
    assert not torch.isfinite(held).all()
    assert torch.isfinite(held).any()
    with pytest.raises(FormatError, match="non-finite"):  # the leniency ends with the call
        fmt.dequantize(tensors, knobs)


def test_held_codes_without_the_formats_scale_are_their_values():
    """A module the loader took for unquantized holds the stored int8 codes as its weight."""
    from harness.engines.hf_common import held_weights

    codes = torch.randint(-127, 128, (4, 8), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(4, 8)
    model.embed_tokens.weight = torch.nn.Parameter(codes, requires_grad=False)
    held = held_weights(model, get_format("ct-w8a8"), {})
    assert torch.equal(held["embed_tokens.weight"], codes.float())
