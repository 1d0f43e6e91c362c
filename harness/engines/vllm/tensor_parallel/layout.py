"""Which rows or columns of each checkpoint module a tensor-parallel rank must own.

Imports no torch and no vLLM: the worker (inside vLLM's interpreter) and the judge (in the
harness) read the same table, so the fused layers built and the slices expected are one fact.
"""

from __future__ import annotations

from dataclasses import dataclass

#: architectures whose decoder layer this lane knows: vLLM's Llama and Qwen2, and its Mixtral,
#: Qwen2-MoE, Qwen3-MoE, Llama-4 (text), DeepSeek-V3 and gpt-oss, whose routed experts live in one
#: FusedMoE (w13: gate and up, w2: down)
DENSE = ("LlamaForCausalLM", "Qwen2ForCausalLM")
#: MoE architecture -> (where its experts live, checkpoint names of gate, up, down, the config
#: fields holding the number of experts and an expert's width)
MOE = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts", "intermediate_size"),
    "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size"),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size"),
    "Llama4ForCausalLM": (
        "feed_forward",
        ("gate_proj", "up_proj", "down_proj"),
        "num_local_experts",
        "intermediate_size",
    ),
    "DeepseekV3ForCausalLM": (
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        "n_routed_experts",
        "moe_intermediate_size",
    ),
    # gate and up interleaved in one gate_up_proj per expert (INTERLEAVED)
    "GptOssForCausalLM": (
        "mlp",
        ("gate_up_proj", "gate_up_proj", "down_proj"),
        "num_local_experts",
        "intermediate_size",
    ),
}
#: experts stored packed with gate and up rows interleaved in one `gate_up_proj` (gpt-oss): its
#: model's own `load_weights` splits them by rank, in whole MXFP4 groups (`grouped_split`)
INTERLEAVED = ("GptOssForCausalLM",)
#: columns per MXFP4 group: the unit gpt-oss's loader splits an expert's width in
OCP_MX_BLOCK = 32
#: MoE architecture -> (its shared expert's module, the config field of its width)
SHARED = {
    "Qwen2MoeForCausalLM": ("mlp.shared_expert", "shared_expert_intermediate_size"),
    "Llama4ForCausalLM": ("feed_forward.shared_expert", "intermediate_size"),
    "DeepseekV3ForCausalLM": ("mlp.shared_experts", "moe_intermediate_size"),  # x n_shared_experts
}
#: MoE architecture -> the config field counting its shared experts (one MLP n times as wide)
SHARED_COUNT = {"DeepseekV3ForCausalLM": "n_shared_experts"}
#: multi-head latent attention (vLLM's DeepseekV2/V3): q_a and kv_a fused and replicated, q_b and
#: kv_b column-parallel, o row-parallel
MLA = ("DeepseekV3ForCausalLM",)
ARCHITECTURES = DENSE + tuple(MOE)
#: qkv biased whatever the config says (vLLM's Qwen2 and Qwen2-MoE)
QKV_BIASED = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
#: q/k/v and o biased whatever the config says (vLLM's gpt-oss attention)
ATTENTION_BIASED = ("GptOssForCausalLM",)
#: attention with a per-head sink logit (`self_attn.sinks`), narrowed by heads by its model's loader
SINKS = ("GptOssForCausalLM",)
#: vLLM's model permutes each head's q/k rows (and a scale of more than one element) for its rotary
#: embedding before any loader (Llama4ForCausalLM.permute_qk_weight_for_rotary): held rows are
#: compared after `unpermute_rotary_rows`
ROTARY_PERMUTED = ("Llama4ForCausalLM",)
#: how a size splits a layer: tensor parallelism (every Linear and routed expert sliced), or expert
#: parallelism (vLLM's enable_expert_parallel: each routed expert held whole by one rank of the
#: group, attention and shared experts still tensor-parallel)
TP, EP = "tp", "ep"


@dataclass(frozen=True)
class Part:
    """One checkpoint module inside a vLLM layer: `q_proj` is shard "q" of `qkv_proj`."""

    name: str
    shard_id: str | int | None
    rows: int  # output features of the whole checkpoint module


