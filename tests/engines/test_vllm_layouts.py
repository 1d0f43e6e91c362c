"""vLLM's weights of the architectures real quantized models ship, under the checkpoint's names.

vLLM stacks a sparse layer's experts (`…experts.w13_weight` [E, 2I, H], gate rows first, and
`…experts.w2_weight` [E, H, I], with stacked scales), fuses q/k/v and gate/up, and registers some
modules twice (DeepSeek's `mla_attn`, the experts' router alias). The engine must hand back one
tensor per expert and part under the names the checkpoint stores (Phi-3 stores `qkv_proj` and
`gate_up_proj` fused: those stay fused), equal to the truth where vLLM loads exactly. Where vLLM
loads the weights but has no kernel to run the experts here (no FP8 MoE backend on a CPU without
AMX), the forward is unsupported in vLLM's words, never a traceback.

The end-to-end tests run real vLLM in the engine's worker (skipped where no vLLM interpreter is
found, as in test_vllm_engine.py); the splitting test runs anywhere.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import TRUTH_FILE, generate
from harness.engines.process import EngineError, EngineProcess, Limits
from harness.engines.vllm.engine import VllmEngine, split_parts
from tests.engines.test_vllm_engine import SEQUENCES, VLLM_PYTHON, assert_within_bf16_ulps, needs_vllm

#: sizes every engine accepts: each fused part and expert a multiple of 128 rows, head size 32
ALIGNED = {"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 4, "num_hidden_layers": 2}
SIZES = {
    "phi3": ALIGNED,
    "mixtral": ALIGNED,
    "deepseek_v3": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_rope_head_dim": 128,
    },
}
#: the format vLLM runs on every CPU (its FP8 block kernels need AMX, NVFP4 has no CPU kernel)
FORMAT = "ct-fp8-channel"


def checkpoint(root, arch: str, fmt: str = FORMAT):
    directory = root / f"{fmt}-{arch}"
    generate(Recipe(format=fmt, arch=arch, seed=2, config=dict(SIZES[arch]), layout={"shards": 1}), directory)
    return directory


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One vLLM worker for the module, with a fresh capability cache (it asks vLLM itself)."""
    saved = os.environ.get("HARNESS_CACHE_DIR")
    os.environ["HARNESS_CACHE_DIR"] = str(tmp_path_factory.mktemp("capabilities"))
    try:
        process = EngineProcess(
            "vllm", VLLM_PYTHON, tmp_path_factory.mktemp("vllm") / "worker.log", Limits(timeout_s=300)
        )
        process.start()
    finally:
        os.environ.pop("HARNESS_CACHE_DIR") if saved is None else os.environ.update(HARNESS_CACHE_DIR=saved)
    reason = process.unsupported(FORMAT)
    if reason:
        process.close()
        pytest.skip(reason)
    yield process
    process.close()


def held_against_truth(engine, directory, scratch) -> tuple[dict, dict]:
    report = engine.load(directory)
    assert report["missing"] == [] and report["unexpected"] == []
    held = engine.weights(scratch / "weights.safetensors")
    truth = load_file(directory / TRUTH_FILE)
    assert not set(truth) - set(held), f"the engine holds no {sorted(set(truth) - set(held))}"
    for name, expected in truth.items():
        assert_within_bf16_ulps(name, held[name], expected)
    return report, held


@needs_vllm
@pytest.mark.slow
def test_phi3_fused_projections_stay_fused_and_run(engine, tmp_path):
    """Phi-3 stores qkv_proj and gate_up_proj fused: vLLM's are compared as they are, not split."""
    directory = checkpoint(tmp_path, "phi3")
    _, held = held_against_truth(engine, directory, tmp_path)
    assert "model.layers.1.self_attn.qkv_proj.weight" in held
    assert "model.layers.1.mlp.gate_up_proj.weight" in held
    assert not [n for n in held if ".q_proj." in n or ".gate_proj." in n], "split a projection stored fused"
    rows = engine.logprobs(SEQUENCES, tmp_path / "logprobs.safetensors")
    assert all(torch.isfinite(row).any(dim=-1).all() for row in rows)


@needs_vllm
@pytest.mark.slow
def test_phi3_per_tensor_scales_of_a_projection_fused_on_disk(engine, tmp_path):
    """One per-tensor scale on disk for the fused qkv_proj: vLLM gives each of its three partitions
    a copy; the engine dequantizes each with its own and compares the fused tensor. Loaded directly
    (here the format's forward reaches a GPU-only op: the forward is unsupported, the weights judged)."""
    held_against_truth(engine, checkpoint(tmp_path, "phi3", fmt="ct-fp8-tensor"), tmp_path)


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "expert_names"),
    [
        (
            "mixtral",
            ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"),
        ),
        ("deepseek_v3", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")),
    ],
)
def test_experts_come_back_per_expert_and_part(engine, tmp_path, arch, expert_names):
    """Stacked w13/w2 (and their per-channel scales) cut per expert: gate rows first, then up;
    DeepSeek's aliases (mla_attn, experts.gate) once, its router bias and fused q_a/kv_a split."""
    directory = checkpoint(tmp_path, arch)
    report, held = held_against_truth(engine, directory, tmp_path)
    for expert in range(3):
        for name in expert_names:
            assert f"model.layers.1.{name.format(e=expert)}.weight" in held
    assert not [n for n in held if "w13_" in n or "w2_" in n or "mla_attn" in n or "_shared_experts" in n]
    try:
        rows = engine.logprobs(SEQUENCES, tmp_path / "logprobs.safetensors")
    except EngineError as error:  # e.g. no FP8 MoE backend on a CPU without AMX: vLLM's words
        assert error.unsupported, error
        assert "MoE backend" in str(error), error
        assert any("no kernel to run them here" in w for w in report["warnings"]), report["warnings"]
    else:
        assert all(torch.isfinite(row).any(dim=-1).all() for row in rows)


