"""Golden gates: is the loaded model still the model?

First the weights: where the engine gives them, what it holds is judged against the reference
dequantization of the same checkpoint, as `compare` judges weights (harness.gates.weights); an
engine that cannot give them is reported as not checked, with the reason. Then a measurement:
perplexity on the corpus's held-out slice plus greedy continuations of fixed prompts, compared
with the golden of the same (model, format, engine): perplexity
one-sided (worse by more than the format's relative tolerance fails); text judged under teacher
forcing of the golden's tokens: where the golden's margin over its runner-up is above the kernel
noise measured across machines (`noise_nat`), the golden token must stay the model's top-1
(exact), and at a near-tie below it, among its top-k; formats whose activation quantization
flips near-ties take top-k everywhere. Identical greedy text always passes the text check.
Every metric is reported before the verdict, which names the checks that failed (weights, with
the modules; perplexity; text). Policies are data: cases/gates.toml.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from harness.core.errors import HarnessError
from harness.core.paths import CASES_DIR
from harness.gates.golden import Golden, golden_path, read_golden, read_unsupported, write_golden, write_unsupported

if TYPE_CHECKING:
    from harness.gates.weights import WeightCheck

GATES_FILE = CASES_DIR / "gates.toml"
CONTINUATION_TOKENS = 32
POLICY_FIELDS = {"perplexity_rel", "text", "top_k", "noise_nat", "reason"}


class Scorer(Protocol):
    """What a gate needs from a loaded model: harness.engines.base.Engine has both methods. A
    scorer may also have `weights()` (what it holds, float32 under HF names) and `checkpoint` (the
    directory it loaded): then the gate checks its weights too (harness.gates.weights)."""

    def logprobs(self, sequences: list[list[int]]) -> list: ...

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]: ...


@dataclass(frozen=True)
class GatePolicy:
    perplexity_rel: float
    text: str  # "exact" (above the noise; top-k at near-ties) or "topk" (everywhere)
    top_k: int = 2
    #: margins (nat) below this are near-ties kernel rounding may flip (measured: cases/gates.toml)
    noise_nat: float = 0.0
    reason: str = ""


@dataclass
class Measurement:
    perplexity: float
    continuations: list[list[int]]
    #: per prompt, the rank of each golden token under teacher forcing (0 = the model's top-1)
    golden_ranks: list[list[int]] = field(default_factory=list)
    #: per prompt, each golden (or, measured without one, own) token's logprob minus the best other's
    margins: list[list[float]] = field(default_factory=list)


@dataclass
class GateVerdict:
    ok: bool
    lines: list[str]
    #: why the gate could not be judged here (no golden for a combination that could not run where
    #: the goldens were recorded); neither a pass nor a failure
    skipped: str | None = None
    #: the checks that failed, in the order they ran: "weights", "perplexity", "text"
    failed: list[str] = field(default_factory=list)
    #: the weight check's result, where the gate ran one
    weights: WeightCheck | None = None

    def __str__(self) -> str:
        return "\n".join(self.lines)


def load_policy(fmt: str, engine: str = "", path: Path = GATES_FILE) -> GatePolicy:
    """The gate policy of `fmt` in `engine`: [default], then [format.<fmt>], then [engine.<engine>]."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise HarnessError(f"{path}: cannot read gate policies ({error})") from None
    unknown = set(data) - {"default", "format", "engine"}
    if unknown:
        raise HarnessError(f"{path}: unknown table(s) {sorted(unknown)}")
    values = dict(data.get("default", {}))
    values.update(data.get("format", {}).get(fmt, {}))
    values.update(data.get("engine", {}).get(engine, {}))
    if set(values) - POLICY_FIELDS:
        raise HarnessError(f"{path}: unknown key(s) {sorted(set(values) - POLICY_FIELDS)} for {fmt} in {engine}")
    if values.get("text") not in ("exact", "topk"):
        raise HarnessError(f"{path}: format {fmt}: text must be 'exact' or 'topk'")
    return GatePolicy(
        float(values["perplexity_rel"]),
        values["text"],
        int(values.get("top_k", 2)),
        float(values.get("noise_nat", 0.0)),
        values.get("reason", ""),
    )


def forced_ranks_and_margins(scorer: Scorer, prompts: list[list[int]], continuations: list[list[int]]):
    """Under teacher forcing of each continuation: each token's rank (0 = the model's top-1) and
    its logprob minus the best other token's (negative where another token is preferred)."""
    import torch

    forced = [p + list(c) for p, c in zip(prompts, continuations, strict=False)]
    ranks, margins = [], []
    for prompt, tokens, row in zip(prompts, continuations, scorer.logprobs(forced), strict=False):
        predictions = row[len(prompt) - 1 :].double()
        index = torch.tensor(tokens, dtype=torch.long)[:, None]
        chosen = predictions.gather(1, index)
        ranks.append((predictions > chosen).sum(1).tolist())
        margins.append((chosen[:, 0] - predictions.scatter(1, index, -math.inf).max(1).values).tolist())
    return ranks, margins


