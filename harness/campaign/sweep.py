"""The foundation's main job: every format x architecture at odd sizes, generated, reference-
dequantized from disk, and judged against the ground truth the generator recorded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.checkpoints.architectures import ARCHITECTURES
from harness.checkpoints.manifest import read_manifest, read_truth
from harness.checkpoints.recipe import Recipe, pairing_refusal
from harness.checkpoints.writer import generate
from harness.core.errors import CheckpointError
from harness.formats import FORMAT_NAMES, get_format
from harness.oracle.reference import dequantize_checkpoint

# one block plus a partial block, and two plus a partial: no dimension is a multiple of 128
ODD_SIZES = {"hidden_size": 144, "intermediate_size": 272, "num_hidden_layers": 2}
#: experts packed as blocks of 32 columns hold whole blocks only: the oddest sizes they can (5 and 3 blocks)
ODD_BLOCK_SIZES = {"hidden_size": 160, "intermediate_size": 96, "num_hidden_layers": 2}


@dataclass
class Verdict:
    directory: Path
    expectation: str
    outcome: str  # "exact", "refused", or "MISMATCH: ..."
    max_error: float = 0.0

    @property
    def ok(self) -> bool:
        if self.outcome == "exact":
            return self.expectation in ("exact", "exact-or-refuse")
        if self.outcome.startswith("refused"):
            return self.expectation in ("refuse", "exact-or-refuse")
        return False


def judge_reference(directory: str | Path) -> Verdict:
    """Reference-dequantize a generated checkpoint and compare it with its recorded truth."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    try:
        got = dict(dequantize_checkpoint(directory))
    except CheckpointError as error:
        return Verdict(directory, manifest["expectation"], f"refused: {error.problem}")
    truth = read_truth(directory, manifest)
    if set(got) != set(truth):
        missing, extra = sorted(set(truth) - set(got)), sorted(set(got) - set(truth))
        return Verdict(
            directory, manifest["expectation"], f"MISMATCH: names differ (missing {missing[:3]}, extra {extra[:3]})"
        )
    worst = max(float((got[n] - truth[n]).abs().max()) if got[n].numel() else 0.0 for n in truth)
    exact = all(torch.equal(got[n], truth[n]) for n in truth)
    return Verdict(directory, manifest["expectation"], "exact" if exact else "MISMATCH: values differ", worst)


def sweep(out: Path, seed: int = 0) -> list[tuple[str, str, Verdict]]:
    results = []
    for fmt in FORMAT_NAMES:
        for arch in ARCHITECTURES:
            if pairing_refusal(get_format(fmt), ARCHITECTURES[arch]):
                continue  # gpt-oss ships in its own format only, and that format only for it
            directory = out / f"{fmt}-{arch}"
            sizes = ODD_BLOCK_SIZES if ARCHITECTURES[arch].packs_experts else ODD_SIZES
            generate(Recipe(format=fmt, arch=arch, seed=seed, config=dict(sizes)), directory)
            results.append((fmt, arch, judge_reference(directory)))
    return results
