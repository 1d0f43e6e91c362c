"""The differential loop for one checkpoint: every engine loads it, and each is judged
against the truth (weights) and against the reference engine (log-probabilities)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from harness.checkpoints.architectures import architecture_name
from harness.checkpoints.disagreements import misstates_its_index
from harness.checkpoints.kv_scales import is_kv_scale
from harness.checkpoints.manifest import read_manifest, read_truth
from harness.checkpoints.reader import (
    CONFIG_FILE,
    Checkpoint,
    Hazard,
    contained_file,
    declared_format,
    hostile_layout,
    read_json,
)
from harness.checkpoints.writer import MANIFEST_FILE
from harness.core.errors import CheckpointError, first_line
from harness.core.findings import WEIGHT_KINDS, Finding
from harness.core.naming import canonical_name
from harness.core.tolerances import load_tolerances
from harness.differential.compare import compare_logprobs, compare_weight, perplexity
from harness.differential.effective_weights import judge_effective_weights, reference_basis
from harness.differential.known_issues import KnownIssues
from harness.differential.kv_scales import judge_kv_scales
from harness.differential.misreadings import CheckpointMisreadings
from harness.differential.probe import probe_engine, reference_probe
from harness.differential.relations import Load, check_relations, check_shard_relations
from harness.differential.stand_in import judge_with_stand_in_kernels
from harness.engines import ENGINES, REFERENCE, engine_spec
from harness.engines.environments import engine_python
from harness.engines.process import EngineError, EngineFailure, EngineProcess, Limits
from harness.oracle.kv_cache import stored_kv_scales
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs

PROBE_LENGTH, PROBE_COUNT, GENERATE_TOKENS = 24, 3, 8


def probe_sequences(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Fixed token sequences (ids past the three special tokens) that every engine scores."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (PROBE_LENGTH,), generator=generator).tolist() for _ in range(PROBE_COUNT)]


@dataclass
class EngineOutcome:
    engine: str
    version: str = ""
    status: str = "loaded"  # loaded, refused, unsupported, unavailable, failed
    detail: str = ""
    report: dict = field(default_factory=dict)
    perplexity: float | None = None
    generated: list[int] = field(default_factory=list)
    #: relation name -> "holds", "does not hold" or "not checked: why" (harness.differential.relations)
    relations: dict[str, str] = field(default_factory=dict)
    #: what the activation probe found, or why it did not run (harness.differential.probe)
    activation_probe: str = ""
    #: what the effective-weight probe found, or why it did not run (harness.differential.effective_weights)
    effective_weights: str = ""


@dataclass
class CheckpointResult:
    directory: str
    format: str
    expectation: str
    outcomes: dict[str, EngineOutcome] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    #: for a checkpoint the harness did not write: why the oracle expects a refusal
    expectation_reason: str = ""


class EngineSession:
    """Keeps one worker per engine alive across checkpoints; restarts one after a failure."""

    def __init__(self, engines: list[str], work: Path, limits: Limits | None = None):
        self.engines = engines
        self.work = Path(work)
        self.limits = limits or Limits()
        self.processes: dict[str, EngineProcess] = {}
        self.unavailable: dict[str, str] = {}
        self.versions: dict[str, str] = {}
        #: each worker's greeting: version, interpreter, instruction-set class, threads
        self.infos: dict[str, dict] = {}
        #: every worker started, restarted ones included (their time counts: time_spent)
        self.started: list[tuple[str, EngineProcess]] = []

    def process(self, engine: str) -> EngineProcess | None:
        return self._worker(engine, engine_spec(engine), engine)

    def helper(self, engine: str, spec: str, name: str) -> EngineProcess | None:
        """A worker hosting `spec` (`module:Class`) in `engine`'s interpreter, kept alive like the
        engines' own (the tensor-parallel lane in vLLM's: one vLLM import per session, not per check)."""
        return self._worker(engine, spec, f"{engine}-{name}")

    def _worker(self, engine: str, spec: str, key: str) -> EngineProcess | None:
        if engine in self.unavailable:
            return None
        current = self.processes.get(key)
        if current and current.process and current.process.poll() is None:
            return current
        python, why = engine_python(engine)
        if python is None:
            self.unavailable[engine] = why
            return None
        entry = ENGINES.get(engine)
        overrides = entry.overrides if entry is not None and spec == entry.spec else ()  # not a helper's
        worker = EngineProcess(
            spec, python, self.work / "logs" / f"{key.replace(':', '_')}.log", self.limits, overrides
        )
        self.started.append((key, worker))
        try:
            info = worker.start()
        except EngineFailure as failure:
            if key != engine:  # a helper that cannot start says nothing of the engine
                raise
            self.unavailable[engine] = f"cannot start ({python}): {failure}"
            return None
        if key == engine:
            self.versions[engine] = info.get("version", "?")
            self.infos[engine] = info
        self.processes[key] = worker
        return worker

    def time_spent(self) -> dict[str, dict[str, float]]:
        """Seconds waited on each worker (engine, or engine-helper), per request op."""
        spent: dict[str, dict[str, float]] = {}
        for key, worker in self.started:
            ops = spent.setdefault(key, {})
            for op, seconds in worker.busy.items():
                ops[op] = ops.get(op, 0.0) + seconds
        return spent

    def close(self) -> None:
        for worker in self.processes.values():  # every worker exits at once, then each is waited for
            worker.ask_to_quit()
        for worker in self.processes.values():
            worker.close()
        self.processes.clear()


@dataclass
class Judgement:
    """One checkpoint being judged: what a correct loader must do and hold, and the findings so far."""

    directory: Path
    session: EngineSession
    manifest: dict | None
    fmt: object
    knobs: dict
    config: dict
    dtype: str
    expectation: str
    truth: dict[str, torch.Tensor]
    module_notes: dict[str, list[str]]
    tol: object
    result: CheckpointResult
    sequences: list[list[int]]
    scratch: Path
    #: the known bugs' predicted readings of this checkpoint, compared with each weight finding
    misreadings: CheckpointMisreadings | None = None
    #: `compare --hostile`: what in the layout leads outside the directory (or is a header bomb)
    hazards: list[Hazard] = field(default_factory=list)
    #: the reference's logits with activations quantized as the checkpoint specifies (None: the
    #: format quantizes weights only, or the reference cannot model it here); `specified_reason`:
    #: what the config specifies, in words, or why there is no such candidate
    specified: list[torch.Tensor] | None = None
    specified_reason: str = ""
    #: how far the definition's rounding variants (harness.oracle.specified.VARIANTS: activations
    #: rounded in the model dtype; quantized weights one ulp off) move these logits: this
    #: checkpoint's own sensitivity, a floor under the activation bound
    specified_noise: float = 0.0
    #: the bound an engine's logits must keep from `specified` ([activations] tolerance, at least
    #: twice the noise floor)
    specified_bound: float = 0.0
    #: the relations checked on each engine that loads it (harness.differential.relations)
    relations: tuple[str, ...] = ()
    #: the reference's activation probe inputs (harness.differential.probe), or None
    probe: dict | None = None
    #: the reference's basis inputs for every Linear (harness.differential.effective_weights), or
    #: None and why
    basis: dict | None = None
    basis_reason: str = ""

    @classmethod
    def of(cls, directory: Path, session: EngineSession, hostile: bool = False) -> Judgement:
        manifest = read_manifest(directory) if (directory / MANIFEST_FILE).is_file() else None
        refusal = ""  # why a checkpoint the harness did not write must be refused
        hazards: list[Hazard] = []
        try:
            fmt, knobs = format_and_knobs(directory)
        except CheckpointError as error:
            if not (hostile or misstates_its_index(manifest)):  # its manifest says what a loader must do
                raise
            fmt, knobs = _format_despite(directory, error)
            if hostile:
                refusal, hazards = f"the reference refuses it: {first_line(error)}", hostile_layout(directory)
        config = read_json(contained_file(directory, CONFIG_FILE, CONFIG_FILE, referrer=directory), CONFIG_FILE)
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        if refusal:  # --hostile: the harness refuses it; the engines load it all the same
            expectation, truth = "refuse", read_truth(directory, manifest) if manifest else {}
        elif manifest:
            expectation, truth = manifest["expectation"], read_truth(directory, manifest)
        else:  # a checkpoint the harness did not write: the oracle says what it holds, or that it must be refused
            try:
                # KV-cache scales are no module's weight: they are judged as the cache's scales (kv_scales)
                truth = {n: t for n, t in dequantize_checkpoint(directory) if not is_kv_scale(n)}
                expectation = "exact"
            except CheckpointError as error:
                truth, expectation = {}, "refuse"
                refusal = f"the reference refuses it: {first_line(error)}"
        notes = {canonical_name(m): info.get("notes", []) for m, info in (manifest or {}).get("modules", {}).items()}
        scratch = session.work / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        return cls(
            directory,
            session,
            manifest,
            fmt,
            knobs,
            config,
            dtype,
            expectation,
            {canonical_name(n): t for n, t in truth.items()},
            notes,
            load_tolerances(fmt.name, dtype),
            CheckpointResult(str(directory), fmt.name, expectation, expectation_reason=refusal),
            probe_sequences(int(config.get("vocab_size", 260))),
            scratch,
            CheckpointMisreadings(directory, fmt.name),
            hazards,
        )

    @cached_property
    def stored_kv_scales(self) -> dict[str, tuple[float | None, float | None]]:
        """The checkpoint's KV-cache scales by attention module, read once for every engine judged."""
        return stored_kv_scales(Checkpoint(self.directory))

    def finding(self, engine: str, kind: str, message: str, **extra) -> Finding:
        item = Finding(
            engine=engine,
            engine_version=self.session.versions.get(engine, "?"),
            kind=kind,
            format=self.fmt.name,
            message=message,
            arch=architecture_name(self.config.get("model_type")),
            dtype=self.dtype,
            checkpoint=str(self.directory),
            **extra,
        )
        self.result.findings.append(item)
        return item

    def scratch_file(self, engine: str, what: str) -> Path:
        return self.scratch / f"{engine.replace(':', '_')}-{what}.safetensors"


