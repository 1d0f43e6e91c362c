"""Tiny instances of real Hugging Face decoder architectures: config.json and weight layout.

Sizes are free (`--set hidden_size=200`): `head_dim` is set explicitly so that hidden and
intermediate sizes need not be multiples of anything, which is where block grids break.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str
    class_name: str
    #: config keys this architecture accepts beyond TINY_DEFAULTS, with their defaults
    extra_defaults: Mapping[str, Any]

    def settings(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        values = {**TINY_DEFAULTS, **self.extra_defaults}
        for key, value in overrides.items():
            if key not in values:
                raise KeyError(key)
            values[key] = value
        for key in CONFIG_INTEGERS:
            if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 1:
                raise ValueError(f"{key} must be a positive integer, got {values[key]!r}")
        if values["hidden_size"] % values["num_attention_heads"]:
            # transformers' LlamaConfig validation refuses it, even with an explicit head_dim
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if values["num_attention_heads"] % values["num_key_value_heads"]:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if values["vocab_size"] < BYTE_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {BYTE_VOCAB_SIZE} (the byte-level tokenizer)")
        return values

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
        }
        return config

    def biased_projections(self, settings: Mapping[str, Any]) -> set[str]:
        if self.name == "qwen2":
            return {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
        biased = set()
        if settings.get("attention_bias"):
            biased |= {p for p in PROJECTIONS if p.startswith("self_attn.")}
        if settings.get("mlp_bias"):
            biased |= {p for p in PROJECTIONS if p.startswith("mlp.")}
        return biased

    def projection_shapes(self, settings: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """[out, in] of each Linear in one decoder layer."""
        hidden, inter, head = settings["hidden_size"], settings["intermediate_size"], settings["head_dim"]
        q_out = settings["num_attention_heads"] * head
        kv_out = settings["num_key_value_heads"] * head
        return {
            "self_attn.q_proj": (q_out, hidden),
            "self_attn.k_proj": (kv_out, hidden),
            "self_attn.v_proj": (kv_out, hidden),
            "self_attn.o_proj": (hidden, q_out),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }

    def tensor_layout(self, settings: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every checkpoint tensor of the float model: name -> (shape, role).

        Roles: `linear` (quantizable weight), `bias`, `norm`, `embedding`, `lm_head`.
        """
        hidden, vocab = settings["hidden_size"], settings["vocab_size"]
        layout: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((vocab, hidden), "embedding")}
        biased = self.biased_projections(settings)
        for layer in range(settings["num_hidden_layers"]):
            prefix = f"model.layers.{layer}"
            layout[f"{prefix}.input_layernorm.weight"] = ((hidden,), "norm")
            layout[f"{prefix}.post_attention_layernorm.weight"] = ((hidden,), "norm")
            for projection, shape in self.projection_shapes(settings).items():
                layout[f"{prefix}.{projection}.weight"] = (shape, "linear")
                if projection in biased:
                    layout[f"{prefix}.{projection}.bias"] = ((shape[0],), "bias")
        layout["model.norm.weight"] = ((hidden,), "norm")
        if not settings["tie_word_embeddings"]:
            layout["lm_head.weight"] = ((vocab, hidden), "lm_head")
        return layout


ARCHITECTURES = {
    "llama": Architecture("llama", "llama", "LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    "qwen2": Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", {}),
}