def measure(scorer: Scorer, golden: Golden | None = None) -> Measurement:
    """Perplexity on the held-out slice, greedy continuations of the prompts, and the ranks and
    margins of the golden continuations' tokens (of its own continuations, without a golden)."""
    from harness.differential.compare import perplexity
    from harness.lm.corpus import PROMPTS, encode, heldout_sequences

    sequences = heldout_sequences()
    value = perplexity(scorer.logprobs(sequences), sequences)
    prompts = [encode(p) for p in PROMPTS]
    continuations = [list(scorer.generate(p, CONTINUATION_TOKENS)) for p in prompts]
    judged = golden.continuations if golden is not None else continuations
    ranks, margins = forced_ranks_and_margins(scorer, prompts, judged)
    return Measurement(value, continuations, ranks if golden is not None else [], margins)


def text_misses(ranks: list[int], golden_margins: list[float] | None, policy: GatePolicy) -> tuple[list, list]:
    """Positions where the golden token is not the top-1 although its golden margin clears the
    noise (exact positions), and where it falls outside the top-k (every other position)."""
    exact_misses, topk_misses = [], []
    for position, rank in enumerate(ranks):
        margin = golden_margins[position] if golden_margins and position < len(golden_margins) else math.inf
        if policy.text == "exact" and margin >= policy.noise_nat:
            if rank != 0:
                exact_misses.append(position)
        elif rank >= policy.top_k:
            topk_misses.append(position)
    return exact_misses, topk_misses


def judge_against_golden(
    measured: Measurement, golden: Golden, policy: GatePolicy, weights: WeightCheck | None = None
) -> GateVerdict:
    """Every metric first (the weight check's lines, where one ran; perplexity; text), then the
    verdict, naming the checks that failed."""
    lines = list(weights.lines) if weights is not None else []
    failed = ["weights"] if weights is not None and not weights.ok else []
    limit = golden.perplexity * (1 + policy.perplexity_rel)
    ppl_ok = math.isfinite(measured.perplexity) and measured.perplexity <= limit
    if not ppl_ok:
        failed.append("perplexity")
    lines.append(
        f"perplexity {measured.perplexity:.5g} vs golden {golden.perplexity:.5g} "
        f"(limit {limit:.5g}, +{policy.perplexity_rel:.2%}): {'ok' if ppl_ok else 'FAIL'}"
    )
    if len(measured.continuations) != len(golden.continuations):
        lines.append(
            f"golden has {len(golden.continuations)} continuations, measured {len(measured.continuations)}: "
            "FAIL (regenerate the golden)"
        )
        failed.append("text")
    elif not text_ok(measured, golden, policy, lines):
        failed.append("text")
    lines.append(verdict_line(failed, weights))
    return GateVerdict(not failed, lines, failed=failed, weights=weights)


def verdict_line(failed: list[str], weights: WeightCheck | None) -> str:
    """`gate: PASS`, `gate: PASS (weights not checked)`, or `gate: FAIL: ` and the failed checks."""
    if failed:
        named = [weights.verdict() if check == "weights" and weights is not None else check for check in failed]
        return "gate: FAIL: " + ", ".join(named)
    if weights is not None and weights.status == "not checked":
        return "gate: PASS (weights not checked)"
    return "gate: PASS"


def text_ok(measured: Measurement, golden: Golden, policy: GatePolicy, lines: list[str]) -> bool:
    """Each prompt's continuation against the golden's, a line per prompt appended to `lines`."""
    from harness.lm.corpus import decode

    ok = True
    for index, (got, want) in enumerate(zip(measured.continuations, golden.continuations, strict=True)):
        prompt = golden.prompts[index] if index < len(golden.prompts) else f"prompt {index}"
        same = got == want
        ranks = measured.golden_ranks[index] if index < len(measured.golden_ranks) else []
        margins = golden.margins[index] if index < len(golden.margins) else None
        if policy.text == "exact" and margins is None:
            prompt_ok, rule = same, "exact: the golden records no margins"
        else:
            exact_misses, topk_misses = text_misses(ranks, margins, policy)
            near = [] if margins is None else [i for i, m in enumerate(margins) if m < policy.noise_nat]
            rule = (
                f"top-{policy.top_k}"
                if policy.text == "topk"
                else f"top-1 where the golden margin >= {policy.noise_nat} nat, top-{policy.top_k} at "
                f"{len(near)} near-tie(s){' ' + str(near[:5]) if near else ''}"
            )
            if exact_misses:
                rule += f"; not top-1 at {exact_misses[:5]}"
            if topk_misses:
                rule += f"; outside the top-{policy.top_k} at {topk_misses[:5]}"
            prompt_ok = same or (bool(ranks) and not exact_misses and not topk_misses)
        ok &= prompt_ok
        verdict = "ok" if prompt_ok else "FAIL"
        lines.append(f"text {prompt!r}: {'same' if same else 'differs'} ({rule}): {verdict}")
        if not same:
            lines.append(f"    golden:   {decode(want)!r}")
            lines.append(f"    measured: {decode(got)!r}")
    return ok