@needs_vllm
@pytest.mark.slow
def test_moe_scheme_vllm_does_not_implement_is_refused_in_its_words(engine, tmp_path):
    """compressed-tensors FP8 MoE with per-tensor weights and per-token activations: vLLM 0.32
    refuses it with a bare assert while choosing the method; the engine says so in vLLM's words
    (the failed assertion), as a refusal (refused-valid), not as a traceback. A vLLM that loads it must load it exactly."""
    directory = checkpoint(tmp_path, "mixtral", fmt="ct-fp8-tensor")
    try:
        held_against_truth(engine, directory, tmp_path)
    except EngineError as refused:
        assert refused.refuses, refused
        assert "does not implement this scheme: `assert " in str(refused), refused


def stack_experts(tensors: dict[str, torch.Tensor], prefix: str, parts: tuple[str, str, str], experts: int):
    """A checkpoint's per-expert tensors stacked as vLLM's FusedMoE loader holds them."""
    gate, up, down = parts
    stacked = {}
    for suffix in ("weight", "weight_scale", "weight_scale_inv"):
        per = [[tensors.get(f"{prefix}.{e}.{p}.{suffix}") for e in range(experts)] for p in (gate, up, down)]
        if per[0][0] is None:
            continue
        if per[0][0].numel() == 1:  # per-tensor: one scale per expert and shard
            stacked[f"w13_{suffix}"] = torch.stack(
                [torch.cat([g.reshape(1), u.reshape(1)]) for g, u in zip(*per[:2], strict=True)]
            )
            stacked[f"w2_{suffix}"] = torch.stack([d.reshape(()) for d in per[2]])
        else:  # rows (weights, channel scales) or each shard's own block-grid rows, gate first
            stacked[f"w13_{suffix}"] = torch.stack([torch.cat([g, u]) for g, u in zip(*per[:2], strict=True)])
            stacked[f"w2_{suffix}"] = torch.stack(per[2])
    return stacked


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-tensor", "ct-fp8-channel"])
def test_stacked_experts_are_split_back_to_the_truth(tmp_path, fmt):
    """Without vLLM: tensors laid out as vLLM's MoE loader lays them out (w13 = gate then up, block
    scales with each shard's own grid rows, per-tensor scales one per shard) come back per expert."""
    from harness.checkpoints.reader import Checkpoint
    from harness.oracle.reference import format_and_knobs

    directory = tmp_path / fmt
    config = {"hidden_size": 128, "intermediate_size": 160, "num_hidden_layers": 1}
    generate(Recipe(format=fmt, arch="mixtral", seed=3, config=config, layout={"shards": 1}), directory)
    tensors = dict(Checkpoint(directory).tensors())
    prefix = "model.layers.0.block_sparse_moe.experts"
    engine = VllmEngine()
    engine.fmt, engine.knobs = format_and_knobs(directory)
    engine.config = json.loads((directory / "config.json").read_text())
    stacked = stack_experts(tensors, prefix, ("w1", "w3", "w2"), 3)
    held = engine.expert_weights(f"{prefix}.routed_experts", stacked)
    truth = load_file(directory / TRUTH_FILE)
    experts = {name: tensor for name, tensor in truth.items() if ".experts." in name}
    assert sorted(held) == sorted(experts)
    for name, expected in experts.items():
        assert_within_bf16_ulps(name, held[name].float(), expected)


def test_split_parts_refuses_what_does_not_split():
    with pytest.raises(RuntimeError, match="does not split into 2 parts"):
        split_parts("x.w13", {"weight": torch.zeros(4, 8), "weight_scale": torch.zeros(3, 1)}, 2)


def test_fused_on_disk_per_part_scales_come_back_fused(tmp_path):
    """Without vLLM: Phi-3's qkv_proj with vLLM's per-partition copies of the one on-disk scale."""
    from harness.checkpoints.reader import Checkpoint
    from harness.oracle.reference import format_and_knobs

    directory = tmp_path / "phi3"
    generate(Recipe(format="ct-fp8-tensor", arch="phi3", seed=4, config={"num_hidden_layers": 1}), directory)
    tensors = dict(Checkpoint(directory).tensors())
    engine = VllmEngine()
    engine.fmt, engine.knobs = format_and_knobs(directory)
    engine.config = json.loads((directory / "config.json").read_text())
    qkv = "model.layers.0.self_attn.qkv_proj"
    tensors[f"{qkv}.weight_scale"] = tensors[f"{qkv}.weight_scale"].repeat(3)
    engine.snapshot, engine.modules = tensors, {qkv: {"partitions": [128, 64, 64]}}
    held = engine.weights()
    truth = load_file(directory / TRUTH_FILE)
    assert_within_bf16_ulps(f"{qkv}.weight", held[f"{qkv}.weight"], truth[f"{qkv}.weight"])
    assert not [name for name in held if ".q_proj." in name]