@dataclass(frozen=True)
class Attention:
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class FusedLinear:
    """One vLLM parallel Linear of a decoder layer and the checkpoint modules it is loaded from.

    kind: `qkv` (QKVParallelLinear), `merged` (MergedColumnParallelLinear), `column`
    (ColumnParallelLinear), `row` (RowParallelLinear), `replicated` (every rank holds the whole:
    ReplicatedLinear, or a MergedColumnParallelLinear with disable_tp for several parts), `vocab`
    (VocabParallelEmbedding / ParallelLMHead: `name` is the checkpoint module, rows the vocabulary),
    a gpt-oss routed expert's `interleaved` w13 (one checkpoint gate_up_proj, gate and up rows
    alternating) and `grouped` w2, both split by rank in whole MXFP4 groups (`grouped_split`), or
    its attention's `heads`: the sinks, one value per head (a tensor, not a module's weight)."""

    name: str
    parent: str
    kind: str
    parts: tuple[Part, ...]
    input_size: int
    bias: bool
    attention: Attention | None = None  # heads, kv heads, head_dim: qkv only
    expert: int | None = None  # a routed expert's w13 or w2, held as its slice of the FusedMoE

    def module(self, layer: int) -> str:
        if self.kind == "vocab":  # outside the decoder layers
            return self.name
        return f"model.layers.{layer}.{self.parent}.{self.name}"

    def part_module(self, layer: int, part: Part) -> str:
        if self.kind == "vocab":
            return part.name
        return f"model.layers.{layer}.{self.parent}.{part.name}"

    def reference_name(self, layer: int, part: Part) -> str:
        """The part's values in the reference: its module's `.weight`; the sinks are a tensor."""
        return self.part_module(layer, part) + ("" if self.kind == "heads" else ".weight")


def part_piece(tensor, index: int, parts: int, start: int, rows: int):
    """Part `index` (of `parts`, its rows start:start+rows) of a tensor vLLM holds for a fused layer:
    a per-part scale's own element (1-D, one per part), a layer-wide scalar whole (a static input
    scale vLLM keeps one of: 0-D, or [1] as Quark int8's), else the part's rows."""
    if tensor.dim() == 1 and tensor.numel() == parts:
        return tensor[index : index + 1]
    if tensor.numel() == 1:
        return tensor
    return tensor[start : start + rows]


