"""The small protocol every engine implements, in-process inside a worker subprocess.

An engine loads a checkpoint directory as its users would, then answers: the weights it
really holds (dequantized to float32 where it keeps them packed, read after a forward where
it decompresses lazily), its load report, next-token log-probabilities, greedy generation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class LoadReport:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class EngineUnsupported(Exception):
    """The engine does not implement this format or feature (not a finding, a skip)."""


class EngineRefuses(Exception):
    """The engine refuses this checkpoint on purpose, in its own words (a check its method or a
    layer's shape fails), on any machine: a `refused-valid` finding where the format allows the
    checkpoint, unlike EngineUnsupported (a limit of this machine or of the format's coverage)."""


class Engine:
    """Subclass and implement; register in harness.engines.REGISTRY or pass `module:Class`."""

    name: str = ""
    #: the distribution whose version identifies this engine in findings and known issues
    package: str = ""
    #: settings other than the harness's defaults, from a name `ENGINE[key=value,...]`
    #: (harness.engines.options; set by harness.engines.load_engine); an engine that reads none
    #: is never given any (options.OPTIONS lists who takes which)
    options: dict[str, str] = {}

    def version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(self.package) if self.package else "n/a"
        except PackageNotFoundError:
            return "not installed"

    def unsupported_reason(self, format_name: str) -> str | None:
        """Why this engine cannot load `format_name` here, or None when it can."""
        return None

    def load(self, directory: str) -> LoadReport:
        raise NotImplementedError

    def weights(self) -> dict[str, torch.Tensor]:
        """Every Linear weight and bias, norm and embedding, under HF module names, float32."""
        raise NotImplementedError

    def logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, float32 [len-1, vocab]: log-softmax of the prediction for tokens 1..len-1."""
        raise NotImplementedError

    def activation_logprobs(self, sequences: list[list[int]], variant: str = "float64") -> list[torch.Tensor]:
        """`logprobs` with every quantized Linear's input quantized as the checkpoint specifies:
        only an engine that can be an oracle for that (the reference) implements it."""
        raise EngineUnsupported(f"{self.name} computes no activation-quantized candidate")

    def probe_linears(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each named quantized Linear (model names) run by itself on its input rows, as the engine's
        forward runs it (activation quantization included): name -> output. A name the engine holds
        no such module for is left out (harness.differential.probe)."""
        raise EngineUnsupported(f"{self.name} cannot run one quantized Linear by itself")

    def probe_reference(self, rows: int) -> dict[str, torch.Tensor]:
        """The activation probe's inputs, and those inputs quantized as specified (the reference only)."""
        raise EngineUnsupported(f"{self.name} computes no activation probe")

    def basis_reference(self) -> dict[str, torch.Tensor]:
        """The effective-weight probe's basis inputs for every Linear (the reference only)."""
        raise EngineUnsupported(f"{self.name} computes no basis inputs")

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        raise NotImplementedError

    def kv_cache_scales(self) -> dict[str, tuple[float, float]]:
        """Attention module (HF name) -> (k_scale, v_scale) the engine quantizes its KV cache with,
        as it holds them; empty when its cache is not quantized (harness.differential.kv_scales)."""
        raise EngineUnsupported(f"{self.name} does not tell which scales its KV cache uses")

    def unload(self) -> None:
        """Free the loaded model so the next load starts clean."""

    # Load paths that must agree with `load` exactly (harness.differential.relations); an engine
    # that has no such path says so (EngineUnsupported), and the relation is "not checked".

    def load_variant(self, directory: str, variant: str) -> LoadReport:
        """Load `directory` by another path that must hold what `load` holds: `sentinel` (every
        parameter materialized NaN-filled before loading), `dequantize` (the quantizer's
        dequantize-at-load option)."""
        raise EngineUnsupported(f"{self.name} has no '{variant}' load path")

    def save(self, directory: str) -> None:
        """Save the loaded model as its users would (save_pretrained), for a reload by `load`."""
        raise EngineUnsupported(f"{self.name} does not save a loaded model")
