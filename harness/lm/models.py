"""The project's tiny trained language models: what each is, and where its committed weights live."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.paths import MODELS_DIR

MODELS_ROOT = MODELS_DIR


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # harness.checkpoints.architectures name
    config: dict = field(default_factory=dict)  # overrides of the architecture's tiny defaults
    #: standard deviation the attention biases start from: large, so that the trained model
    #: relies on them and a stale or clobbered bias changes its output (a zero-initialised bias
    #: stays small and hides corruption)
    bias_init_std: float = 0.0
    steps: int = 400
    seed: int = 0


# 256 / 768 are multiples of 128 and 16: every engine loads every format at these shapes (odd
# shapes are the synthetic generators' job); head_dim 64 is one vLLM's CPU attention supports.
_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 260,
    "max_position_embeddings": 256,
}

MODELS = {
    "tiny-qwen2": ModelSpec("tiny-qwen2", "qwen2", dict(_SHAPE), bias_init_std=1.0),
    "tiny-llama": ModelSpec("tiny-llama", "llama", dict(_SHAPE)),
}
MODEL_NAMES = tuple(MODELS)


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise HarnessError(f"unknown model '{name}' (known: {', '.join(MODELS)})")
    return MODELS[name]


def model_dir(name: str) -> Path:
    """The committed bfloat16 checkpoint of a tiny model."""
    directory = MODELS_ROOT / model_spec(name).name
    if not (directory / "model.safetensors").is_file():
        raise HarnessError(f"{directory}: no model.safetensors (train it: python -m harness.lm.train {name})")
    return directory