def _format_despite(directory: Path, refusal: CheckpointError) -> tuple[object, dict]:
    """The format config.json declares when the checkpoint's layout is refused (`compare
    --hostile`, or a checkpoint the harness wrote to disagree with its index); the refusal
    itself when even that cannot be read."""
    try:
        return declared_format(directory)
    except CheckpointError:
        raise refusal from None


def evaluate(
    directory: str | Path,
    session: EngineSession,
    known: KnownIssues | None = None,
    engines: list[str] | None = None,
    hostile: bool = False,
    relations: tuple[str, ...] = (),
) -> CheckpointResult:
    """Load `directory` in each engine (default: all of the session's) and judge each. `hostile`:
    a checkpoint the reference refuses is loaded by the engines all the same, and one that reads
    outside the directory or accepts a header bomb is a `security` finding. `relations`: load
    paths each engine that loads it must agree with, bit for bit (harness.differential.relations)."""
    judgement = Judgement.of(Path(directory).resolve(), session, hostile)
    judgement.relations = tuple(relations)
    if judgement.manifest is None and judgement.expectation == "refuse" and not judgement.hazards:
        # a checkpoint the harness did not write breaks its format (a NaN scale): that is the user's
        # first finding, whichever engines load it (each that does is then `accepted-invalid`)
        judgement.finding(REFERENCE, "invalid-checkpoint", judgement.result.expectation_reason)
    logprobs: dict[str, list[torch.Tensor]] = {}
    for engine in engines or session.engines:
        rows = _load_and_judge(judgement, engine)
        if rows is not None:
            logprobs[engine] = rows
    _judge_logits(judgement, logprobs)
    if judgement.relations:
        check_shard_relations(judgement, engines or session.engines)
    if known is not None:
        known.annotate(judgement.result.findings)
    return judgement.result


