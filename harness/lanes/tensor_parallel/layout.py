"""Which rows or columns of each checkpoint module a tensor-parallel rank must own.

Imports no torch and no vLLM: the worker (inside vLLM's interpreter) and the judge (in the
harness) read the same table, so the fused layers built and the slices expected are one fact.
"""

from __future__ import annotations

from dataclasses import dataclass

#: architectures whose decoder layer this lane knows (vLLM's LlamaForCausalLM / Qwen2ForCausalLM)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


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

    kind: `qkv` (QKVParallelLinear), `merged` (MergedColumnParallelLinear) or `row`
    (RowParallelLinear)."""

    name: str
    parent: str
    kind: str
    parts: tuple[Part, ...]
    input_size: int
    bias: bool
    attention: Attention | None = None  # heads, kv heads, head_dim: qkv only

    def module(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.parent}.{self.name}"

    def part_module(self, layer: int, part: Part) -> str:
        return f"model.layers.{layer}.{self.parent}.{part.name}"


def attention_of(config: dict) -> Attention:
    heads = config["num_attention_heads"]
    return Attention(
        heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads
    )


def decoder_linears(config: dict) -> tuple[FusedLinear, ...]:
    """The four parallel Linears of one decoder layer, as vLLM's Llama and Qwen2 build them."""
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture} (known: {', '.join(ARCHITECTURES)})")
    qwen2 = architecture == "Qwen2ForCausalLM"
    attention = attention_of(config)
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    qkv_bias = True if qwen2 else bool(config.get("attention_bias"))
    mlp_bias = False if qwen2 else bool(config.get("mlp_bias"))
    q_rows, kv_rows = attention.heads * attention.head_dim, attention.kv_heads * attention.head_dim
    return (
        FusedLinear(
            "qkv_proj",
            "self_attn",
            "qkv",
            (Part("q_proj", "q", q_rows), Part("k_proj", "k", kv_rows), Part("v_proj", "v", kv_rows)),
            hidden,
            qkv_bias,
            attention,
        ),
        FusedLinear("o_proj", "self_attn", "row", (Part("o_proj", None, hidden),), q_rows, qkv_bias and not qwen2),
        FusedLinear(
            "gate_up_proj",
            "mlp",
            "merged",
            (Part("gate_proj", 0, intermediate), Part("up_proj", 1, intermediate)),
            hidden,
            mlp_bias,
        ),
        FusedLinear("down_proj", "mlp", "row", (Part("down_proj", None, hidden),), intermediate, mlp_bias),
    )


@dataclass(frozen=True)
class Slice:
    """`axis` 0 (rows: column-parallel) or 1 (columns: row-parallel), [start, stop) of the
    checkpoint module's weight; `replica` says which kv-head copy a rank holds."""

    axis: int
    start: int
    stop: int
    note: str = ""


def owned_slice(linear: FusedLinear, part: Part, tp: int, rank: int, config: dict) -> Slice | None:
    """What rank `rank` of `tp` must hold of `part`; None where no even split exists."""
    if linear.kind == "row":
        if linear.input_size % tp:
            return None
        width = linear.input_size // tp
        return Slice(1, rank * width, (rank + 1) * width)
    if linear.kind == "merged":
        if part.rows % tp:
            return None
        height = part.rows // tp
        return Slice(0, rank * height, (rank + 1) * height)
    attention = attention_of(config)
    if part.shard_id == "q":
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
