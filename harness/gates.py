"""Golden gates: is the loaded model still the model?

A measurement is perplexity on the corpus's held-out slice plus greedy continuations of fixed
prompts. The gate compares it with the golden of the same (model, format, engine): perplexity
one-sided (worse by more than the format's relative tolerance fails), text exact for formats
whose greedy text is stable, and top-k containment (under teacher forcing, every golden token
is among the model's k most likely) where activation quantization makes near-ties flip.
Every metric is reported before the verdict. Policies are data: cases/gates.toml.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harness.errors import HarnessError
from harness.golden import Golden, golden_path, read_golden, write_golden

GATES_FILE = Path(__file__).resolve().parent.parent / "cases" / "gates.toml"
CONTINUATION_TOKENS = 32
POLICY_FIELDS = {"perplexity_rel", "text", "top_k", "reason"}


class Scorer(Protocol):
    """What a gate needs from a loaded model: harness.engines.base.Engine has both methods."""

    def logprobs(self, sequences: list[list[int]]) -> list: ...

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]: ...


@dataclass(frozen=True)
class GatePolicy:
    perplexity_rel: float
    text: str  # "exact" or "topk"
    top_k: int = 1
    reason: str = ""


@dataclass
class Measurement:
    perplexity: float
    continuations: list[list[int]]
    #: per prompt, the rank of each golden token under teacher forcing (0 = the model's top-1)
    golden_ranks: list[list[int]] = field(default_factory=list)


@dataclass
class GateVerdict:
    ok: bool
    lines: list[str]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def load_policy(fmt: str, path: Path = GATES_FILE) -> GatePolicy:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise HarnessError(f"{path}: cannot read gate policies ({error})") from None
    unknown = set(data) - {"default", "format"}
    if unknown:
        raise HarnessError(f"{path}: unknown table(s) {sorted(unknown)}")
    values = dict(data.get("default", {}))
    values.update(data.get("format", {}).get(fmt, {}))
    if set(values) - POLICY_FIELDS:
        raise HarnessError(f"{path}: unknown key(s) {sorted(set(values) - POLICY_FIELDS)} for format {fmt}")
    if values.get("text") not in ("exact", "topk"):
        raise HarnessError(f"{path}: format {fmt}: text must be 'exact' or 'topk'")
    return GatePolicy(float(values["perplexity_rel"]), values["text"], int(values.get("top_k", 1)),
                      values.get("reason", ""))


def perplexity(rows, sequences) -> float:
    """exp(mean negative log-likelihood) of each sequence's tokens 1..n; inf when any is non-finite."""
    import torch

    total, count = 0.0, 0
    for row, sequence in zip(rows, sequences, strict=True):
        targets = torch.tensor(sequence[1:])
        picked = row.float().gather(1, targets[:, None])[:, 0]
        total -= picked.double().sum().item()
        count += len(targets)
    return math.exp(total / count) if math.isfinite(total) else math.inf


def measure(scorer: Scorer, golden: Golden | None = None) -> Measurement:
    """Perplexity on the held-out slice, greedy continuations of the prompts, and (given a golden)
    the ranks of the golden continuations' tokens."""
    import torch

    from harness.lm.corpus import PROMPTS, encode, heldout_sequences

    sequences = heldout_sequences()
    value = perplexity(scorer.logprobs(sequences), sequences)
    prompts = [encode(p) for p in PROMPTS]
    continuations = [list(scorer.generate(p, CONTINUATION_TOKENS)) for p in prompts]
    ranks = []
    if golden is not None:
        forced = [p + list(c) for p, c in zip(prompts, golden.continuations, strict=False)]
        for prompt, tokens, row in zip(prompts, golden.continuations, scorer.logprobs(forced), strict=False):
            predictions = row[len(prompt) - 1:].float()
            chosen = predictions.gather(1, torch.tensor(tokens)[:, None])
            ranks.append((predictions > chosen).sum(1).tolist())
    return Measurement(value, continuations, ranks)


