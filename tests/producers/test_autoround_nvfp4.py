"""AutoRound's NVFP4 export (`quant_method: auto-round`, `packing_format: auto_round:llm_compressor`)
carries no producer truth (its packer was not captured, provenance.json says so): the reference's
reading of it is checked against the model AutoRound quantized instead, rebuilt from the seed and
sizes its provenance records. Read by compressed-tensors' NVFP4 definition, every quantized weight
is within NVFP4's rounding of the original and every other tensor is the original; a misread
convention (a global scale taken as a multiplier, swapped nibbles) is orders of magnitude off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.oracle.activations import scheme_of
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
CASE = REPO / "cases" / "producers" / "autoround" / "nvfp4_autoround"
#: NVFP4 with e4m3 group scales: about 0.09 of a weight's norm here; a misreading is > 1
RELATIVE_ERROR = 0.15
#: no element further from the original than half its group's largest magnitude
GROUP_ERROR = 0.5


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    sys.path.insert(0, str(REPO / "scripts" / "producers"))
    try:
        import producing
    finally:
        sys.path.pop(0)
    provenance = json.loads((CASE / "provenance.json").read_text())
    directory = tmp_path_factory.mktemp("autoround-base")
    producing.build_seeded_llama(directory, provenance["recipe"]["model_config"], provenance["seed"])
    return load_file(directory / "model.safetensors")


def test_autoround_nvfp4_is_read_as_compressed_tensors_w4a4():
    fmt, knobs = format_and_knobs(CASE)
    assert fmt.name == "ct-nvfp4" and knobs == {"global_scale_convention": "divisor"}
    config = json.loads((CASE / "config.json").read_text())["quantization_config"]
    scheme = scheme_of(config)
    assert (scheme.kind, scheme.group_size, scheme.static) == ("nvfp4", 16, "input_global_scale")


def test_autoround_nvfp4_decodes_to_the_model_it_quantized(original):
    quantized = 0
    for name, weight in dequantize_checkpoint(CASE):
        want = original[name].double()
        got = weight.double()
        if name.endswith("proj.weight"):
            quantized += 1
            assert ((got - want).norm() / want.norm()).item() < RELATIVE_ERROR, name
            groups = want.reshape(want.shape[0], -1, 16).abs().amax(-1, keepdim=True)
            assert ((got - want).abs().reshape(want.shape[0], -1, 16) <= GROUP_ERROR * groups).all(), name
        else:
            assert torch.equal(got, want), name
    assert quantized == 14


def test_what_autoround_declares_beyond_the_definition_is_unsupported_or_malformed_not_misread():
    from harness.core.errors import FormatError, UnsupportedFormat
    from harness.formats import auto_round

    config = json.loads((CASE / "config.json").read_text())["quantization_config"]
    assert auto_round.compressed_tensors_groups(dict(config, act_bits=16))[0]["input_activations"] is None
    assert auto_round.compressed_tensors_groups(dict(config, data_type="mx_fp")) is None
    assert auto_round.compressed_tensors_groups(dict(config, extra_config={"lm_head": {"bits": 16}}))
    for changed in ({"act_data_type": "nv_fp4"}, {"extra_config": {"model.layers.0.mlp.down_proj": {"bits": 8}}}):
        with pytest.raises(UnsupportedFormat):
            auto_round.compressed_tensors_groups(dict(config, **changed))
    for changed in ({"act_bits": "4"}, {"extra_config": ["lm_head"]}):
        with pytest.raises(FormatError):
            auto_round.compressed_tensors_groups(dict(config, **changed))
