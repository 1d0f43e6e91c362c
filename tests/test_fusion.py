"""Fused parts (harness.checkpoints.fusion) and the architectures' layouts (model_layout): the
groups engines fuse, shared scales as producers write them, per-part input scales, and the
packing of experts that the reference engine does itself."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoints.architectures import ARCHITECTURES
from harness.checkpoints.fusion import fusion_groups, shares_scales
from harness.checkpoints.model_layout import report_names, to_checkpoint_names, to_model_state
from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.formats import get_format
from harness.oracle.reference import dequantize_checkpoint

SMALL = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96}


def test_groups_are_qkv_and_gate_up_per_layer_and_per_expert():
    arch = ARCHITECTURES["qwen2_moe"]
    settings = arch.settings({"num_hidden_layers": 1})
    groups = fusion_groups(arch, settings)
    assert (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ) in groups
    assert ("model.layers.0.mlp.experts.2.gate_proj", "model.layers.0.mlp.experts.2.up_proj") in groups
    assert ("model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj") in groups
    assert len(groups) == 1 + settings["num_experts"] + 1
    mixtral = ARCHITECTURES["mixtral"]
    assert ("model.layers.0.block_sparse_moe.experts.0.w1", "model.layers.0.block_sparse_moe.experts.0.w3") in (
        fusion_groups(mixtral, mixtral.settings({"num_hidden_layers": 1}))
    )
    phi3 = ARCHITECTURES["phi3"]  # fused on disk already: nothing left to fuse
    assert fusion_groups(phi3, phi3.settings({})) == []


@pytest.mark.parametrize(
    "name", ["ct-fp8-tensor", "ct-fp8-channel", "ct-nvfp4", "modelopt-nvfp4", "fp8-block", "ct-fp8-block"]
)
def test_only_formats_whose_scales_stay_within_rows_can_share(name):
    assert shares_scales(get_format(name), {}) == (name not in ("fp8-block", "ct-fp8-block"))


@pytest.mark.parametrize("name", ["ct-fp8-tensor", "ct-nvfp4", "modelopt-nvfp4", "modelopt-fp8", "ct-int4"])
def test_shared_scales_are_one_per_group_and_the_reference_reads_them_exactly(name, tmp_path):
    manifest = generate(
        Recipe(format=name, arch="mixtral", config=SMALL, layout={"fused_scales": "shared"}), tmp_path / "c"
    )
    checkpoint = Checkpoint(tmp_path / "c")
    per_tensor = {  # ct-int4's scales are per row group: sharing leaves nothing per tensor to compare
        "ct-fp8-tensor": "weight_scale",
        "ct-nvfp4": "weight_global_scale",
        "modelopt-nvfp4": "weight_scale_2",
        "modelopt-fp8": "weight_scale",
    }.get(name)
    for group in fusion_groups(ARCHITECTURES["mixtral"], ARCHITECTURES["mixtral"].settings(SMALL)):
        values = [checkpoint.tensor(f"{m}.{per_tensor}") for m in group] if per_tensor else []
        assert all(torch.equal(values[0], v) for v in values[1:]), group
        assert any("shared by the fused group" in n for n in manifest["modules"][group[0]]["notes"])
    expected = load_file(str(tmp_path / "c" / "harness_truth" / "truth.safetensors"))  # the quantizer's own truth
    for name_, tensor in dequantize_checkpoint(tmp_path / "c"):
        assert torch.equal(tensor, expected[name_]), name_


def test_shared_scales_are_refused_for_block_formats():
    with pytest.raises(HarnessError, match="fused_scales=shared"):
        Recipe(format="fp8-block", arch="llama", layout={"fused_scales": "shared"}).resolved()


def test_distinct_input_scales_differ_within_a_group(tmp_path):
    recipe = Recipe(
        format="ct-fp8-tensor",
        arch="llama",
        config=SMALL,
        knobs={"input_scale": True},
        layout={"fused_scales": "distinct-inputs"},
    )
    generate(recipe, tmp_path / "c")
    checkpoint = Checkpoint(tmp_path / "c")
    scales = [float(checkpoint.tensor(f"model.layers.0.self_attn.{p}_proj.input_scale")) for p in "qkv"]
    assert len(set(scales)) == 3
    assert float(checkpoint.tensor("model.layers.0.self_attn.o_proj.input_scale")) == scales[0]


def test_quantized_head_leaves_the_ignore_list_and_quantized_embeddings_expect_exact_or_refuse(tmp_path):
    recipe = Recipe(
        format="ct-fp8-tensor",
        arch="llama",
        config=SMALL,
        layout={"quantize_lm_head": True, "quantize_embeddings": True},
    )
    manifest = generate(recipe, tmp_path / "c")
    checkpoint = Checkpoint(tmp_path / "c")
    assert "lm_head" not in checkpoint.quantization_config["ignore"]
    assert {"lm_head.weight_scale", "model.embed_tokens.weight_scale"} <= set(checkpoint.names())
    assert manifest["modules"]["model.embed_tokens"]["expectation"] == "exact-or-refuse"
    assert manifest["modules"]["lm_head"]["expectation"] == "exact"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_experts_pack_into_the_model_layout_and_split_back_exactly(arch):
    settings = ARCHITECTURES[arch].settings({"num_hidden_layers": 2})
    config = {"model_type": ARCHITECTURES[arch].model_type, **settings}
    layout = ARCHITECTURES[arch].tensor_layout(settings)
    state = {name: torch.randn(shape) for name, (shape, _) in layout.items()}
    packed = to_model_state(config, dict(state))
    assert not any(".experts.0." in n for n in packed) and any(n.endswith("experts.gate_up_proj") for n in packed)
    back = to_checkpoint_names(config, packed)
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_load_report_names_what_the_checkpoint_stores_even_outside_the_layout(arch):
    """An orphan scale (no module of the layout) is reported under the name it has on disk, so the
    runner can tell it from a key the loader dropped (Mixtral's block_sparse_moe is `mlp` in the model)."""
    settings = ARCHITECTURES[arch].settings({"num_hidden_layers": 1})
    config = {"model_type": ARCHITECTURES[arch].model_type, **settings}
    block = ARCHITECTURES[arch].moe.block
    orphan = f"model.layers.0.{block}.experts.1.unused_proj.weight_scale"
    state = to_model_state(config, {orphan: torch.ones(1)})
    assert report_names(config, list(state)) == [orphan]