def judge(measured: Measurement, golden: Golden, policy: GatePolicy) -> GateVerdict:
    """Every metric first, then the verdict."""
    from harness.lm.corpus import decode

    lines, ok = [], True
    limit = golden.perplexity * (1 + policy.perplexity_rel)
    ppl_ok = math.isfinite(measured.perplexity) and measured.perplexity <= limit
    ok &= ppl_ok
    lines.append(f"perplexity {measured.perplexity:.5g} vs golden {golden.perplexity:.5g} "
                 f"(limit {limit:.5g}, +{policy.perplexity_rel:.2%}): {'ok' if ppl_ok else 'FAIL'}")
    if len(measured.continuations) != len(golden.continuations):
        lines.append(f"golden has {len(golden.continuations)} continuations, measured {len(measured.continuations)}: "
                     "FAIL (regenerate the golden)")
        return GateVerdict(False, lines)
    for index, (got, want) in enumerate(zip(measured.continuations, golden.continuations, strict=True)):
        prompt = golden.prompts[index] if index < len(golden.prompts) else f"prompt {index}"
        same = got == want
        if policy.text == "exact":
            text_ok = same
            rule = "exact"
        else:
            ranks = measured.golden_ranks[index] if index < len(measured.golden_ranks) else []
            misses = [i for i, rank in enumerate(ranks) if rank >= policy.top_k]
            text_ok = bool(ranks) and not misses
            rule = f"top-{policy.top_k}" + (f", {len(misses)} golden token(s) outside at {misses[:5]}" if misses else "")
        ok &= text_ok
        verdict = "ok" if text_ok else "FAIL"
        lines.append(f"text {prompt!r}: {'same' if same else 'differs'} ({rule}): {verdict}")
        if not same:
            lines.append(f"    golden:   {decode(want)!r}")
            lines.append(f"    measured: {decode(got)!r}")
    lines.append("gate: PASS" if ok else "gate: FAIL")
    return GateVerdict(ok, lines)


def gate(scorer: Scorer, model: str, fmt: str, engine: str, *, update: bool = False,
         provenance: dict | None = None, root: Path | None = None) -> GateVerdict:
    """Measure `scorer` and judge it against golden/<model>/<fmt>/<engine>.toml.

    A missing golden fails. With `update`, the golden is (re)written from this measurement and
    the gate still fails once, so a regenerated golden is reviewed before it counts.
    """
    from harness.lm.corpus import PROMPTS, decode

    path = golden_path(model, fmt, engine, **({"root": root} if root else {}))
    if update:
        measured = measure(scorer)
        golden = Golden(model=model, format=fmt, engine=engine, perplexity=round(measured.perplexity, 6),
                        continuations=measured.continuations, prompts=list(PROMPTS),
                        texts=[decode(c) for c in measured.continuations], **(provenance or {}))
        write_golden(golden, path)
        return GateVerdict(False, [f"perplexity {golden.perplexity:.5g}",
                                   f"golden written: {path} (review it; the gate fails until the next run)"])
    if not path.is_file():
        return GateVerdict(False, [f"no golden at {path}: FAIL (write it with --update-golden)"])
    golden = read_golden(path)
    if (golden.model, golden.format, golden.engine) != (model, fmt, engine):
        raise HarnessError(f"{path}: holds the golden of {golden.model}/{golden.format}/{golden.engine}")
    return judge(measure(scorer, golden), golden, load_policy(fmt))


class ModelScorer:
    """A transformers model loaded in this process, as a Scorer (for fix modules and tests)."""

    def __init__(self, model):
        self.model = model

    def logprobs(self, sequences):
        from harness.engines.hf_common import model_logprobs

        return model_logprobs(self.model, sequences)

    def generate(self, prompt, max_new_tokens):
        from harness.engines.hf_common import model_generate

        return model_generate(self.model, prompt, max_new_tokens)


class WorkerScorer:
    """An engine worker (harness.engines.process.EngineProcess) with a loaded checkpoint, as a Scorer."""

    def __init__(self, worker, scratch: Path):
        self.worker, self.scratch = worker, Path(scratch)

    def logprobs(self, sequences):
        from safetensors.torch import load_file

        self.scratch.mkdir(parents=True, exist_ok=True)
        path = self.scratch / "gate-logprobs.safetensors"
        self.worker.request("logprobs", sequences=sequences, out=str(path))
        rows = load_file(str(path))
        return [rows[f"seq{i}"] for i in range(len(sequences))]

    def generate(self, prompt, max_new_tokens):
        return self.worker.request("generate", prompt=prompt, max_new_tokens=max_new_tokens)["tokens"]


def gate_model(model, name: str, fmt: str, engine: str, **options) -> GateVerdict:
    """Gate a transformers model loaded in this process (e.g. after a fix module repaired it)."""
    return gate(ModelScorer(model), name, fmt, engine, **options)
