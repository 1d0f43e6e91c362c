"""The producers' corpus (`cases/producers/`): checkpoints written by real quantization tools, each
with its provenance and the producer's own view of its weights, judged like any foreign checkpoint.

A case is `cases/producers/<producer>/<case>/`: the checkpoint as the producer saved it,
`provenance.json` (producer, versions, recipe, command, sha256 of every file) and, where the tool
exposes it, `producer_truth/weights.safetensors`: each quantized weight as the producer itself
quantize-dequantized it in memory, before saving (a second truth, written by other hands than the
harness's reference). `cases/producers/corpus.toml` says what a correct judgement of each case is
(`expect`, and for a case that is not clean, why) and how close the reference's dequantization of
the saved files must come to the producer's own (`truth`: exact, or a bound with its reason).

The lane that writes the corpus (`tox -e producers`, scripts/producers/) runs each producer in an
environment of its own; this module only reads what they wrote.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.core.errors import HarnessError
from harness.core.machine import isa_class

CORPUS = Path(__file__).resolve().parents[2] / "cases" / "producers"
PROVENANCE = "provenance.json"
PRODUCER_TRUTH = "producer_truth/weights.safetensors"
EXPECTATIONS = "corpus.toml"
#: what a case's judgement must be: clean (audit reports only `audit_checks`, compare every finding
#: known); invalid (the producer wrote a checkpoint its format does not define: the reference refuses
#: it, an `invalid-checkpoint` finding, the producer's misbehaviour named in `reason`); or the scheme
#: is one the harness does not define (`unsupported:`, exit 2 from both)
VERDICTS = ("clean", "invalid", "unsupported")


@dataclass(frozen=True)
class CorpusCase:
    """One producer's checkpoint and what its judgement must be."""

    directory: Path
    provenance: dict
    #: "clean", "invalid" or "unsupported" (VERDICTS)
    expect: str = "clean"
    #: audit checks that must report (and only they): real properties of the producer's output
    audit_checks: tuple[str, ...] = ()
    #: the bound between the producer's own dequantization and the reference's, in units in the last
    #: place of the model dtype (0: bit-exact), and why it is not 0
    truth_ulps: int = 0
    #: engines that must load the case wherever they run (their optional packages installed: a
    #: missing one makes the engine `unsupported`, which this turns into a failure)
    loaded_by: tuple[str, ...] = ()
    #: findings a correct judgement makes that no known issue covers (`engine kind: message`
    #: regexes, each matched by exactly one finding): an engine's misbehaviour seen only on this
    #: producer's output, which the generator cannot write yet (so it has no known-issue reproducer);
    #: with those corpus.toml's `findings_on` records for this machine's instruction-set class only
    #: (harness.core.machine.isa_class, e.g. `amx`: vLLM picks its CPU kernels by it)
    findings: tuple[str, ...] = ()
    reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.directory.parent.name}/{self.directory.name}"


def corpus_cases(root: Path = CORPUS) -> list[CorpusCase]:
    """Every case under `root` (a directory holding provenance.json), with its expectation."""
    expectations = _expectations(root)
    cases = []
    for provenance in sorted(root.glob(f"*/*/{PROVENANCE}")):
        directory = provenance.parent
        name = f"{directory.parent.name}/{directory.name}"
        entry = expectations.pop(name, {})
        expect = entry.get("expect", "clean")
        if expect not in VERDICTS:
            raise HarnessError(f"{root / EXPECTATIONS}: {name}: expect {expect!r}, not one of {VERDICTS}")
        cases.append(
            CorpusCase(
                directory,
                json.loads(provenance.read_text()),
                expect,
                tuple(entry.get("audit_checks", ())),
                int(entry.get("truth_ulps", 0)),
                tuple(entry.get("loaded_by", ())),
                tuple(entry.get("findings", ())) + tuple((entry.get("findings_on") or {}).get(isa_class(), ())),
                entry.get("reason", ""),
            )
        )
    if expectations:
        raise HarnessError(f"{root / EXPECTATIONS}: cases with no checkpoint: {', '.join(sorted(expectations))}")
    return cases


def _expectations(root: Path) -> dict[str, dict]:
    path = root / EXPECTATIONS
    return dict(tomllib.loads(path.read_text()).get("case", {})) if path.is_file() else {}


def file_digests(directory: Path) -> dict[str, str]:
    """sha256 of every file of a case's checkpoint (provenance and the producer's truth aside)."""
    digests = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and relative != PROVENANCE and not relative.startswith("producer_truth/"):
            digests[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


@dataclass
class TruthComparison:
    """The reference's dequantization of the saved files against the producer's own, per weight."""

    compared: int = 0
    #: weight -> (elements that differ, most units in the last place of the model dtype apart)
    differing: dict[str, tuple[int, int]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @property
    def worst_ulps(self) -> int:
        return max((ulps for _, ulps in self.differing.values()), default=0)


def compare_with_producer(case: CorpusCase) -> TruthComparison:
    """Each weight the producer recorded against the reference's dequantization of the saved files,
    rounded once to the dtype the producer computed (and stored) it in."""
    from safetensors.torch import load_file

    from harness.core.naming import canonical_name
    from harness.oracle.reference import dequantize_checkpoint

    truth = {canonical_name(n): t for n, t in load_file(str(case.directory / PRODUCER_TRUTH)).items()}
    result = TruthComparison()
    seen = set()
    for name, weight in dequantize_checkpoint(case.directory):
        name = canonical_name(name)
        if name not in truth:
            continue
        seen.add(name)
        result.compared += 1
        theirs = truth[name]
        mine = weight.to(theirs.dtype)
        if mine.shape != theirs.shape:
            result.differing[name] = (theirs.numel(), -1)
            continue
        differ = (mine != theirs) & ~(mine.isnan() & theirs.isnan())
        if differ.any():
            result.differing[name] = (int(differ.sum()), _ulps_apart(mine, theirs))
    result.missing = sorted(set(truth) - seen)
    return result


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most representable values of their dtype between two same-shaped tensors (sign-magnitude
    bit patterns made monotone, so one ulp apart is 1 across zero too)."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    ordered = [_monotone(t.view(bits).to(torch.int64), 8 * a.element_size()) for t in (a, b)]
    return int((ordered[0] - ordered[1]).abs().max())


def _monotone(bits: torch.Tensor, width: int) -> torch.Tensor:
    sign = 1 << (width - 1)
    magnitude = bits & (sign - 1)
    return torch.where(bits < 0, -magnitude, magnitude)