def _load_and_judge(judgement: Judgement, engine: str) -> list[torch.Tensor] | None:
    """Load the checkpoint in `engine`'s worker, judge its load report and weights; its logprobs."""
    outcome = judgement.result.outcomes.setdefault(engine, EngineOutcome(engine))
    worker = judgement.session.process(engine)
    if worker is None:
        outcome.status, outcome.detail = "unavailable", judgement.session.unavailable[engine]
        return None
    outcome.version = judgement.session.versions[engine]
    finding = judgement.finding
    try:
        reason = worker.unsupported(judgement.fmt.name)
        if reason:
            outcome.status, outcome.detail = "unsupported", reason
            judge_with_stand_in_kernels(judgement, engine, outcome)
            return None
        try:
            outcome.report = worker.load(judgement.directory)
        except EngineError as error:
            _load_failed(judgement, engine, outcome, error)
            return None
        if judgement.hazards:
            _judge_hostile_load(judgement, engine, worker, outcome.report)
            return None
        if judgement.expectation == "refuse":
            reasons = _module_notes(judgement.manifest) + (judgement.manifest or {}).get("notes", [])
            reasons = reasons or [judgement.result.expectation_reason]
            finding(engine, "accepted-invalid", "loaded a checkpoint that must be refused: " + "; ".join(reasons))
            return None
        unused = {canonical_name(n) for n in (judgement.manifest or {}).get("unused_tensors", [])}
        anomalies = _judge_report(engine, outcome.report, finding, unused)
        held = worker.weights(judgement.scratch_file(engine, "weights"))
        # a module whose tensors the load report names as missing is that finding's consequence
        missing = {canonical_name(k).rpartition(".")[0] for k in outcome.report.get("missing", [])}
        judged = {n: t for n, t in judgement.truth.items() if n.rpartition(".")[0] not in missing}
        judge_held_weights(judgement, engine, held, judged)
        explained = _logits_explained(judgement, engine, worker, anomalies)
        if explained:
            outcome.detail = f"logits not judged: {explained}"
        rows = _logprobs(judgement, engine, worker, Load(outcome.report, held, forward=False))
        if engine == REFERENCE:
            _activation_candidate(judgement, worker)
            reference_probe(judgement, worker, outcome)
            reference_basis(judgement, worker)
        else:
            judge_effective_weights(judgement, engine, worker, outcome, held)
            if judgement.probe is not None:
                probe_engine(judgement, engine, worker, outcome, held)
        outcome.generated = worker.generate(judgement.sequences[0][:8], GENERATE_TOKENS)
        if judgement.relations:  # last: the worker then holds the relations' loads, not this one
            check_relations(judgement, engine, worker, Load(outcome.report, held, rows))
        return rows
    except EngineFailure as failure:
        outcome.status, outcome.detail = "failed", str(failure)
        finding(engine, f"engine-{failure.kind}", str(failure), metrics={"log_tail": failure.log_tail})
    except EngineError as error:
        if error.unsupported:  # e.g. no kernel for this head size: not the checkpoint's fault
            outcome.detail = f"partly unsupported: {first_line(error)}"
            return None
        outcome.status, outcome.detail = "failed", first_line(error)
        finding(
            engine,
            "load-error",
            f"after loading: {first_line(error)}",
            metrics={"traceback_tail": error.traceback[-1500:]},
        )
    return None


