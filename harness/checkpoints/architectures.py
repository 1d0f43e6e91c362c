"""Tiny instances of real Hugging Face decoder architectures: config.json and weight layout.

Sizes are free (`--set hidden_size=200`): `head_dim` is set explicitly so that hidden and
intermediate sizes need not be multiples of anything, which is where block grids break.

Each architecture writes the tensor names its producers write on disk: dense llama/qwen2;
Phi-3 with `qkv_proj` and `gate_up_proj` fused on disk; Mixtral (`block_sparse_moe.experts.E.w1/w2/w3`),
Qwen2-MoE (a shared expert and its gate), Qwen3-MoE (q/k norms), DeepSeek-V3 (MLA attention,
dense first layers, shared experts, `e_score_correction_bias`) and Llama-4 text (`feed_forward`,
sparse every `interleave_moe_layer_step`-th layer, a shared expert, `router`) with one tensor per
expert, as llm-compressor writes them. The
routers are plain Linears that producers leave unquantized (`ignored_modules`). How a transformers
model holds these tensors (experts packed 3-D) is `harness.checkpoints.model_layout`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from harness.checkpoints.tokenizer import BYTE_VOCAB_SIZE

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,  # = heads * head_dim: vLLM's Qwen2 ignores head_dim (cases/known_issues.toml)
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention supports head sizes 32, 64, 80, ... only
    "vocab_size": 260,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

#: config.json fields every engine reads as positive integers (the reader refuses anything else)
CONFIG_INTEGERS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROJECTIONS = ATTENTION + MLP


@dataclass(frozen=True)
class MoE:
    """How an architecture names and sizes its mixture of experts."""

    block: str  # "block_sparse_moe" (Mixtral) or "mlp"
    experts_key: str  # the config field holding the number of routed experts
    intermediate_key: str  # the config field holding an expert's intermediate size
    #: (gate, up, down) names of one expert's projections
    parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    #: the shared expert's module name and how its intermediate size is found
    shared: str = ""
    shared_size_key: str = ""  # a config field, or "" for moe_intermediate_size x n_shared_experts
    shared_gate: bool = False  # Qwen2-MoE's Linear(hidden, 1) that gates the shared expert
    score_bias: bool = False  # DeepSeek-V3's router `e_score_correction_bias` (float32)
    dense_first_key: str = ""  # config field: how many first layers keep a dense MLP
    #: gpt-oss: an expert's gate and up are one `gate_up_proj` (rows interleaved gate, up, gate,
    #: ...), every expert projection biased, the router `router` with a bias; stored packed on
    #: disk, one 3-D tensor per projection (harness.checkpoints.packed_experts)
    fused_gate_up: bool = False
    router: str = "gate"
    #: where a transformers model holds the block (Mixtral's block_sparse_moe lives under `mlp`)
    held_under: str = "mlp"
    #: the model holds packed experts as [E, K, N] (x @ W, Llama-4's torch.bmm), not [E, N, K]
    held_transposed: bool = False
    #: config field: every how-many-th layer is sparse (Llama-4's interleave_moe_layer_step)
    sparse_step_key: str = ""
    #: config field sizing the dense layers' MLP where it differs from intermediate_size
    dense_size_key: str = ""
    #: other (gate, up, down) names real producers write an expert's projections under (llm-compressor
    #: 0.14 writes Mixtral's as gate_proj/up_proj/down_proj); the checkpoint's tensor names tell which
    other_parts: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str
    class_name: str
    #: config keys this architecture accepts beyond TINY_DEFAULTS, with their defaults
    extra_defaults: Mapping[str, Any]
    #: config fields written as they are (not settable: the model class needs them)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    attention: str = "split"  # "split" q/k/v/o, "fused" qkv_proj (Phi-3), "mla" (DeepSeek)
    mlp: str = "split"  # "split" gate/up/down, "fused" gate_up_proj (Phi-3)
    moe: MoE | None = None
    qkv_bias: bool = False  # q/k/v always biased (Qwen2, Qwen2-MoE)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    #: False: producers leave attention unquantized (gpt-oss's release lists it in
    #: `modules_to_not_convert`); its projections are then `plain` Linears
    quantized_attention: bool = True
    sinks: bool = False  # gpt-oss: a learned per-head attention sink logit, `self_attn.sinks`
    #: the formats this architecture is written in (empty: every format); gpt-oss ships in its own
    only_formats: tuple[str, ...] = ()
    #: the dense MLP's module name (Llama-4: `feed_forward`)
    mlp_name: str = "mlp"
    #: config fields the model's release writes that transformers' save_pretrained drops (its config
    #: class does not define them): absent from a config "as transformers saves it"
    release_only: tuple[str, ...] = ()

    def settings(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        values = {**TINY_DEFAULTS, **self.extra_defaults}
        for key, value in overrides.items():
            if key not in values:
                raise KeyError(key)
            values[key] = value
        if self.attention == "mla":  # no grouped-query attention: transformers repeats k/v by this ratio
            values["num_key_value_heads"] = values["num_attention_heads"]
        integers = CONFIG_INTEGERS + tuple(k for k, v in self.extra_defaults.items() if type(v) is int)
        for key in integers:
            if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 0:
                raise ValueError(f"{key} must be a positive integer, got {values[key]!r}")
            if values[key] < 1 and key in CONFIG_INTEGERS + self.positive_keys():
                raise ValueError(f"{key} must be a positive integer, got {values[key]!r}")
        if values["hidden_size"] % values["num_attention_heads"]:
            # transformers' LlamaConfig validation refuses it, even with an explicit head_dim
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if values["num_attention_heads"] % values["num_key_value_heads"]:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if values["vocab_size"] < BYTE_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {BYTE_VOCAB_SIZE} (the byte-level tokenizer)")
        if self.moe and values["num_experts_per_tok"] > values[self.moe.experts_key]:
            raise ValueError("num_experts_per_tok must not exceed the number of experts")
        if "n_group" in values:  # DeepSeek's grouped top-k: topk_group of n_group equal groups
            groups, chosen = values["n_group"], values["topk_group"]
            if groups < 1 or values[self.moe.experts_key] % groups:
                raise ValueError("n_group must be at least 1 and divide the number of routed experts")
            if (
                not 1 <= chosen <= groups
                or values["num_experts_per_tok"] > chosen * values[self.moe.experts_key] // groups
            ):
                raise ValueError(
                    "topk_group must be 1..n_group, its groups holding at least num_experts_per_tok experts"
                )
        return values

    @property
    def packs_experts(self) -> bool:
        """True when the checkpoint stores each projection's experts as one tensor (gpt-oss)."""
        return bool(self.moe and self.moe.fused_gate_up)

    def layout_keys(self) -> tuple[str, ...]:
        """Every config field the tensor layout reads."""
        keys = (*TINY_DEFAULTS, *self.extra_defaults, *self.fixed)
        if self.moe:
            moe = self.moe
            keys += tuple(k for k in (moe.experts_key, moe.intermediate_key, moe.shared_size_key) if k)
            keys += tuple(k for k in (moe.dense_first_key, moe.sparse_step_key, moe.dense_size_key) if k)
            keys += ("n_shared_experts", "num_experts_per_tok")
        return tuple(dict.fromkeys(keys + ("attention_bias", "mlp_bias")))

    def positive_keys(self) -> tuple[str, ...]:
        """Integer fields that must be at least 1 (others, e.g. first_k_dense_replace, may be 0)."""
        if not self.moe:
            return ()
        keys = (self.moe.experts_key, self.moe.intermediate_key, "num_experts_per_tok")
        optional = (self.moe.shared_size_key, self.moe.sparse_step_key, self.moe.dense_size_key)
        return keys + tuple(key for key in optional if key)

    def config_json(self, settings: Mapping[str, Any], dtype: str) -> dict[str, Any]:
        config = {
            "architectures": [self.class_name],
            "model_type": self.model_type,
            **settings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "initializer_range": 0.02,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "use_cache": True,
            "dtype": dtype,
            **self.fixed,
        }
        if self.attention == "mla":
            config["head_dim"] = settings["qk_rope_head_dim"]  # what DeepseekV3Config derives
        if self.sinks:  # gpt-oss alternates sliding-window and full attention, starting sliding
            layers = settings["num_hidden_layers"]
            config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return config

    # -- the tensors -------------------------------------------------------------------------

    def attention_shapes(self, settings: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        hidden, head = settings["hidden_size"], settings["head_dim"]
        heads, kv_heads = settings["num_attention_heads"], settings["num_key_value_heads"]
        if self.attention == "mla":
            qk_head = settings["qk_nope_head_dim"] + settings["qk_rope_head_dim"]
            q_rank, kv_rank = settings["q_lora_rank"], settings["kv_lora_rank"]
            return {
                "self_attn.q_a_proj": (q_rank, hidden),
                "self_attn.q_b_proj": (heads * qk_head, q_rank),
                "self_attn.kv_a_proj_with_mqa": (kv_rank + settings["qk_rope_head_dim"], hidden),
                "self_attn.kv_b_proj": (heads * (settings["qk_nope_head_dim"] + settings["v_head_dim"]), kv_rank),
                "self_attn.o_proj": (hidden, heads * settings["v_head_dim"]),
            }
        if self.attention == "fused":
            return {
                "self_attn.qkv_proj": ((heads + 2 * kv_heads) * head, hidden),
                "self_attn.o_proj": (hidden, heads * head),
            }
        return {
            "self_attn.q_proj": (heads * head, hidden),
            "self_attn.k_proj": (kv_heads * head, hidden),
            "self_attn.v_proj": (kv_heads * head, hidden),
            "self_attn.o_proj": (hidden, heads * head),
        }

    def dense_mlp_shapes(self, settings: Mapping[str, Any], prefix: str | None = None, size: int | None = None):
        if size is None:
            size = settings[self.moe.dense_size_key] if self.moe and self.moe.dense_size_key else None
        hidden, inter = settings["hidden_size"], settings["intermediate_size"] if size is None else size
        prefix = self.mlp_name if prefix is None else prefix
        if self.mlp == "fused":
            return {f"{prefix}.gate_up_proj": (2 * inter, hidden), f"{prefix}.down_proj": (hidden, inter)}
        return {
            f"{prefix}.gate_proj": (inter, hidden),
            f"{prefix}.up_proj": (inter, hidden),
            f"{prefix}.down_proj": (hidden, inter),
        }

    def is_sparse(self, settings: Mapping[str, Any], layer: int) -> bool:
        if not self.moe:
            return False
        if self.moe.sparse_step_key:  # Llama-4: layers step-1, 2*step-1, ... (Llama4TextConfig.moe_layers)
            return (layer + 1) % settings[self.moe.sparse_step_key] == 0
        return layer >= (settings[self.moe.dense_first_key] if self.moe.dense_first_key else 0)

    def mlp_shapes(self, settings: Mapping[str, Any], layer: int) -> dict[str, tuple[int, int]]:
        """[out, in] of each MLP Linear of decoder layer `layer` (experts one by one)."""
        moe = self.moe
        if not self.is_sparse(settings, layer):
            return self.dense_mlp_shapes(settings)
        hidden, inter = settings["hidden_size"], settings[moe.intermediate_key]
        gate, up, down = moe.parts
        shapes = {}
        for expert in range(settings[moe.experts_key]):
            prefix = f"{moe.block}.experts.{expert}"
            if moe.fused_gate_up:
                shapes |= {f"{prefix}.gate_up_proj": (2 * inter, hidden), f"{prefix}.down_proj": (hidden, inter)}
                continue
            shapes |= {
                f"{prefix}.{gate}": (inter, hidden),
                f"{prefix}.{up}": (inter, hidden),
                f"{prefix}.{down}": (hidden, inter),
            }
        size = settings[moe.shared_size_key] if moe.shared_size_key else inter * settings.get("n_shared_experts", 0)
        if moe.shared and size:
            shapes |= self.dense_mlp_shapes(settings, f"{moe.block}.{moe.shared}", size)
        return shapes

    def projection_shapes(self, settings: Mapping[str, Any], layer: int | None = None) -> dict[str, tuple[int, int]]:
        """[out, in] of each quantizable Linear in decoder layer `layer` (the last one by default:
        a sparse layer where the architecture has experts)."""
        layer = settings["num_hidden_layers"] - 1 if layer is None else layer
        return self.attention_shapes(settings) | self.mlp_shapes(settings, layer)

    def biased_projections(self, settings: Mapping[str, Any]) -> set[str]:
        if self.qkv_bias:
            return {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
        biased = set()
        if settings.get("attention_bias"):
            biased |= set(self.attention_shapes(settings))
        if settings.get("mlp_bias"):
            biased |= {p for p in self.dense_mlp_shapes(settings)}
        if self.moe and self.moe.fused_gate_up:  # every expert projection (gpt-oss)
            biased |= {p for p in self.mlp_shapes(settings, settings["num_hidden_layers"] - 1) if ".experts." in p}
        return biased

    def router_shapes(self, settings: Mapping[str, Any], layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """The unquantized routing tensors of a sparse layer: name -> (shape, role)."""
        if not self.is_sparse(settings, layer):
            return {}
        moe, hidden = self.moe, settings["hidden_size"]
        experts = settings[moe.experts_key]
        tensors = {f"{moe.block}.{moe.router}.weight": ((experts, hidden), "router")}
        if moe.fused_gate_up:
            tensors[f"{moe.block}.{moe.router}.bias"] = ((experts,), "bias")
        if moe.score_bias:
            tensors[f"{moe.block}.gate.e_score_correction_bias"] = ((experts,), "router_bias")
        if moe.shared_gate:
            tensors[f"{moe.block}.shared_expert_gate.weight"] = ((1, hidden), "router")
        return tensors

    def norm_shapes(self, settings: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        hidden = settings["hidden_size"]
        norms = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
        if self.qk_norm:
            norms |= {
                "self_attn.q_norm.weight": (settings["head_dim"],),
                "self_attn.k_norm.weight": (settings["head_dim"],),
            }
        if self.attention == "mla":
            norms |= {
                "self_attn.q_a_layernorm.weight": (settings["q_lora_rank"],),
                "self_attn.kv_a_layernorm.weight": (settings["kv_lora_rank"],),
            }
        if self.sinks:  # one logit per head, drawn like a norm's weight (around 1)
            norms["self_attn.sinks"] = (settings["num_attention_heads"],)
        return norms

    def ignored_modules(self, settings: Mapping[str, Any]) -> list[str]:
        """Modules producers leave unquantized, as listed in the ignore list: lm_head and routers."""
        ignored = ["lm_head"]
        for layer in range(settings["num_hidden_layers"]):
            if not self.quantized_attention:
                ignored.append(f"model.layers.{layer}.self_attn")
            for name, (_, role) in self.router_shapes(settings, layer).items():
                if role == "router":
                    ignored.append(f"model.layers.{layer}.{name.removesuffix('.weight')}")
        return ignored

    def modules(self, settings: Mapping[str, Any]) -> set[str]:
        """Every module of the float model with a tensor in its checkpoint (tensor_layout's names)."""
        return {name.rpartition(".")[0] for name in self.tensor_layout(settings)}

    def tensor_layout(self, settings: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every checkpoint tensor of the float model: name -> (shape, role).

        Roles: `linear` (quantizable weight), `bias`, `norm`, `embedding`, `lm_head`, `router`
        (an unquantized routing Linear), `plain` (a Linear its producers leave unquantized) and
        `router_bias` (stored float32, as DeepSeek-V3 does).
        """
        hidden, vocab = settings["hidden_size"], settings["vocab_size"]
        layout: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((vocab, hidden), "embedding")}
        biased = self.biased_projections(settings)
        for layer in range(settings["num_hidden_layers"]):
            prefix = f"model.layers.{layer}"
            for name, shape in self.norm_shapes(settings).items():
                layout[f"{prefix}.{name}"] = (shape, "norm")
            attention = self.attention_shapes(settings)
            for projection, shape in self.projection_shapes(settings, layer).items():
                plain = projection in attention and not self.quantized_attention
                layout[f"{prefix}.{projection}.weight"] = (shape, "plain" if plain else "linear")
                if projection in biased:
                    layout[f"{prefix}.{projection}.bias"] = ((shape[0],), "bias")
            for name, spec in self.router_shapes(settings, layer).items():
                layout[f"{prefix}.{name}"] = spec
        layout["model.norm.weight"] = ((hidden,), "norm")
        if not settings["tie_word_embeddings"]:
            layout["lm_head.weight"] = ((vocab, hidden), "lm_head")
        return layout


_MOE_COMMON = {"num_experts_per_tok": 2, "norm_topk_prob": True, "output_router_logits": False}
#: small odd expert sizes: three experts (an odd count), an intermediate that is not a multiple of 16
_EXPERTS = 3
_EXPERT_SIZE = 96

ARCHITECTURES = {
    "llama": Architecture("llama", "llama", "LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    "qwen2": Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", {}, qkv_bias=True),
    "phi3": Architecture("phi3", "phi3", "Phi3ForCausalLM", {}, attention="fused", mlp="fused"),
    "mixtral": Architecture(
        "mixtral",
        "mixtral",
        "MixtralForCausalLM",
        {"num_local_experts": _EXPERTS, "num_experts_per_tok": 2},
        fixed={"router_aux_loss_coef": 0.02, "output_router_logits": False, "sliding_window": None},
        moe=MoE(
            "block_sparse_moe",
            "num_local_experts",
            "intermediate_size",
            parts=("w1", "w3", "w2"),
            other_parts=(("gate_proj", "up_proj", "down_proj"),),
        ),
    ),
    "qwen2_moe": Architecture(
        "qwen2_moe",
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": _EXPERTS,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": _EXPERT_SIZE,
            "shared_expert_intermediate_size": 112,
        },
        fixed={**_MOE_COMMON, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
        moe=MoE(
            "mlp",
            "num_experts",
            "moe_intermediate_size",
            shared="shared_expert",
            shared_size_key="shared_expert_intermediate_size",
            shared_gate=True,
        ),
        qkv_bias=True,
    ),
    "qwen3_moe": Architecture(
        "qwen3_moe",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {"num_experts": _EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": _EXPERT_SIZE},
        fixed={**_MOE_COMMON, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False},
        moe=MoE("mlp", "num_experts", "moe_intermediate_size"),
        qk_norm=True,
    ),
    "deepseek_v3": Architecture(
        "deepseek_v3",
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        {
            "n_routed_experts": _EXPERTS,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": _EXPERT_SIZE,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_group": 1,  # expert groups of the grouped top-k routing (vLLM's round-robin placement needs > 1)
            "topk_group": 1,
        },
        fixed={
            **_MOE_COMMON,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "rope_interleave": True,
            "attention_bias": False,
        },
        attention="mla",
        release_only=("topk_method", "scoring_func"),
        moe=MoE(
            "mlp",
            "n_routed_experts",
            "moe_intermediate_size",
            shared="shared_experts",
            score_bias=True,
            dense_first_key="first_k_dense_replace",
        ),
    ),
    "gpt_oss": Architecture(
        "gpt_oss",
        "gpt_oss",
        "GptOssForCausalLM",
        {"num_local_experts": _EXPERTS, "num_experts_per_tok": 2, "attention_bias": True, "sliding_window": 128},
        fixed={
            "rope_theta": 150000.0,  # the release's, with its YaRN scaling
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.9,
            "output_router_logits": False,
            "attention_dropout": 0.0,
        },
        moe=MoE("mlp", "num_local_experts", "intermediate_size", fused_gate_up=True, router="router"),
        quantized_attention=False,
        sinks=True,
        only_formats=("mxfp4",),
    ),
    "llama4": Architecture(
        "llama4",
        "llama4_text",
        "Llama4ForCausalLM",
        {
            "num_local_experts": _EXPERTS,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 112,
            "interleave_moe_layer_step": 1,  # Scout's: every layer sparse (Maverick's is 2)
        },
        fixed={
            "use_qk_norm": True,
            "attention_bias": False,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "attention_chunk_size": 8192,
            "attn_temperature_tuning": True,
            "no_rope_layer_interval": 4,
        },
        moe=MoE(
            "feed_forward",
            "num_local_experts",
            "intermediate_size",
            shared="shared_expert",
            shared_size_key="intermediate_size",
            router="router",
            held_under="feed_forward",
            held_transposed=True,
            sparse_step_key="interleave_moe_layer_step",
            dense_size_key="intermediate_size_mlp",
        ),
        mlp_name="feed_forward",
    ),
}


def architecture_name(model_type: str | None) -> str | None:
    """The registered architecture's name for a checkpoint's `model_type` (Llama-4's text model is
    `llama4_text`, registered as `llama4`); the model_type itself for any other."""
    arch = architecture_for(model_type or "")
    return arch.name if arch else model_type


def architecture_for(model_type: str) -> Architecture | None:
    """The registered architecture a checkpoint's `model_type` names (None: not one of ours)."""
    return next((arch for arch in ARCHITECTURES.values() if arch.model_type == model_type), None)