def unpermute_rotary_rows(tensor, heads: int):
    """Rows vLLM permuted for its rotary embedding (each head's (d/2, 2) rows as (2, d/2)) back in
    checkpoint order; a torch tensor whose first dimension is `heads` whole heads."""
    rows = tensor.shape[0]
    inner = tuple(tensor.shape[1:])
    return tensor.reshape(heads, 2, rows // heads // 2, *inner).transpose(1, 2).reshape(rows, *inner)


def attention_of(config: dict) -> Attention:
    heads = config["num_attention_heads"]
    return Attention(
        heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads
    )


def sparse(config: dict, layer: int) -> bool:
    """Every layer of Mixtral and the Qwen MoE models; Llama-4's every interleave_moe_layer_step-th
    (layers step-1, 2*step-1, ...), the others dense with intermediate_size_mlp; DeepSeek-V3's from
    first_k_dense_replace on, every moe_layer_freq-th."""
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in MOE:
        return False
    if architecture == "Llama4ForCausalLM":
        return (layer + 1) % int(config.get("interleave_moe_layer_step") or 1) == 0
    if architecture == "DeepseekV3ForCausalLM":
        dense = int(config.get("first_k_dense_replace") or 0)
        return layer >= dense and layer % int(config.get("moe_layer_freq") or 1) == 0
    return True


def first_sparse_layer(config: dict) -> int | None:
    """The first decoder layer with routed experts, or None."""
    return next((layer for layer in range(int(config.get("num_hidden_layers") or 0)) if sparse(config, layer)), None)


def mla_linears(config: dict) -> tuple[FusedLinear, ...]:
    """DeepSeek-V3's attention as vLLM builds it (with q_lora_rank; without it, kv_a alone
    replicated and q column-parallel)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rope, nope, value = config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"]
    kv_lora, q_lora = config["kv_lora_rank"], config.get("q_lora_rank")
    kv_a = Part("kv_a_proj_with_mqa", 1 if q_lora else None, kv_lora + rope)
    if q_lora:
        a_proj = FusedLinear(
            "fused_qkv_a_proj", "self_attn", "replicated", (Part("q_a_proj", 0, q_lora), kv_a), hidden, False
        )
        q_proj = FusedLinear(
            "q_b_proj", "self_attn", "column", (Part("q_b_proj", None, heads * (nope + rope)),), q_lora, False
        )
    else:
        a_proj = FusedLinear("kv_a_proj_with_mqa", "self_attn", "replicated", (kv_a,), hidden, False)
        q_proj = FusedLinear(
            "q_proj", "self_attn", "column", (Part("q_proj", None, heads * (nope + rope)),), hidden, False
        )
    return (
        a_proj,
        q_proj,
        FusedLinear(
            "kv_b_proj", "self_attn", "column", (Part("kv_b_proj", None, heads * (nope + value)),), kv_lora, False
        ),
        FusedLinear("o_proj", "self_attn", "row", (Part("o_proj", None, hidden),), heads * value, False),
    )


def decoder_linears(config: dict, layer: int = 0) -> tuple[FusedLinear, ...]:
    """The parallel Linears of decoder layer `layer`, as vLLM's Llama, Qwen2, Mixtral, Qwen2-MoE,
    Qwen3-MoE and Llama-4 build them: attention, then the dense MLP, or a sparse layer's shared
    expert and each routed expert's w13 and w2 (Llama-4's q/k rows are permuted by its model first:
    ROTARY_PERMUTED)."""
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture} (known: {', '.join(ARCHITECTURES)})")
    qwen2 = architecture in QKV_BIASED
    if architecture in MLA:
        attention_linears = mla_linears(config)
        if not sparse(config, layer):
            return attention_linears + dense_mlp("mlp", config["hidden_size"], config["intermediate_size"], False)
        return attention_linears + moe_linears(config, architecture)
    attention = attention_of(config)
    hidden = config["hidden_size"]
    qkv_bias = True if qwen2 or architecture in ATTENTION_BIASED else bool(config.get("attention_bias"))
    mlp_bias = False if qwen2 or architecture in MOE else bool(config.get("mlp_bias"))
    q_rows, kv_rows = attention.heads * attention.head_dim, attention.kv_heads * attention.head_dim
    attention_linears = (
        FusedLinear(
            "qkv_proj",
            "self_attn",
            "qkv",
            (Part("q_proj", "q", q_rows), Part("k_proj", "k", kv_rows), Part("v_proj", "v", kv_rows)),
            hidden,
            qkv_bias,
            attention,
        ),
        FusedLinear(
            "o_proj",
            "self_attn",
            "row",
            (Part("o_proj", None, hidden),),
            q_rows,
            architecture in ATTENTION_BIASED or (qkv_bias and not qwen2),
        ),
    )
    if architecture in SINKS:  # one learned logit per head, split by heads like q
        attention_linears += (
            FusedLinear("sinks", "self_attn", "heads", (Part("sinks", None, attention.heads),), 0, False, attention),
        )
    if architecture == "Llama4ForCausalLM" and not sparse(config, layer):
        return attention_linears + dense_mlp("feed_forward", hidden, config["intermediate_size_mlp"], False)
    if architecture not in MOE:
        return attention_linears + dense_mlp("mlp", hidden, config["intermediate_size"], mlp_bias)
    return attention_linears + moe_linears(config, architecture)


#: vLLM pads the vocabulary to a multiple of this before splitting it over ranks
#: (vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE)
VOCAB_PADDING = 64


def vocab_linears(config: dict) -> tuple[FusedLinear, ...]:
    """The embedding and, unless tied to it, the head: split by vocabulary rows over the ranks."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    names = ("model.embed_tokens",) + (() if config.get("tie_word_embeddings") else ("lm_head",))
    return tuple(FusedLinear(name, "", "vocab", (Part(name, None, vocab),), hidden, False) for name in names)


