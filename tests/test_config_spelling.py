"""Enum-valued config fields in the other letter case (`layout.config_spelling=other-case`): the
fields the formats' own readers compare without case are read by the harness as the same values
(harness.formats.spelling), so the reference's weights are those of the producer's spelling."""

from __future__ import annotations

import json

import pytest
import torch

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.formats import FORMAT_NAMES, get_format
from harness.formats.spelling import canonical, other_case
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs


@pytest.mark.parametrize("name", [name for name in FORMAT_NAMES if get_format(name).has_scales])
def test_every_format_respells_and_reads_back(name):
    fmt = get_format(name)
    config = fmt.quantization_config(fmt.resolve_knobs({}), ["lm_head"])
    respelled, fields = other_case(config)
    assert canonical(respelled) == config
    assert canonical(config) == config  # the producers' own spelling is the canonical one
    assert respelled["quant_method"] == config["quant_method"]
    if name == "mxfp4":  # {"quant_method": "mxfp4"} and the ignore list only
        assert not fields
    else:
        assert fields and respelled != config
        assert fmt.matches(canonical(respelled))


def test_nested_fields_and_values_without_letters():
    config = {"format": "float-quantized", "version": "0.20.0", "groups": [{"weights": {"type": "float"}}]}
    respelled, fields = other_case(config)  # a compressed-tensors `format` is read with case: kept
    assert respelled == {"format": "float-quantized", "version": "0.20.0", "groups": [{"weights": {"type": "FLOAT"}}]}
    assert fields == ["groups[0].weights.type='FLOAT'"]
    assert other_case({"quant_algo": "NVFP4"})[0] == {"quant_algo": "nvfp4"}
    assert canonical({"quant_algo": "nvfp4", "dynamic": False}) == {"quant_algo": "NVFP4", "dynamic": False}


@pytest.mark.parametrize(
    ("name", "knobs"), [("ct-fp8-tensor", {}), ("gptq", {"checkpoint_format": "gptq_v2", "sym": False}), ("awq", {})]
)
def test_the_other_spelling_means_the_same_weights(tmp_path, name, knobs):
    weights = {}
    for spelling in ("producer", "other-case"):
        recipe = Recipe(
            format=name,
            arch="llama",
            config={"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 512},
            knobs=knobs,
            layout={"config_spelling": spelling},
        )
        directory = tmp_path / spelling
        manifest = generate(recipe, directory)
        raw = json.loads((directory / "config.json").read_text())["quantization_config"]
        assert (raw == canonical(raw)) == (spelling == "producer")
        assert manifest["expectation"] == "exact"  # as valid as the producer's spelling
        assert format_and_knobs(directory)[0].name == name
        weights[spelling] = dict(dequantize_checkpoint(directory))
    assert weights["producer"].keys() == weights["other-case"].keys()
    assert all(torch.equal(weights["producer"][n], weights["other-case"][n]) for n in weights["producer"])


def test_a_format_without_enum_fields_is_refused():
    with pytest.raises(HarnessError, match="no enum-valued field"):
        Recipe(format="mxfp4", arch="gpt_oss", layout={"config_spelling": "other-case"}).resolved()
