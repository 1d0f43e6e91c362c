"""gpt-oss's release layout: experts packed on disk (harness.checkpoints.packed_experts), its
`mxfp4` format, and real transformers loading it on CPU, judged per expert."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from harness.checkpoints.manifest import read_manifest, read_truth
from harness.checkpoints.packed_experts import expert_views, pack, packed_name
from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.oracle.reference import dequantize_checkpoint

ODD = {"hidden_size": 160, "intermediate_size": 96, "num_hidden_layers": 2}


def _disk(directory) -> dict[str, tuple[list[int], str]]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shapes = {}
    for name, shard in index.items():
        with safe_open(str(directory / shard), "pt") as handle:
            view = handle.get_slice(name)
            shapes[name] = (view.get_shape(), view.get_dtype())
    return shapes


def test_pack_and_the_reader_views_are_inverse():
    generator = torch.Generator().manual_seed(0)
    per_expert = {}
    for expert in range(3):
        prefix = f"model.layers.0.mlp.experts.{expert}.down_proj"
        per_expert[f"{prefix}.weight_packed"] = torch.randint(0, 256, (5, 32), generator=generator, dtype=torch.uint8)
        per_expert[f"{prefix}.weight_scale"] = torch.randint(100, 140, (5, 2), generator=generator, dtype=torch.uint8)
        per_expert[f"{prefix}.bias"] = torch.randn(5, generator=generator)
    per_expert["model.norm.weight"] = torch.ones(4)
    packed = pack(per_expert)
    assert sorted(packed) == [
        "model.layers.0.mlp.experts.down_proj_bias",
        "model.layers.0.mlp.experts.down_proj_blocks",
        "model.layers.0.mlp.experts.down_proj_scales",
        "model.norm.weight",
    ]
    assert packed["model.layers.0.mlp.experts.down_proj_blocks"].shape == (3, 5, 2, 16)
    views = expert_views({name: list(tensor.shape) for name, tensor in packed.items()})
    assert set(views) == set(per_expert) - {"model.norm.weight"}
    for name, view in views.items():
        assert packed_name(name) == view.stored
        got = packed[view.stored][view.expert].reshape(view.shape)
        assert torch.equal(got, per_expert[name])


def test_unquantized_packed_experts_are_not_split():
    """A bias packed beside bf16 experts (no _blocks) is a model tensor as it is, not a view."""
    assert expert_views({"m.experts.gate_up_proj": [3, 8, 4], "m.experts.gate_up_proj_bias": [3, 4]}) == {}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpt_oss_is_written_in_the_release_layout_and_dequantizes_exactly(dtype, tmp_path):
    directory = tmp_path / "gpt-oss"
    manifest = generate(Recipe("mxfp4", "gpt_oss", config=dict(ODD), layout={"dtype": dtype}), directory)
    disk = _disk(directory)
    experts, hidden, inter = 3, ODD["hidden_size"], ODD["intermediate_size"]
    layer = "model.layers.1.mlp.experts"
    assert disk[f"{layer}.gate_up_proj_blocks"] == ([experts, 2 * inter, hidden // 32, 16], "U8")
    assert disk[f"{layer}.gate_up_proj_scales"] == ([experts, 2 * inter, hidden // 32], "U8")
    assert disk[f"{layer}.down_proj_blocks"] == ([experts, hidden, inter // 32, 16], "U8")
    assert disk[f"{layer}.down_proj_bias"][0] == [experts, hidden]
    assert disk["model.layers.0.self_attn.sinks"][0] == [4]
    assert not any(".experts.0." in name for name in disk)  # nothing per expert on disk
    assert "model.layers.0.self_attn.q_proj.weight" in disk  # attention stays unquantized
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"] == {
        "modules_to_not_convert": ["lm_head", "model.layers.*.self_attn", "model.layers.*.mlp.router"],
        "quant_method": "mxfp4",
    }
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    checkpoint = Checkpoint(directory)
    assert f"{layer}.2.gate_up_proj.weight_packed" in checkpoint.names()
    assert f"{layer}.gate_up_proj_blocks" not in checkpoint.names()
    got = dict(dequantize_checkpoint(directory))
    truth = read_truth(directory, read_manifest(directory))
    assert set(got) == set(truth)
    assert len([m for m in manifest["modules"] if ".experts." in m]) == 2 * 2 * experts
    for name in truth:
        assert torch.equal(got[name], truth[name]), name


@pytest.mark.parametrize(
    ("fmt", "arch", "extra", "message"),
    [
        ("mxfp4", "llama", {}, "mxfp4 is the layout of gpt_oss only"),
        ("ct-mxfp4", "gpt_oss", {}, "gpt_oss is written only in mxfp4"),
        ("mxfp4", "gpt_oss", {"layout": {"quantize_lm_head": True}}, "quantizes its experts only"),
        ("mxfp4", "gpt_oss", {"layout": {"kv_scales": "self_attn"}}, "quantizes its experts only"),
        ("mxfp4", "gpt_oss", {"perturb": {"disagreement": "missing-scale"}}, "no single module"),
        ("mxfp4", "gpt_oss", {"config": {"hidden_size": 144}}, "not a multiple of 32"),
    ],
)
def test_what_the_release_layout_cannot_hold_is_refused_in_one_line(fmt, arch, extra, message, tmp_path):
    with pytest.raises(HarnessError, match=message) as caught:
        generate(Recipe(fmt, arch, **extra), tmp_path / "c")
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss") / "checkpoint"
    generate(Recipe("mxfp4", "gpt_oss", config=dict(ODD)), directory)
    return directory


def test_real_transformers_loads_gpt_oss_mxfp4_exactly_on_cpu(gpt_oss_checkpoint, tmp_path):
    """transformers dequantizes MXFP4 on CPU (no triton here): every expert, bias and sink as the
    reference holds it, logits within tolerance."""
    pytest.importorskip("transformers")
    from harness.differential.runner import EngineSession, evaluate

    session = EngineSession(["reference", "transformers"], tmp_path / "engines")
    try:
        result = evaluate(gpt_oss_checkpoint, session)
    finally:
        session.close()
    assert result.outcomes["transformers"].status == "loaded"
    assert result.findings == [], [f.message for f in result.findings]


@pytest.mark.parametrize(
    "double", ["tests.doubles.buggy_engines:GateUpBlocksEngine", "tests.doubles.buggy_engines:E8M0OffByOneEngine"]
)
def test_a_loader_misreading_the_packed_experts_is_caught(double, gpt_oss_checkpoint, tmp_path):
    pytest.importorskip("transformers")
    from harness.differential.runner import EngineSession, evaluate

    session = EngineSession(["reference", double], tmp_path / "engines")
    try:
        result = evaluate(gpt_oss_checkpoint, session)
    finally:
        session.close()
    caught = [f for f in result.findings if f.engine == double]
    assert [f for f in result.findings if f.engine == "reference"] == []
    assert any(f.kind == "weight-mismatch" and ".experts." in f.message for f in caught), [f.message for f in caught]


def test_audit_reads_packed_experts_one_by_one(tmp_path):
    """A NaN E8M0 scale inside a packed `_scales` tensor is a finding naming its expert, and a clean
    gpt-oss checkpoint audits clean (the release's wildcard ignore list read as transformers does)."""
    from harness.oracle.audit import audit_checkpoint

    clean, broken = tmp_path / "clean", tmp_path / "broken"
    generate(Recipe("mxfp4", "gpt_oss", config=dict(ODD)), clean)
    generate(Recipe("mxfp4", "gpt_oss", config=dict(ODD), perturb={"nonfinite_scale": "nan"}), broken)
    assert audit_checkpoint(clean).findings == []
    (finding,) = audit_checkpoint(broken).findings
    assert finding.module == "model.layers.0.mlp.experts.0.gate_up_proj"
    assert "0xFF" in finding.reason


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct-fp8-channel"])
def test_the_experts_naming_is_read_from_any_formats_first_tensor(tmp_path, fmt):
    """Mixtral's experts stored as gate_proj/up_proj/down_proj (llm-compressor's naming) are read under
    that naming whatever tensor the format stores first (weight, weight_packed, GPTQ/AWQ's qweight):
    the model state the reference builds then holds every expert (none left as initialised)."""
    from harness.checkpoints.model_layout import known_layout

    recipe = Recipe(
        format=fmt, arch="mixtral", config={"num_hidden_layers": 1}, layout={"expert_naming": "projections"}
    )
    generate(recipe, tmp_path)
    checkpoint = Checkpoint(tmp_path)
    assert known_layout(checkpoint.config, checkpoint.names()).moe.parts == ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
@pytest.mark.parametrize("naming", ["architecture", "projections"])
def test_the_experts_naming_is_read_from_the_names_under_either_key_prefix(tmp_path, prefix, naming):
    """A Mixtral's expert names (w1/w3/w2 or gate_proj/up_proj/down_proj) are detected on the
    stored names with a vision-language prefix too (the reference's model once held no expert of a
    projection-named checkpoint under `model.language_model.`)."""
    from harness.checkpoints.architectures import ARCHITECTURES
    from harness.checkpoints.model_layout import with_expert_naming

    recipe = Recipe(
        format="ct-fp8-tensor",
        arch="mixtral",
        config={"num_hidden_layers": 1},
        layout={"key_prefix": prefix, "expert_naming": naming},
    )
    generate(recipe, tmp_path)
    arch = ARCHITECTURES["mixtral"]
    settings = recipe.resolved().settings
    parts = with_expert_naming(arch, settings, Checkpoint(tmp_path).names()).moe.parts
    assert parts == (arch.moe.parts if naming == "architecture" else arch.moe.other_parts[0])


@pytest.mark.parametrize("naming", ["architecture", "projections"])
def test_experts_under_no_naming_of_the_model_are_told_and_nothing_else(tmp_path, naming):
    """GPTQModel 7.6 saves a Mixtral's experts under transformers 5's in-memory names
    (`mlp.experts.E.gate_proj`), which no Mixtral loader places: foreign_experts names each such
    expert, and nothing in either naming the reference reads, nor a stray scale under an expert, nor
    an expert of a layer past num_hidden_layers (DeepSeek-V3's multi-token prediction layer)."""
    from harness.checkpoints.model_layout import foreign_experts

    recipe = Recipe(
        format="ct-fp8-channel", arch="mixtral", config={"num_hidden_layers": 1}, layout={"expert_naming": naming}
    )
    generate(recipe, tmp_path)
    checkpoint = Checkpoint(tmp_path)
    names = checkpoint.names()
    assert foreign_experts(checkpoint.config, names) == []
    stray = [
        "model.layers.0.block_sparse_moe.experts.0.unused_proj.weight_scale",
        "model.layers.1.block_sparse_moe.experts.0.w1.weight",
    ]
    assert foreign_experts(checkpoint.config, names + stray) == []
    in_memory = [name.replace(".block_sparse_moe.", ".mlp.") for name in names]
    foreign = foreign_experts(checkpoint.config, in_memory)
    experts = {n.rpartition(".")[0] for n in in_memory if ".experts." in n and n.endswith(".weight")}
    assert foreign == sorted(experts) and len(foreign) == 3 * checkpoint.config["num_local_experts"]