def _load_failed(judgement: Judgement, engine: str, outcome: EngineOutcome, error: EngineError) -> None:
    """The engine did not load the checkpoint: refused on purpose (`refused-valid` where the
    checkpoint is valid), unsupported here (its loaders still judged with stand-in kernels where
    it has them), or failed (a `load-error` unless the checkpoint may be refused)."""
    may_refuse = judgement.expectation in ("refuse", "exact-or-refuse")
    if error.refuses:  # on purpose, in its own words
        outcome.status, outcome.detail = "refused", first_line(error).removeprefix("EngineRefuses: ")
        if not may_refuse:
            judgement.finding(engine, "refused-valid", outcome.detail)
    elif error.unsupported:  # the engine says it cannot load this layout, with its reason
        outcome.status, outcome.detail = "unsupported", first_line(error)
        judge_with_stand_in_kernels(judgement, engine, outcome)
    elif may_refuse:
        outcome.status, outcome.detail = "refused", first_line(error)
    else:
        outcome.status, outcome.detail = "failed", first_line(error)
        metrics = {"traceback_tail": error.traceback[-1500:]}
        judgement.finding(engine, "load-error", first_line(error), metrics=metrics)


def _logprobs(judgement: Judgement, engine: str, worker: EngineProcess, loaded: Load) -> list[torch.Tensor]:
    """The engine's log-probabilities. Where it has no kernel for the forward here (EngineError,
    unsupported: vLLM's MoE on this CPU), the relations still compare what it `loaded` before the
    error goes on (the engine is then "partly unsupported")."""
    try:
        return worker.logprobs(judgement.sequences, judgement.scratch_file(engine, "logprobs"))
    except EngineError as error:
        if error.unsupported and judgement.relations:
            check_relations(judgement, engine, worker, loaded)
        raise


