"""A producer's own config over a defined format's tensors (`layout.producer_config`,
harness.checkpoints.foreign_configs): what the generator writes is what the producer's own export
carries (cases/producers), it means the same weights as the format's own config, and a combination
the producer does not write is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.checkpoints import foreign_configs
from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.differential.preconditions import checkpoint_context
from harness.formats.equivalents import BLOCK_GRID_4D, ROW_SCALES_1D
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs

CORPUS = Path(__file__).resolve().parents[1] / "cases" / "producers"
#: (producer, format) -> the producer's own export of that scheme
EXPORTS = {
    ("auto-round", "ct-fp8-channel"): "autoround/fp8_static_autoround",
    ("auto-round", "fp8-block"): "autoround/fp8_block_autoround",
    ("auto-round", "ct-mxfp4"): "autoround/mxfp4_autoround",
    ("auto-round", "ct-nvfp4"): "autoround/nvfp4_autoround",
    ("auto-round", "gptq"): "autoround/w4g128_sym_autoround",
    ("auto-round", "awq"): "autoround/w4g128_asym_autoround",
    ("modelopt", "ct-fp8-channel"): "modelopt/fp8_pc_pt",
    ("modelopt", "ct-fp8-block"): "modelopt/fp8_pb_wo",
}
#: (producer, format, the variant's knobs) -> the producer's own export of each VARIANT
VARIANT_EXPORTS = {
    ("auto-round", "gptq", 1): "autoround/w8g128_sym_autoround",
    ("auto-round", "gptq", 2): "autoround/w4g128_sym_autoround_gptqmodel",
    ("auto-round", "gptq", 3): "autoround/w4g128_asym_autoround_gptqmodel",
}
#: every (producer, format, knobs, export): the pairings' and their variants'
CASES = [(p, f, foreign_configs.PAIRINGS[p, f], export) for (p, f), export in EXPORTS.items()] + [
    (p, f, foreign_configs.producer_variants(p, f)[i], export) for (p, f, i), export in VARIANT_EXPORTS.items()
]
IDS = [export for *_, export in CASES]
#: fields that say which model, run, machine and version, not which scheme (AutoRound writes
#: `amp: false` where the CPU has no bfloat16 arithmetic, as on the AVX2 kind, and nothing where it has)
RUN_FIELDS = {"amp", "autoround_version", "block_name_to_quantize", "extra_config", "ignore", "producer"}
SIZES = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}


def recipe(producer: str, fmt: str, arch: str = "llama", knobs=None, **layout) -> Recipe:
    knobs = dict(foreign_configs.PAIRINGS[(producer, fmt)] if knobs is None else knobs)
    return Recipe(
        format=fmt, arch=arch, config=dict(SIZES), knobs=knobs, layout={"producer_config": producer, **layout}
    )


def quantization_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())["quantization_config"]


def test_every_pairing_and_variant_has_an_export_of_its_producer():
    assert set(EXPORTS) == set(foreign_configs.PAIRINGS)
    variants = {(p, f, i) for (p, f), extra in foreign_configs.VARIANTS.items() for i in range(1, len(extra) + 1)}
    assert set(VARIANT_EXPORTS) == variants


@pytest.mark.parametrize(("producer", "fmt", "knobs", "export"), CASES, ids=IDS)
def test_the_written_config_is_the_producers_own(tmp_path, producer, fmt, knobs, export):
    generate(recipe(producer, fmt, knobs=knobs), tmp_path / "generated")
    written = quantization_config(tmp_path / "generated")
    exported = quantization_config(CORPUS / export)
    assert {k: v for k, v in written.items() if k not in RUN_FIELDS} == {
        k: v for k, v in exported.items() if k not in RUN_FIELDS
    }
    assert set(written) - RUN_FIELDS == set(exported) - RUN_FIELDS


@pytest.mark.parametrize(("producer", "fmt", "knobs", "export"), CASES, ids=IDS)
def test_the_written_tensors_are_named_as_the_producers_own(tmp_path, producer, fmt, knobs, export):
    """Each module stores the tensors the producer's export stores for it (AutoRound's
    auto_round:auto_gptq no g_idx, its auto_round:gptqmodel one)."""
    generate(recipe(producer, fmt, knobs=knobs), tmp_path)
    suffixes = {name.rpartition(".")[2] for name in Checkpoint(tmp_path).names() if "layers.0.self_attn.q_proj" in name}
    exported = {
        name.rpartition(".")[2] for name in Checkpoint(CORPUS / export).names() if "layers.0.self_attn.q_proj" in name
    }
    assert suffixes == exported


@pytest.mark.parametrize(("producer", "fmt", "knobs", "export"), CASES, ids=IDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_the_foreign_config_means_the_formats_weights(tmp_path, producer, fmt, knobs, export, arch):
    """The same tensors under the format's own config and under the producer's read to the same
    weights, the truth; only the stored layout the producer uses differs (row scales 1-D)."""
    native = Recipe(format=fmt, arch=arch, config=dict(SIZES), knobs=knobs)
    generate(native, tmp_path / "native")
    generate(recipe(producer, fmt, arch, knobs=knobs), tmp_path / "foreign")
    (native_fmt, native_knobs), (foreign_fmt, foreign_knobs) = (
        format_and_knobs(tmp_path / which) for which in ("native", "foreign")
    )
    assert foreign_fmt.name == native_fmt.name == fmt
    assert foreign_knobs.pop(ROW_SCALES_1D, False) == (fmt in foreign_configs.ROW_SCALES_1D_FORMATS)
    assert foreign_knobs.pop(BLOCK_GRID_4D, False) == (fmt in foreign_configs.BLOCK_GRID_4D_FORMATS)
    assert foreign_knobs == native_knobs
    native_weights, foreign_weights = (dict(dequantize_checkpoint(tmp_path / w)) for w in ("native", "foreign"))
    assert native_weights.keys() == foreign_weights.keys()
    assert all(torch.equal(native_weights[n], foreign_weights[n]) for n in native_weights)
    assert checkpoint_context(tmp_path / "foreign")["producer_config"] == producer


def test_autoround_gptq_packing_stores_no_group_index_as_its_export(tmp_path):
    """AutoRound packs its GPTQ layout without act-order and writes no g_idx; the GPTQ format's
    own config keeps it (readers take k // g either way: the weights are the same, above)."""
    generate(recipe("auto-round", "gptq"), tmp_path / "foreign")
    generate(Recipe(format="gptq", arch="llama", config=dict(SIZES)), tmp_path / "native")
    exported = Checkpoint(CORPUS / EXPORTS["auto-round", "gptq"]).names()
    assert exported and not any(name.endswith(".g_idx") for name in exported)
    assert not any(name.endswith(".g_idx") for name in Checkpoint(tmp_path / "foreign").names())
    assert any(name.endswith(".g_idx") for name in Checkpoint(tmp_path / "native").names())


def test_routers_stay_in_sixteen_bits_as_the_producer_says(tmp_path):
    generate(recipe("auto-round", "ct-nvfp4", "qwen3_moe"), tmp_path)
    extra = quantization_config(tmp_path)["extra_config"]
    assert sorted(extra) == [".*model\\.layers\\.0\\.mlp\\.gate.*", ".*model\\.layers\\.1\\.mlp\\.gate.*"]
    assert all(settings["bits"] == 16 for settings in extra.values())


@pytest.mark.parametrize("case", sorted({*IDS, "llmcompressor/llama-fp8-dynamic", "modelopt/nvfp4"}))
def test_a_checkpoint_says_which_producers_config_it_carries(case):
    expected = next((p for p, _, _, c in CASES if c == case), foreign_configs.NATIVE)
    assert foreign_configs.producer_config_of(quantization_config(CORPUS / case)) == expected
    assert checkpoint_context(CORPUS / case)["producer_config"] == expected


@pytest.mark.parametrize(
    ("fmt", "knobs", "layout", "message"),
    [
        ("ct-fp8-tensor", {}, {}, "written over awq, ct-fp8-channel, ct-mxfp4, ct-nvfp4, fp8-block, gptq only"),
        (
            "ct-fp8-channel",
            {},
            {},
            "needs the knobs auto-round writes: set {'scale_dtype': 'float32', 'input_scale': True}",
        ),
        (
            "ct-fp8-channel",
            {"input_scale": True, "scale_dtype": "float32"},
            {"quantize_lm_head": True},
            "writes no quantize_lm_head=True",
        ),
    ],
)
def test_a_combination_the_producer_does_not_write_is_refused(fmt, knobs, layout, message):
    bad = Recipe(format=fmt, arch="llama", knobs=knobs, layout={"producer_config": "auto-round", **layout})
    with pytest.raises(HarnessError, match=message.replace("{", "\\{").replace("(", "\\(")):
        bad.resolved()


def test_the_standalone_scripts_store_row_scales_as_the_generator_does():
    """parts/checkpoint.py cannot import the project: its copy of the formats whose row scales a
    producer's own config stores 1-D must stay the generator's."""
    from harness.lanes.upstream.parts import checkpoint

    assert checkpoint.ROW_SCALES_1D_FORMATS == foreign_configs.ROW_SCALES_1D_FORMATS
    assert checkpoint.OMITTED == foreign_configs.OMITTED  # keyed by checkpoint_format too
    assert checkpoint.BLOCK_GRID_4D_FORMATS == foreign_configs.BLOCK_GRID_4D_FORMATS


def test_modelopt_block_scales_are_stored_with_the_shapes_of_its_export(tmp_path):
    """ModelOpt's FP8_PB_WO grid: 4-D [N/128, 1, K/128, 1], and 0-D for a weight of one block, as
    its export stores them module by module (cases/producers/modelopt/fp8_pb_wo, a Llama of the
    same sizes)."""
    export = Checkpoint(CORPUS / EXPORTS["modelopt", "ct-fp8-block"])
    sizes = {"num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}
    sizes |= {"num_key_value_heads": 2, "head_dim": 32}
    generated = recipe("modelopt", "ct-fp8-block")
    generated.config = sizes
    generate(generated, tmp_path)
    written = Checkpoint(tmp_path)
    scales = [name for name in written.names() if name.endswith("weight_scale")]
    assert len(scales) == 7
    for name in scales:
        assert list(written.tensor(name).shape) == list(export.tensor(name).shape), name
