"""Comparisons by data kind: weights against the truth (per element and per scale block),
log-probabilities and perplexity against the reference engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harness.core.dtypes import MODEL_DTYPES as DTYPES
from harness.core.tolerances import Tolerances


@dataclass
class WeightDiff:
    name: str
    max_abs: float
    max_rel: float
    bad_elements: int
    nan: int
    inf: int
    #: per scale block: worst |error| / allowed (> 1 means the block differs); 2-D weights only
    block_ratio: list[list[float]] = field(default_factory=list)
    bad_blocks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.bad_elements == 0 and self.nan == 0 and self.inf == 0

    def metrics(self) -> dict:
        return {
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "bad_elements": self.bad_elements,
            "nan": self.nan,
            "inf": self.inf,
            "bad_blocks": [list(b) for b in self.bad_blocks[:32]],
            "bad_block_count": len(self.bad_blocks),
        }


def compare_weight(
    name: str, got: torch.Tensor, truth: torch.Tensor, dtype: str, tol: Tolerances, block: tuple[int, int] | None
) -> WeightDiff:
    """`got` is what the engine holds (any float dtype); `truth` float64, cast once to `dtype`."""
    want = truth.to(DTYPES[dtype]).to(torch.float64)
    got = got.to(torch.float64)
    error = (got - want).abs()
    allowed = tol.weight_abs + tol.weight_rel * want.abs()
    finite = torch.isfinite(got)
    ratio = torch.where(finite, error / allowed.clamp_min(1e-300), torch.full_like(error, math.inf))
    ratio = torch.where((error == 0) & finite, torch.zeros_like(ratio), ratio)
    rel = error / want.abs().clamp_min(torch.finfo(torch.float64).tiny)
    diff = WeightDiff(
        name=name,
        max_abs=float(error[finite].max()) if finite.any() else math.inf,
        max_rel=float(rel[finite].max()) if finite.any() else math.inf,
        bad_elements=int((ratio > 1).sum()),
        nan=int(torch.isnan(got).sum()),
        inf=int(torch.isinf(got).sum()),
    )
    if got.dim() == 2 and block is not None:
        diff.block_ratio = block_maxima(ratio, block).tolist()
        diff.bad_blocks = [tuple(i) for i in (torch.tensor(diff.block_ratio) > 1).nonzero().tolist()]
    return diff


def block_maxima(values: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = values.shape
    bn, bk = min(block[0], rows), min(block[1], cols)
    gn, gk = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=values.dtype)
    padded[:rows, :cols] = values
    return padded.reshape(gn, bn, gk, bk).amax(dim=(1, 3))


@dataclass
class LogprobDiff:
    max_abs_delta: float
    topk_misses: int
    positions: int
    nonfinite: int
    perplexity: float
    reference_perplexity: float


def perplexity(rows: list[torch.Tensor], sequences: list[list[int]]) -> float:
    """exp(mean negative log-likelihood) of each sequence's own next tokens; inf when any is
    non-finite (a NaN perplexity would pass every `>` comparison a gate or a judge makes)."""
    picked = torch.cat(
        [
            row[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].double()
            for row, seq in zip(rows, sequences, strict=True)
        ]
    )
    if not torch.isfinite(picked).all():
        return math.inf
    return float(torch.exp(-picked.mean()))


def compare_logprobs(
    got: list[torch.Tensor], reference: list[torch.Tensor], sequences: list[list[int]], tol: Tolerances
) -> LogprobDiff:
    worst, misses, positions, nonfinite = 0.0, 0, 0, 0
    for g, r in zip(got, reference, strict=True):
        nonfinite += int((~torch.isfinite(g)).sum())
        top = r.topk(tol.top_k, dim=-1).indices
        delta = (g.gather(-1, top) - r.gather(-1, top)).abs()
        worst = max(worst, float(torch.nan_to_num(delta, nan=math.inf).max()))
        misses += int((~(g.argmax(-1, keepdim=True) == top).any(-1)).sum())
        positions += g.shape[0]
    return LogprobDiff(
        worst, misses, positions, nonfinite, perplexity(got, sequences), perplexity(reference, sequences)
    )