def _logits_explained(judgement: Judgement, engine: str, worker: EngineProcess, anomalies: bool) -> str:
    """What already explains the engine's logits, if anything: its load report's anomalies, or the
    KV-cache scales it uses (judged here unless the load report spoke)."""
    if anomalies:
        return "the load report already explains them"
    if engine != REFERENCE and judge_kv_scales(judgement, engine, worker):
        return "the KV-cache scales it uses already explain them"
    return ""


def _activation_candidate(judgement: Judgement, worker: EngineProcess) -> None:
    """The reference's second candidate: its forward with activations quantized as specified, and
    its noise floor: how far the specified forward's rounding variants land from it."""
    from harness.oracle.kv_cache import declares_fp8_kv_cache
    from harness.oracle.specified import VARIANTS, describe

    sequences = judgement.sequences
    try:
        forwards = {
            variant: worker.logprobs(sequences, judgement.scratch_file(REFERENCE, f"specified-{variant}"), variant)
            for variant in VARIANTS
        }
    except EngineError as error:
        judgement.specified, judgement.specified_reason = None, first_line(error)
        return
    tol, config = judgement.tol, judgement.config["quantization_config"]
    judgement.specified = forwards.pop("float64")
    floor = max(compare_logprobs(rows, judgement.specified, sequences, tol).max_abs_delta for rows in forwards.values())
    bound = tol.activation_kv_max_abs_delta if declares_fp8_kv_cache(config) else tol.activation_max_abs_delta
    judgement.specified_noise = floor
    judgement.specified_bound = max(bound, 2 * floor)  # a checkpoint whose logits amplify rounding
    judgement.specified_reason = describe(config)