def lane_linears(config: dict, layer: int) -> tuple[FusedLinear, ...]:
    """What the lane shards for decoder layer `layer`: its Linears, and with layer 0 the
    vocabulary-parallel embedding and head."""
    return decoder_linears(config, layer) + (vocab_linears(config) if layer == 0 else ())


#: a config key the lane sets (lane_config) where the checkpoint names an expert's projections
#: otherwise than MOE says (llm-compressor writes Mixtral's as gate_proj/up_proj/down_proj; vLLM's
#: Mixtral maps them to w1/w3/w2 before its loaders)
EXPERT_NAMES = "_lane_expert_names"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def lane_config(config: dict, names) -> dict:
    """`config` as the lane reads it: a field transformers saves under its alias read under its
    own name (Qwen3-MoE's `num_local_experts` for `num_experts`, saved_config.ATTRIBUTE_MAPS), and
    EXPERT_NAMES set where the checkpoint's tensor `names` store routed experts' projections under
    PROJECTIONS instead of the architecture's own names."""
    from harness.checkpoints.saved_config import ATTRIBUTE_MAPS

    aliases = ATTRIBUTE_MAPS.get(str(config.get("model_type")), {})
    config = {
        **config,
        **{own: config[saved] for saved, own in aliases.items() if own not in config and saved in config},
    }
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in MOE or MOE[architecture][1] == PROJECTIONS:
        return config
    own = f".experts.0.{MOE[architecture][1][0]}."
    other = f".experts.0.{PROJECTIONS[0]}."
    if any(other in name for name in names) and not any(own in name for name in names):
        return {**config, EXPERT_NAMES: list(PROJECTIONS)}
    return config


def moe_linears(config: dict, architecture: str) -> tuple[FusedLinear, ...]:
    """A sparse layer's shared expert (a dense MLP) and each routed expert's w13 and w2."""
    hidden = config["hidden_size"]
    block, (gate, up, down), count_key, width_key = MOE[architecture]
    gate, up, down = config.get(EXPERT_NAMES) or (gate, up, down)
    shared_module, shared_key = SHARED.get(architecture, ("", ""))
    shared = config.get(shared_key) if shared_module else 0
    if shared and architecture in SHARED_COUNT:
        shared *= int(config.get(SHARED_COUNT[architecture]) or 0)
    linears = dense_mlp(shared_module, hidden, shared, False) if shared else ()
    width = config[width_key]
    if architecture in INTERLEAVED:  # one biased gate_up_proj, gate and up rows alternating
        w13_parts, kinds, bias, down_shard = (
            (("gate_up_proj", None, 2 * width),),
            ("interleaved", "grouped"),
            True,
            None,
        )
    else:
        w13_parts, kinds, bias, down_shard = ((gate, "w1", width), (up, "w3", width)), ("merged", "row"), False, "w2"
    for expert in range(config[count_key]):
        name = f"experts.{expert}"
        linears += (
            FusedLinear(
                f"{name}.w13",
                block,
                kinds[0],
                tuple(Part(f"{name}.{part}", shard, rows) for part, shard, rows in w13_parts),
                hidden,
                bias,
                expert=expert,
            ),
            FusedLinear(
                f"{name}.w2", block, kinds[1], (Part(f"{name}.{down}", down_shard, hidden),), width, bias, expert=expert
            ),
        )
    return linears