def gate(
    scorer: Scorer,
    model: str,
    fmt: str,
    engine: str,
    *,
    update: bool = False,
    provenance: dict | None = None,
    root: Path | None = None,
    checkpoint: Path | None = None,
) -> GateVerdict:
    """Check `scorer`'s weights against the reference dequantization of `checkpoint` (default: the
    directory the scorer loaded, `scorer.checkpoint`), measure it and judge both against
    golden/<model>/<fmt>/<engine>.toml.

    A missing golden fails, unless golden/unsupported.toml records that the combination could
    not run where the goldens were made (then the gate is skipped, saying so). With `update`, the
    golden is (re)written from this measurement and the gate still fails once, so a regenerated
    golden is reviewed before it counts.
    """
    from harness.lm.corpus import PROMPTS, decode

    where = {"root": root} if root else {}
    path = golden_path(model, fmt, engine, **where)
    if update:
        measured = measure(scorer)
        golden = Golden(
            model=model,
            format=fmt,
            engine=engine,
            perplexity=round(measured.perplexity, 6),
            continuations=measured.continuations,
            prompts=list(PROMPTS),
            texts=[decode(c) for c in measured.continuations],
            margins=measured.margins,
            **(provenance or {}),
        )
        write_golden(golden, path)
        records = read_unsupported(**where)
        if records.pop((model, fmt, engine), None):  # it runs here now: no longer "could not run"
            write_unsupported(records, **where)
        return GateVerdict(
            False,
            [
                f"perplexity {golden.perplexity:.5g}",
                f"golden written: {path} (review it; the gate fails until the next run)",
            ],
        )
    if not path.is_file():
        record = read_unsupported(**where).get((model, fmt, engine))
        if record:
            why = (
                f"no golden: {engine} could not run {model}/{fmt} where the goldens were recorded "
                f"({record.get('isa') or 'unknown CPU'}, {engine} {record.get('engine_version', '?')}: "
                f"{record['reason'][:300]}); record one on this machine with `python -m harness golden --update "
                f"--models {model} --formats {fmt} --engines {engine}`"
            )
            return GateVerdict(False, [why, "gate: SKIP"], skipped=why)
        return GateVerdict(False, [f"no golden at {path}: FAIL (write it with --update-golden)"])
    golden = read_golden(path)
    if (golden.model, golden.format, golden.engine) != (model, fmt, engine):
        raise HarnessError(f"{path}: holds the golden of {golden.model}/{golden.format}/{golden.engine}")
    from harness.gates.weights import scorer_weights

    # the weights first, right after the load, as `compare` reads them
    weights = scorer_weights(
        scorer, checkpoint if checkpoint is not None else getattr(scorer, "checkpoint", None), engine
    )
    return judge_against_golden(measure(scorer, golden), golden, load_policy(fmt, engine), weights)


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
    """An engine worker (harness.engines.process.EngineProcess) with the checkpoint `checkpoint`
    loaded, as a Scorer whose weights the gate can check."""

    def __init__(self, worker, scratch: Path, checkpoint: Path | None = None):
        self.worker, self.scratch = worker, Path(scratch)
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None

    def weights(self):
        self.scratch.mkdir(parents=True, exist_ok=True)
        return self.worker.weights(self.scratch / "gate-weights.safetensors")

    def logprobs(self, sequences):
        self.scratch.mkdir(parents=True, exist_ok=True)
        return self.worker.logprobs(sequences, self.scratch / "gate-logprobs.safetensors")

    def generate(self, prompt, max_new_tokens):
        return self.worker.generate(prompt, max_new_tokens)


def gate_model(model, name: str, fmt: str, engine: str, **options) -> GateVerdict:
    """Gate a transformers model loaded in this process (e.g. after a fix module repaired it)."""
    return gate(ModelScorer(model), name, fmt, engine, **options)