def _judge_hostile_load(judgement: Judgement, engine: str, worker: EngineProcess, report: dict) -> None:
    """An engine loaded a checkpoint whose layout is hostile. Reading outside the directory is a
    `security` finding when the engine holds the checkpoint's own values for tensors that exist only
    there (the truth of a generated checkpoint is the evidence; without one, that it loaded them
    without reporting them missing); accepting a header bomb is one by itself."""
    missing = {canonical_name(k) for k in report.get("missing", [])}
    held = worker.weights(judgement.scratch_file(engine, "weights"))
    for hazard in judgement.hazards:
        if hazard.kind == "header-bomb":
            judgement.finding(engine, "security", f"accepted a header bomb: {hazard.describe()}")
            continue
        placed = {canonical_name(t) for t in hazard.tensors} if hazard.tensors else set(judgement.truth)
        if placed and placed <= missing:
            judgement.finding(
                engine, "accepted-invalid", f"loaded without the tensors of {hazard.describe()} (reported missing)"
            )
            continue
        if judgement.truth:
            equal = sorted(n for n in placed & set(judgement.truth) if _holds_truth(judgement, held, n))
            if not equal:
                judgement.finding(
                    engine,
                    "accepted-invalid",
                    f"loaded a checkpoint that must be refused ({hazard.describe()}), holding other values there",
                )
                continue
            evidence = f"holds the values of {len(equal)} tensor(s) stored only there, e.g. {equal[0]}"
        else:
            equal, evidence = [], "loaded its tensors without reporting them missing (no truth to compare)"
        judgement.finding(
            engine,
            "security",
            f"read outside the checkpoint directory: {hazard.describe()}; {evidence}",
            metrics={"hazard": hazard.kind, "file": hazard.file, "target": hazard.detail, "held": equal[:50]},
        )


def _holds_truth(judgement: Judgement, held: dict[str, torch.Tensor], name: str) -> bool:
    want, got = judgement.truth[name], held.get(name)
    if got is None or tuple(got.shape) != tuple(want.shape):
        return False
    block = judgement.fmt.scale_block(judgement.knobs, tuple(want.shape)) if want.dim() == 2 else None
    return compare_weight(name, got, want, judgement.dtype, judgement.tol, block).ok


def _judge_logits(judgement: Judgement, logprobs: dict[str, list[torch.Tensor]]) -> None:
    """Each engine's perplexity, and its log-probabilities against the reference engine's."""
    result, sequences, tol = judgement.result, judgement.sequences, judgement.tol
    baseline = logprobs.get(REFERENCE)
    if baseline is not None and not all(torch.isfinite(r).all() for r in baseline):
        # the model itself overflows in its dtype (e.g. float16 with x1000 weights): no oracle for logits
        result.outcomes[REFERENCE].detail = "logits not judged: the reference's own are non-finite"
        baseline = None
    for engine, rows in logprobs.items():
        result.outcomes[engine].perplexity = perplexity(rows, sequences)
        if baseline is None or engine == REFERENCE or result.outcomes[engine].detail:
            continue
        diff = compare_logprobs(rows, baseline, sequences, tol)
        metrics = {
            "max_abs_delta": diff.max_abs_delta,
            "topk_misses": diff.topk_misses,
            "positions": diff.positions,
            "perplexity": diff.perplexity,
            "reference_perplexity": diff.reference_perplexity,
        }
        if diff.nonfinite:
            judgement.finding(
                engine, "nonfinite-logits", f"{diff.nonfinite} non-finite log-probabilities", metrics=metrics
            )
            continue
        weights_exact = not any(f.engine == engine and f.kind in WEIGHT_KINDS for f in result.findings)
        by_definition = judgement.specified is not None and weights_exact
        if by_definition:  # with wrong weights, logits are their consequence
            # perplexity below is then judged against the definition's logits; top-1 is not: on the
            # E4M3 grid of quantized activations or a quantized KV cache, near-tied top-1s flip
            # within the measured bound _judge_activations applies (a weight-only ct-int4 phi3 with
            # an FP8 KV cache: transformers, compressed-tensors and vLLM each 1 of 69 positions)
            diff = _judge_activations(judgement, engine, rows, baseline, diff, metrics)
        elif diff.max_abs_delta > tol.logprob_max_abs_delta:
            judgement.finding(
                engine,
                "logprobs",
                f"max |delta logprob| {diff.max_abs_delta:.3g} > {tol.logprob_max_abs_delta}",
                metrics=metrics,
            )
        if not by_definition and diff.topk_misses > tol.max_topk_miss_fraction * diff.positions:
            judgement.finding(
                engine,
                "topk",
                f"top-1 outside reference top-{tol.top_k} at {diff.topk_misses}/{diff.positions} positions",
                metrics=metrics,
            )
        if diff.perplexity > diff.reference_perplexity * (1 + tol.perplexity_rel):
            judgement.finding(
                engine,
                "perplexity",
                f"perplexity {diff.perplexity:.4g} vs reference {diff.reference_perplexity:.4g}",
                metrics=metrics,
            )