def grouped_split(width: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, stop) of an expert's width that rank `rank` of `tp` owns in gpt-oss's split: whole
    MXFP4 groups, ceil(groups / tp) of them per rank, the last ranks shorter or empty (vLLM's
    `GptOssModel._load_weights_mxfp4`); the rank's parameters are padded past its share."""
    per_rank = -(-(width // OCP_MX_BLOCK) // tp) * OCP_MX_BLOCK
    start = min(rank * per_rank, width)
    return start, min(start + per_rank, width)


def dense_mlp(parent: str, hidden: int, intermediate: int, bias: bool) -> tuple[FusedLinear, ...]:
    """gate/up as one MergedColumnParallelLinear, down as a RowParallelLinear."""
    return (
        FusedLinear(
            "gate_up_proj",
            parent,
            "merged",
            (Part("gate_proj", 0, intermediate), Part("up_proj", 1, intermediate)),
            hidden,
            bias,
        ),
        FusedLinear("down_proj", parent, "row", (Part("down_proj", None, hidden),), intermediate, bias),
    )


@dataclass(frozen=True)
class Slice:
    """`axis` 0 (rows: column-parallel) or 1 (columns: row-parallel), [start, stop) of the
    checkpoint module's weight; `replica` says which kv-head copy a rank holds."""

    axis: int
    start: int
    stop: int
    note: str = ""
    #: the rank's parameters may extend past [start, stop): padding, which must hold zeros
    padded: bool = False
    #: a row-parallel bias this rank must hold as zeros (gpt-oss's experts add every rank's w2 bias
    #: before the all-reduce, so only rank 0 holds it)
    bias_zero: bool = False


def held_share(owned: Slice, dims: int, input_size: int, stored_columns: int | None) -> tuple[slice, ...] | None:
    """Where a padded rank holds its share in a held tensor of `dims` dimensions: the first rows
    (axis 0), or the first stored columns (axis 1: `input_size / stored_columns` weight columns per
    stored one, e.g. 2 for packed E2M1 codes, 32 for MXFP4 scales); None for a tensor held whole
    (a row-parallel bias)."""
    length = owned.stop - owned.start
    if owned.axis == 0:
        return (slice(0, length),)
    if dims < 2 or not stored_columns:
        return None
    return (slice(None), slice(0, length // (input_size // stored_columns)))


def owned_slice(linear: FusedLinear, part: Part, tp: int, rank: int, config: dict) -> Slice | None:
    """What rank `rank` of `tp` must hold of `part`; None where no even split exists. A
    vocabulary rank holds padded_vocab / tp rows, of which those below the vocabulary are real."""
    if linear.kind == "vocab":
        padded = -(-part.rows // VOCAB_PADDING) * VOCAB_PADDING
        if padded % tp:
            return None
        per_rank = padded // tp
        start = min(rank * per_rank, part.rows)
        return Slice(0, start, min(start + per_rank, part.rows), f"{per_rank} rows held, the rest padding")
    if linear.kind in ("interleaved", "grouped"):
        start, stop = grouped_split(linear.input_size if linear.kind == "grouped" else part.rows // 2, tp, rank)
        if linear.kind == "grouped":
            return Slice(1, start, stop, padded=True, bias_zero=rank > 0)
        return Slice(0, 2 * start, 2 * stop, "gate and up rows interleaved", padded=True)
    if linear.kind == "row":
        if linear.input_size % tp:
            return None
        width = linear.input_size // tp
        return Slice(1, rank * width, (rank + 1) * width)
    if linear.kind == "replicated":  # every rank holds all of it
        return Slice(0, 0, part.rows, "replicated")
    if linear.kind in ("merged", "column"):
        if part.rows % tp:
            return None
        height = part.rows // tp
        return Slice(0, rank * height, (rank + 1) * height)
    attention = attention_of(config)
    if part.shard_id == "q" or linear.kind == "heads":
        if attention.heads % tp:
            return None
        height = part.rows // tp
        return Slice(0, rank * height, (rank + 1) * height)
    if tp >= attention.kv_heads:  # kv heads replicated: each head on tp/kv ranks
        if tp % attention.kv_heads:
            return None
        head = rank // (tp // attention.kv_heads)
        return Slice(0, head * attention.head_dim, (head + 1) * attention.head_dim, f"kv head {head} (replicated)")
    if attention.kv_heads % tp:
        return None
    height = part.rows // tp
    return Slice(0, rank * height, (rank + 1) * height)
