"""A finding: one way in which one engine disagreed with the truth, with how to reproduce it."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = {
    "load-error": "the engine raised while loading a checkpoint a correct loader loads",
    "refused-valid": "the engine refused, on purpose and in its own words, a checkpoint its format's definition "
    "allows (a check of its method or of a layer's shape), on any machine: not a limit of this machine "
    "(unsupported), not a crash (load-error)",
    "accepted-invalid": "the engine loaded a checkpoint that a correct loader must refuse",
    "dropped-scale": "a *scale* tensor was reported missing or unexpected by the engine",
    "load-report": "the engine reported other missing or unexpected keys",
    "weights-missing": "weights the model holds were not loaded (left as initialised, random): the engine "
    "reported them missing and the checkpoint's tensors for them unexpected",
    "invalid-checkpoint": "the checkpoint itself breaks its format's definition (a NaN or infinite scale, a "
    "scale grid that does not fit): the reference refuses it, and every engine that loads it is judged for that",
    "weight-missing": "the engine holds no weight for a checkpoint tensor",
    "weight-mismatch": "a weight differs from the truth beyond tolerance",
    "weight-nonfinite": "a weight holds NaN or inf where the truth is finite",
    "logprobs": "log-probabilities differ from the reference engine beyond tolerance",
    "topk": "the engine's top-1 token is outside the reference's top-k",
    "perplexity": "perplexity is worse than the reference engine's beyond tolerance",
    "nonfinite-logits": "the engine produced NaN or inf log-probabilities",
    "activations": "the engine's logits are not those of the activation quantization the checkpoint specifies "
    "(the reference computes both candidates: activations as specified, and left unquantized)",
    "post-load": "a Linear applies other weights than its loader placed (its outputs on basis inputs, after the "
    "engine's processing after loading and its kernel: harness.differential.effective_weights)",
    "kv-scales": "the engine's FP8 KV cache uses scales other than the checkpoint's, or is not quantized though "
    "the config declares it (harness.differential.kv_scales)",
    "relation": "two load paths of one engine that must agree exactly do not (load twice, save and reload, "
    "NaN-filled storage, dequantize at load: harness.differential.relations)",
    "engine-crash": "the engine's worker process died",
    "engine-timeout": "the engine's worker gave no answer in time",
    "engine-memory": "the engine's worker went over its memory limit",
    "security": "the engine read outside the checkpoint directory (an escaping index entry, a symlink out) or "
    "accepted a header bomb (`compare --hostile`)",
}


@dataclass
class Finding:
    engine: str
    engine_version: str
    kind: str
    format: str
    message: str
    arch: str | None = None  # the checkpoint's model_type
    dtype: str | None = (
        None  # the model dtype weights and logits are compared in: the checkpoint's, or an engine option's
    )
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
        """What makes two findings 'the same bug' for shrinking and de-duplication: engine,
        kind, format and the cause (see `cause`)."""
        return (self.engine, self.kind, self.format, self.cause())

    def cause(self) -> str:
        """The finding's cause, as far as its data tells it: the known issue it is attributed to;
        for a weight finding, what the generator did to the module (its checkpoint notes, numbers
        dropped); for logit findings, that they are consequences; for a relation, the relation and
        how it fails (harness.differential.relations); otherwise the message with its numbers and
        names of layers dropped ("start (N) + length (N) exceeds dimension size (N)")."""
        if self.known_issue:
            return f"known: {self.known_issue}"
        if self.kind in CONSEQUENCE_KINDS:
            return "consequence"
        if self.kind == "relation" and "failure" in self.metrics:  # how, not which tensor shows it first
            return normalise(f"{self.metrics['relation']}: {self.metrics['failure']}")
        if self.kind in WEIGHT_KINDS:
            notes = self.message.partition(" [checkpoint: ")[2].rstrip("]")
            return normalise(notes) if notes else "unperturbed module"
        return normalise(self.message)


#: kinds that follow from an engine's weight or load findings (logits judged against the reference)
CONSEQUENCE_KINDS = ("logprobs", "topk", "perplexity", "nonfinite-logits")
WEIGHT_KINDS = ("weight-mismatch", "weight-nonfinite", "weight-missing")
_NUMBER = re.compile(r"(?<![A-Za-z_0-9.])[-+]?\d+(\.\d+)?(e[-+]?\d+)?")
_PATH = re.compile(r"(?<![\w.])(/[^\s'\":,()]+)+")  # not a ratio: 1/7
#: a layer's or an expert's index inside a module name (model.layers.3.mlp.experts.12.w1)
_INDEX = re.compile(r"(?<=[A-Za-z_]\.)\d+(?=\.)")


def normalise(message: str, limit: int = 120) -> str:
    """A message without the numbers and paths that differ between two examples of one bug."""
    text = _PATH.sub("PATH", message)
    text = _INDEX.sub("N", text)
    text = _NUMBER.sub("N", text)
    return " ".join(text.split())[:limit]
