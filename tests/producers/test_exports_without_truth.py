"""Foreign exports read through a config of their own (harness.formats.equivalents) that carry no
producer truth (their packers were not captured, provenance.json says so): AutoRound's over
compressed-tensors' and FineGrainedFP8's tensors (NVFP4, MXFP4, FP8_STATIC, FP8_BLOCK) and
ModelOpt's FP8_PER_CHANNEL_PER_TOKEN, W4A16_NVFP4 and FP8_PB_WO. The reference's reading of each is checked
against the model the producer quantized instead, rebuilt from the seed and sizes its provenance
records (every case shares it). Read by the format's definition, every quantized weight is within
the format's rounding of the original and every other tensor is the original; a misread convention
(a global scale taken as a multiplier, swapped nibbles, an E8M0 bias applied twice, a row scale
broadcast along the columns) is several times off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.core.errors import FormatError, UnsupportedFormat
from harness.formats import auto_round
from harness.oracle.activations import scheme_of
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "cases" / "producers"
CASES = CORPUS / "autoround"
#: case -> (format, knobs, group size, relative error bound). The measured relative errors are
#: 0.094 (AutoRound NVFP4, e4m3 group scales), 0.112 (MXFP4, power-of-two scales), 0.026 (FP8 per
#: row, both producers), 0.027 (FP8 blocks) and 0.096 (ModelOpt NVFP4); a misreading is > 0.5
READINGS = {
    "nvfp4_autoround": ("ct-nvfp4", {"global_scale_convention": "divisor"}, 16, 0.15),
    "mxfp4_autoround": ("ct-mxfp4", {}, 32, 0.15),
    "mxfp4_rceil_autoround": ("ct-mxfp4", {}, 32, 0.15),
    "fp8_static_autoround": ("ct-fp8-channel", {"input_scale": True, "row_scales_1d": True}, 128, 0.05),
    "fp8_block_autoround": ("fp8-block", {"block_rows": 128, "block_cols": 128, "scale_fmt": "float"}, 128, 0.05),
    "../modelopt/fp8_pc_pt": ("ct-fp8-channel", {"input_scale": False, "row_scales_1d": True}, 128, 0.05),
    "../modelopt/fp8_pb_wo": (
        "ct-fp8-block",
        {"input_scale": False, "block_grid_4d": True, "block_rows": 128, "block_cols": 128},
        128,
        0.05,
    ),
    "../modelopt/w4a16_nvfp4": (
        "modelopt-nvfp4",
        {"global_scale_convention": "multiplier", "weight_only": True},
        16,
        0.15,
    ),
}
#: no element further from the original than half its group's largest magnitude (measured: 0.26
#: and 0.18 for NVFP4, 0.23 for MXFP4, 0.058 for FP8; E2M1's widest step is a third of its largest value)
GROUP_ERROR = 0.5


def config_of(case: str) -> dict:
    return json.loads((CASES / case / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """The bfloat16 model AutoRound quantized, rebuilt from the provenance (every case shares it)."""
    sys.path.insert(0, str(REPO / "scripts" / "producers"))
    try:
        import producing
    finally:
        sys.path.pop(0)
    provenances = {
        json.dumps(json.loads((CASES / case / "provenance.json").read_text())["recipe"]["model_config"])
        for case in READINGS
    }
    assert len(provenances) == 1, "the cases no longer share one base model"
    provenance = json.loads((CASES / next(iter(READINGS)) / "provenance.json").read_text())
    directory = tmp_path_factory.mktemp("autoround-base")
    producing.build_seeded_llama(directory, provenance["recipe"]["model_config"], provenance["seed"])
    return load_file(directory / "model.safetensors")


def test_autoround_nvfp4_is_read_as_compressed_tensors_w4a4():
    fmt, knobs = format_and_knobs(CASES / "nvfp4_autoround")
    assert (fmt.name, knobs) == READINGS["nvfp4_autoround"][:2]
    scheme = scheme_of(config_of("nvfp4_autoround"))
    assert (scheme.kind, scheme.group_size, scheme.static) == ("nvfp4", 16, "input_global_scale")


def test_autoround_mxfp4_is_read_as_compressed_tensors_mxfp4_with_ocp_mx_activations():
    fmt, knobs = format_and_knobs(CASES / "mxfp4_autoround")
    assert (fmt.name, knobs) == READINGS["mxfp4_autoround"][:2]
    scheme = scheme_of(config_of("mxfp4_autoround"))
    assert (scheme.kind, scheme.strategy, scheme.group_size, scheme.dynamic) == ("mxfp4", "group", 32, True)
    # compressed-tensors' own MXFP4 activations round their amax to a power of two first: the same
    # tensors declared by compressed-tensors' own config are read with its rule, not AutoRound's
    ct_own = dict(auto_round.equivalent_config(config_of("mxfp4_autoround")), version="0.20.0")
    assert (scheme.exponent, scheme_of(ct_own).exponent) == ("floor", "even")


def test_autoround_fp8_static_is_read_as_compressed_tensors_fp8_per_row_with_static_inputs():
    fmt, knobs = format_and_knobs(CASES / "fp8_static_autoround")
    assert (fmt.name, knobs) == READINGS["fp8_static_autoround"][:2]
    scheme = scheme_of(config_of("fp8_static_autoround"))
    assert (scheme.kind, scheme.strategy, scheme.dynamic, scheme.static) == ("fp8", "tensor", False, "input_scale")


def test_autoround_fp8_block_is_read_as_fine_grained_fp8_and_rceil_activations_round_their_scale_up():
    fmt, knobs = format_and_knobs(CASES / "fp8_block_autoround")
    assert (fmt.name, knobs) == READINGS["fp8_block_autoround"][:2]
    scheme = scheme_of(config_of("fp8_block_autoround"))
    assert (scheme.kind, scheme.strategy, scheme.group_size, scheme.dynamic) == ("fp8", "group", 128, True)
    assert format_and_knobs(CASES / "mxfp4_rceil_autoround")[0].name == "ct-mxfp4"
    assert scheme_of(config_of("mxfp4_rceil_autoround")).exponent == "ceil"
    assert scheme_of(config_of("mxfp4_autoround")).exponent == "floor"


def test_modelopt_per_channel_fp8_and_weight_only_nvfp4_and_block_fp8_are_read():
    for case in ("../modelopt/fp8_pc_pt", "../modelopt/w4a16_nvfp4", "../modelopt/fp8_pb_wo"):
        fmt, knobs = format_and_knobs(CASES / case)
        assert (fmt.name, knobs) == READINGS[case][:2]
    scheme = scheme_of(config_of("../modelopt/fp8_pc_pt"))
    assert (scheme.kind, scheme.strategy, scheme.dynamic, scheme.static) == ("fp8", "token", True, "")
    assert scheme_of(config_of("../modelopt/w4a16_nvfp4")) is None
    assert scheme_of(config_of("../modelopt/fp8_pb_wo")) is None  # weight only: its input quantizers disabled


@pytest.mark.parametrize("case", sorted(READINGS))
def test_exports_without_truth_export_decodes_to_the_model_it_quantized(case, original):
    group, bound = READINGS[case][2:]
    quantized = 0
    for name, weight in dequantize_checkpoint(CASES / case):
        want = original[name].double()
        got = weight.double()
        if name.endswith("proj.weight"):
            quantized += 1
            assert ((got - want).norm() / want.norm()).item() < bound, name
            groups = want.reshape(want.shape[0], -1, group).abs().amax(-1, keepdim=True)
            assert ((got - want).abs().reshape(want.shape[0], -1, group) <= GROUP_ERROR * groups).all(), name
        else:
            assert torch.equal(got, want), name
    assert quantized == 14


def test_what_autoround_declares_beyond_the_definition_is_unsupported_or_malformed_not_misread():
    nvfp4, mxfp4, fp8 = config_of("nvfp4_autoround"), config_of("mxfp4_autoround"), config_of("fp8_static_autoround")

    def group(config):
        return auto_round.equivalent_config(config)["config_groups"]["group_0"]

    assert group(dict(nvfp4, act_bits=16))["input_activations"] is None
    assert group(dict(mxfp4, act_bits=16))["input_activations"] is None
    assert group(dict(fp8, act_bits=16))["input_activations"] is None
    assert group(dict(nvfp4, data_type="mx_fp", group_size=32, act_bits=16))["format"] == "mxfp4-pack-quantized"
    assert auto_round.equivalent_config(dict(nvfp4, data_type="int")) is None
    assert auto_round.equivalent_config(dict(nvfp4, packing_format="auto_round:auto_gptq")) is None
    assert group(dict(nvfp4, extra_config={"lm_head": {"bits": 16}}))
    for config, changed in (
        (nvfp4, {"act_data_type": "nv_fp4"}),
        (nvfp4, {"extra_config": {"model.layers.0.mlp.down_proj": {"bits": 8}}}),
        (mxfp4, {"bits": 8}),  # MXFP8
        (mxfp4, {"act_dynamic": False}),
        (mxfp4, {"act_bits": 8}),
        (mxfp4, {"act_data_type": "fp"}),
        (mxfp4, {"act_data_type": "mx_fp4_rceil_v2"}),  # another rounding again: not defined
        (fp8, {"group_size": 128}),  # per group: not defined here
        (fp8, {"fmt": "e5m2"}),
        (fp8, {"act_dynamic": True}),
        (config_of("fp8_block_autoround"), {"act_group_size": 64}),
        (config_of("fp8_block_autoround"), {"group_size": 128}),
    ):
        with pytest.raises(UnsupportedFormat):
            auto_round.equivalent_config(dict(config, **changed))
    for changed in ({"act_bits": "4"}, {"extra_config": ["lm_head"]}):
        with pytest.raises(FormatError):
            auto_round.equivalent_config(dict(nvfp4, **changed))
    # a group size other than compressed-tensors' 32 is refused by the MXFP4 reader, not misread
    with pytest.raises(FormatError, match="group_size"):
        format_and_knobs_from(dict(mxfp4, group_size=16))


def format_and_knobs_from(config: dict):
    from harness.formats import detect_format

    fmt = detect_format(config)
    return fmt, fmt.knobs_from_config(config)
