"""A finding: one way in which one engine disagreed with the truth, with how to reproduce it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = {
    "load-error": "the engine raised while loading a checkpoint a correct loader loads",
    "accepted-invalid": "the engine loaded a checkpoint that a correct loader must refuse",
    "dropped-scale": "a *scale* tensor was reported missing or unexpected by the engine",
    "load-report": "the engine reported other missing or unexpected keys",
    "weight-missing": "the engine holds no weight for a checkpoint tensor",
    "weight-mismatch": "a weight differs from the truth beyond tolerance",
    "weight-nonfinite": "a weight holds NaN or inf where the truth is finite",
    "logprobs": "log-probabilities differ from the reference engine beyond tolerance",
    "topk": "the engine's top-1 token is outside the reference's top-k",
    "perplexity": "perplexity is worse than the reference engine's beyond tolerance",
    "nonfinite-logits": "the engine produced NaN or inf log-probabilities",
    "engine-crash": "the engine's worker process died",
    "engine-timeout": "the engine's worker gave no answer in time",
    "engine-memory": "the engine's worker went over its memory limit",
}


@dataclass
class Finding:
    engine: str
    engine_version: str
    kind: str
    format: str
    message: str
    arch: str | None = None  # the checkpoint's model_type
    dtype: str | None = None  # the checkpoint's dtype, the one weights are compared in
    module: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint: str = ""
    reproduction: str | None = None
    command: str | None = None
    known_issue: str | None = None
    heatmap: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def signature(self) -> tuple:
        """What makes two findings 'the same bug' for shrinking and de-duplication."""
        return (self.engine, self.kind, self.format)