def _module_notes(manifest) -> list[str]:
    notes = []
    for module, info in (manifest or {}).get("modules", {}).items():
        notes.extend(f"{module}: {n}" for n in info.get("notes", []) if info.get("expectation") == "refuse")
    return notes


def _judge_report(engine: str, report: dict, finding, unused: set[str] = frozenset()) -> bool:
    """Weights left unloaded, then scale keys missing or unexpected, then any other key, each their
    own kind of finding; True if any anomaly. Tensors the checkpoint holds for no module (`unused`)
    are rightly unexpected."""
    missing = report.get("missing", [])
    orphans = {name.rpartition(".")[0] for name in unused}  # an engine may rename the orphan's suffix
    unexpected = [k for k in report.get("unexpected", []) if canonical_name(k).rpartition(".")[0] not in orphans]
    # a weight the model holds but did not load, its checkpoint tensors unexpected: the engine left
    # it as initialised (random), whatever its scales say; the scales' keys are part of that finding
    unloaded = {_module(k) for k in missing if "scale" not in k} & {_module(k) for k in unexpected}
    if unloaded:  # every weight it left unloaded belongs here (a tied head whose embeddings were dropped too)
        weights = sorted(k for k in missing if _module(k) in unloaded or "scale" not in k)
        keys = [k for k in unexpected if _module(k) in unloaded]
        finding(
            engine,
            "weights-missing",
            f"{len(weights)} weight(s) left as the model initialised them (random), {len(keys)} checkpoint "
            f"tensor(s) for them not loaded: e.g. missing {weights[0]}, unexpected {keys[0]} (held in a "
            "layout or under names the engine did not convert them to)",
            metrics={"missing": weights[:50], "unexpected": keys[:50]},
        )
        missing = [k for k in missing if k not in weights]
        unexpected = [k for k in unexpected if _module(k) not in unloaded]
    scale_missing = [k for k in missing if "scale" in k]
    scale_unexpected = [k for k in unexpected if "scale" in k]
    other_missing = [k for k in missing if "scale" not in k]
    other_unexpected = [k for k in unexpected if "scale" not in k]
    if scale_missing or scale_unexpected:
        finding(
            engine,
            "dropped-scale",
            "scale " + _describe_keys(scale_missing, scale_unexpected),
            metrics={"missing": scale_missing[:50], "unexpected": scale_unexpected[:50]},
        )
    if other_missing or other_unexpected:
        finding(
            engine,
            "load-report",
            _describe_keys(other_missing, other_unexpected),
            metrics={"missing": missing[:50], "unexpected": unexpected[:50]},
        )
    return bool(unloaded or missing or unexpected)


def _module(key: str) -> str:
    return canonical_name(key).rpartition(".")[0]


def _describe_keys(missing: list[str], unexpected: list[str]) -> str:
    examples = ", ".join(
        f"{what} {keys[0]}" for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys
    )
    both = set(missing) & set(unexpected)  # the engine holds them in a layout it did not convert to
    clash = f"; {len(both)} both (held in another layout the checkpoint's tensors were not converted to)"
    return f"{len(missing)} missing, {len(unexpected)} unexpected key(s): e.g. {examples}" + (clash if both else "")


def judge_held_weights(
    judgement: Judgement, engine: str, held: dict[str, torch.Tensor], truth: dict[str, torch.Tensor] | None = None
) -> None:
    """Judge the weights `engine` holds (`held`, canonical names) against the truth (default: all
    of it), adding the findings to the judgement's result; each weight finding carries the
    verdicts of the known bugs' predicted misreadings for its module (metrics["misreadings"])."""
    _judge_weights(
        engine,
        held,
        judgement.truth if truth is None else truth,
        judgement.dtype,
        judgement.tol,
        judgement.fmt,
        judgement.knobs,
        judgement.finding,
        judgement.module_notes,
        judgement.misreadings,
    )


def _judge_weights(engine, held, truth, dtype, tol, fmt, knobs, finding, module_notes, misreadings=None) -> None:
    """Every truth tensor against what the engine holds; a finding names what the generator did
    to that module (its manifest notes), so a reader sees the perturbation behind it."""
    for name, want in sorted(truth.items()):
        if name not in held:
            finding(engine, "weight-missing", f"no weight held for {name}", module=name)
            continue
        got = held[name]
        block = fmt.scale_block(knobs, tuple(want.shape)) if want.dim() == 2 else None
        shape = {"shape": list(want.shape), "block": list(block) if block else None}
        if tuple(got.shape) != tuple(want.shape):
            finding(
                engine,
                "weight-mismatch",
                f"{name}: shape {list(got.shape)} vs truth {list(want.shape)}",
                module=name,
                metrics={**shape, "held_shape": list(got.shape)},
            )
            continue
        diff = compare_weight(name, got, want, dtype, tol, block)
        if diff.ok:
            continue
        kind = "weight-nonfinite" if (diff.nan or diff.inf) else "weight-mismatch"
        message = (
            f"{name}: {diff.bad_elements}/{want.numel()} elements differ, max |err| {diff.max_abs:.3g}, "
            f"max rel {diff.max_rel:.3g}, {len(diff.bad_blocks)} scale block(s) differ"
        )
        notes = module_notes.get(name.removesuffix(".weight"), [])
        if notes:
            message += f" [checkpoint: {'; '.join(notes)}]"
        item = finding(engine, kind, message, module=name, metrics={**diff.metrics(), **shape})
        if misreadings is not None and misreadings.misreadings:
            item.metrics["misreadings"] = misreadings.verdicts(name, got, dtype)
        item.metrics["block_ratio"] = diff.block_ratio


def _judge_activations(judgement: Judgement, engine: str, rows, weights_only, diff, metrics: dict):
    """An activation-quantized checkpoint: the engine's logits against the reference's two
    candidates. Within the measured noise of the specified one: as specified. Otherwise a finding
    that says which candidate the engine computed, when the candidates are far enough apart
    (more than twice the noise) to tell: "not applied" when it is the weight-only one. Returns the
    engine's LogprobDiff against the specified candidate."""
    sequences, tol, bound = judgement.sequences, judgement.tol, judgement.specified_bound
    specified = compare_logprobs(rows, judgement.specified, sequences, tol)
    to_specified = specified.max_abs_delta
    apart = compare_logprobs(judgement.specified, weights_only, sequences, tol).max_abs_delta
    metrics.update(
        to_specified=to_specified, candidates_apart=apart, activation_bound=bound, noise_floor=judgement.specified_noise
    )
    if to_specified <= bound:
        return specified
    scheme = judgement.specified_reason
    if apart > 2 * bound and diff.max_abs_delta <= bound:
        message = (
            f"activation quantization not applied ({scheme}): logits within {diff.max_abs_delta:.3g} of the "
            f"weight-only reference and {to_specified:.3g} from the specified one (bound {bound:.3g}; the two "
            f"candidates are {apart:.3g} apart)"
        )
    else:
        message = (
            f"activations not quantized as specified ({scheme}): logits {to_specified:.3g} from the "
            f"specified candidate (bound {bound:.3g}) and {diff.max_abs_delta:.3g} from the weight-only one"
        )
    judgement.finding(engine, "activations", message, metrics=metrics)
    return specified
