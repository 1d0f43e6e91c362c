"""The differential loop for one checkpoint: every engine loads it, and each is judged
against the truth (weights) and against the reference engine (log-probabilities)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from harness.core.errors import FormatError, HarnessError, first_line
from harness.core.findings import WEIGHT_KINDS
from harness.core.naming import canonical_name
from harness.differential.compare import compare_logprobs, compare_weight, perplexity
from harness.differential.effective_weights import basis_of, judge_effective_weights, reference_basis
from harness.differential.judgement import CheckpointResult, EngineOutcome, Judgement
from harness.differential.known_issues import KnownIssues
from harness.differential.kv_scales import judge_kv_scales
from harness.differential.probe import probe_engine, reference_probe
from harness.differential.relations import Load, check_relations, check_shard_relations
from harness.differential.session import EngineSession
from harness.differential.stand_in import judge_with_stand_in_kernels
from harness.engines import REFERENCE
from harness.engines.process import EngineError, EngineFailure, EngineProcess
from harness.oracle.online import activation_scheme

GENERATE_TOKENS = 8


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
    judgement.engines = list(engines or session.engines)
    if judgement.manifest is None and judgement.expectation == "refuse" and not judgement.hazards:
        # a checkpoint the harness did not write breaks its format (a NaN scale): that is the user's
        # first finding, whichever engines load it (each that does is then `accepted-invalid`)
        judgement.finding(REFERENCE, "invalid-checkpoint", judgement.result.expectation_reason)
    logprobs: dict[str, list[torch.Tensor]] = {}
    for engine in judgement.engines:
        rows = _load_and_judge(judgement, engine)
        if rows is not None:
            logprobs[engine] = rows
    _judge_logits(judgement, logprobs)
    if judgement.relations:
        check_shard_relations(judgement, judgement.engines)
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
        reason = worker.unsupported_schemes(judgement.fmt, judgement.knobs)
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
        # the checkpoint's optional tensors are read only where an engine left some key unread
        redundant = judgement.redundant_tensors if outcome.report.get("unexpected") else set()
        anomalies = _judge_report(engine, outcome.report, finding, unused, redundant)
        held = worker.weights(judgement.scratch_file(engine, "weights"))
        # a module whose tensors the load report names as missing is that finding's consequence
        missing = {canonical_name(k).rpartition(".")[0] for k in outcome.report.get("missing", [])}
        judged = {n: t for n, t in judgement.engine_truth(engine).items() if n.rpartition(".")[0] not in missing}
        judge_held_weights(judgement, engine, held, judged)
        explained = _logits_explained(judgement, engine, worker, anomalies)
        if explained:
            outcome.detail = f"logits not judged: {explained}"
        rows = _logprobs(judgement, engine, worker, Load(outcome.report, held, forward=False))
        if engine == REFERENCE:
            _activation_candidate(judgement, worker)
            reference_probe(judgement, worker, outcome)
            reference_basis(judgement, worker)
        elif judgement.reference_variant(engine):  # the basis of the reference loaded as the option says
            variant = judgement.reference_variant(engine)
            basis = judgement.variant_bases.get(variant, (None, f"the reference has no load with {variant}"))
            judge_effective_weights(judgement, engine, worker, outcome, held, basis)
            outcome.activation_probe = (
                f"not run: the engine is judged against the reference loaded with {variant}; the probe's "
                "inputs and references are the checkpoint's own"
            )
        else:
            judge_effective_weights(judgement, engine, worker, outcome, held)
            if judgement.probe is not None:
                probe_engine(judgement, engine, worker, outcome, held)
        outcome.generated = worker.generate(judgement.sequences[0][:8], GENERATE_TOKENS)
        if judgement.relations:  # last: the worker then holds the relations' loads, not this one
            check_relations(judgement, engine, worker, Load(outcome.report, held, rows))
        if engine == REFERENCE:  # after its relations: this loads the reference again
            _variant_references(judgement, worker)
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
    from harness.oracle.specified import describe

    try:
        judgement.specified, floor = _specified_forwards(judgement, worker, "checkpoint")
    except EngineError as error:
        judgement.specified, judgement.specified_reason = None, first_line(error)
        _option_candidates(judgement, worker)
        return
    tol, config = judgement.tol, judgement.config["quantization_config"]
    bound = tol.activation_kv_max_abs_delta if declares_fp8_kv_cache(config) else tol.activation_max_abs_delta
    judgement.specified_noise = floor
    judgement.specified_bound = max(bound, 2 * floor)  # a checkpoint whose logits amplify rounding
    judgement.specified_reason = describe(config)
    _option_candidates(judgement, worker)


def _option_candidates(judgement: Judgement, worker: EngineProcess, engines: list[str] | None = None) -> None:
    """For each of `engines` (default: the judged ones in the checkpoint's dtype) loaded with an option
    that changes its forward (an FP8 KV cache the checkpoint does not declare), the reference's model
    of that forward, computed by the reference's current load (in that engine's model dtype)."""
    from harness.engines.options import split_engine
    from harness.oracle.kv_cache import declares_fp8_kv_cache
    from harness.oracle.specified import modelled_option

    sequences = judgement.sequences
    if engines is None:
        engines = [e for e in judgement.engines if judgement.engine_dtype(e) == judgement.dtype]
    try:
        if declares_fp8_kv_cache(judgement.config.get("quantization_config") or {}):
            return  # the checkpoint's own cache: the option changes nothing
    except HarnessError:  # a KV scheme not defined here: no model of the option either
        return
    for engine in engines:
        option = modelled_option(split_engine(engine)[1])
        if not option:
            continue
        try:
            rows = worker.logprobs(
                sequences, judgement.scratch_file(REFERENCE, f"specified-{option}"), f"float64|{option}"
            )
        except EngineError:  # the reference cannot model it here: the engine is judged as its plain self
            continue
        bound = max(judgement.engine_tol(engine).activation_kv_max_abs_delta, 2 * judgement.specified_noise)
        specified = judgement.specified_reason if judgement.specified is not None else ""
        reason = ", ".join(filter(None, (specified, f"FP8 KV cache at scale 1.0 ({option})")))
        judgement.option_candidates[engine] = (rows, bound, reason)


def _variant_references(judgement: Judgement, worker: EngineProcess) -> None:
    """For the engines of the session judged against another load of the reference (another model
    dtype, `vllm[dtype=float32]`; online quantization, `vllm[quantization=fp8_per_channel]`), the
    reference loaded that way: its weight-only logits (the engine's baseline), its specified forward
    where there is one (the checkpoint's, in that dtype; the online scheme's activations), and its
    model of the engine's other options. Where the reference cannot, the engine's logits are not
    judged, and why is said."""
    by_variant: dict[str, list[str]] = {}
    for engine in judgement.engines:
        if judgement.reference_variant(engine) and not _unsupported_here(judgement, engine):
            by_variant.setdefault(judgement.reference_variant(engine), []).append(engine)
    for variant, engines in sorted(by_variant.items()):
        online = variant.startswith("quantization=")
        try:
            worker.load(judgement.directory, variant=variant)
            rows = worker.logprobs(judgement.sequences, judgement.scratch_file(REFERENCE, f"logprobs-{variant}"))
            specified, noise, reason = None, judgement.specified_noise, judgement.specified_reason
            if online:  # the scheme's own activations, and its own noise floor
                specified, noise = _specified_forwards(judgement, worker, variant)
                scheme = variant.partition("=")[2]
                reason = f"online {scheme}: {activation_scheme(scheme).describe()}"
            elif judgement.specified is not None:  # the checkpoint's own specified forward, in this dtype
                file = judgement.scratch_file(REFERENCE, f"specified-{variant}")
                specified = worker.logprobs(judgement.sequences, file, "float64")
        except EngineError as error:
            for engine in engines:
                judgement.baselines[engine] = None
                judgement.baseline_reasons[engine] = f"the reference has no forward with {variant}: {first_line(error)}"
            continue
        judgement.variant_bases[variant] = basis_of(judgement, worker, f"basis-{variant}")
        for engine in engines:
            judgement.baselines[engine] = rows
            if specified is not None:
                bound = max(judgement.engine_tol(engine).activation_max_abs_delta, 2 * noise)
                judgement.option_candidates[engine] = (specified, bound, reason)
        if not online:
            _option_candidates(judgement, worker, engines)


def _unsupported_here(judgement: Judgement, engine: str) -> bool:
    """Whether `engine` says at once that it cannot run this checkpoint's format here (its cached
    capability): no reference load is made for it (online FP8 per block without AMX)."""
    worker = judgement.session.process(engine)
    try:
        return worker is None or bool(worker.unsupported_schemes(judgement.fmt, judgement.knobs))
    except (EngineError, EngineFailure):
        return False  # its own load says so, where it is judged


def _specified_forwards(judgement: Judgement, worker: EngineProcess, load: str):
    """The specified forward of the reference's current load (named `load` in its scratch files)
    and its noise floor: how far the definition's rounding variants (harness.oracle.specified.VARIANTS)
    land from it."""
    from harness.oracle.specified import VARIANTS

    sequences, tol = judgement.sequences, judgement.tol
    forwards = {
        name: worker.logprobs(sequences, judgement.scratch_file(REFERENCE, f"specified-{load}-{name}"), name)
        for name in VARIANTS
    }
    specified = forwards.pop("float64")
    return specified, max(compare_logprobs(rows, specified, sequences, tol).max_abs_delta for rows in forwards.values())


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
            equal = sorted(n for n in placed & set(judgement.truth) if _holds_truth(judgement, engine, held, n))
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


def _holds_truth(judgement: Judgement, engine: str, held: dict[str, torch.Tensor], name: str) -> bool:
    want, got = judgement.truth[name], held.get(name)
    if got is None or tuple(got.shape) != tuple(want.shape):
        return False
    block = module_block(judgement.fmt, judgement.knobs, name, want)
    return compare_weight(name, got, want, judgement.engine_dtype(engine), judgement.engine_tol(engine), block).ok


def _judge_logits(judgement: Judgement, logprobs: dict[str, list[torch.Tensor]]) -> None:
    """Each engine's perplexity, and its log-probabilities against the reference engine's (in the
    engine's model dtype)."""
    result, sequences = judgement.result, judgement.sequences
    baseline = logprobs.get(REFERENCE)
    if baseline is not None and not all(torch.isfinite(r).all() for r in baseline):
        # the model itself overflows in its dtype (e.g. float16 with x1000 weights): no oracle for logits
        result.outcomes[REFERENCE].detail = "logits not judged: the reference's own are non-finite"
        baseline = None
    for engine, rows in logprobs.items():
        result.outcomes[engine].perplexity = perplexity(rows, sequences)
        if engine == REFERENCE or result.outcomes[engine].detail:
            continue
        own, tol = _baseline(judgement, engine, baseline)
        if own is None:
            continue
        diff = compare_logprobs(rows, own, sequences, tol)
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
        by_definition = judgement.candidate(engine)[0] is not None and weights_exact
        if not by_definition and ill_conditioned(judgement, engine, weights_exact, diff, tol):
            result.outcomes[engine].detail = (
                f"logits not judged: max |delta logprob| {diff.max_abs_delta:.3g} (top-1 misses {diff.topk_misses}) "
                "with every weight as placed and applied, in a model of x1000 weights, whose attention is a hard "
                "max that any kernel's own rounding order flips"
            )
            continue
        rounding = False  # beyond the fixed tolerance, yet two faithful roundings apart
        if by_definition:  # with wrong weights, logits are their consequence
            # perplexity below is then judged against the definition's logits; top-1 is not: on the
            # E4M3 grid of quantized activations or a quantized KV cache, near-tied top-1s flip
            # within the measured bound _judge_activations applies (a weight-only ct-int4 phi3 with
            # an FP8 KV cache: transformers, compressed-tensors and vLLM each 1 of 69 positions)
            diff = _judge_activations(judgement, engine, rows, own, diff, metrics)
        elif diff.max_abs_delta > tol.logprob_max_abs_delta:
            rounding = _within_rounding(judgement, rows, _exact_forward(judgement, engine, own), tol, metrics)
            if not rounding:
                judgement.finding(
                    engine,
                    "logprobs",
                    f"max |delta logprob| {diff.max_abs_delta:.3g} > {tol.logprob_max_abs_delta}",
                    metrics=metrics,
                )
        # top-1 is not judged where the logits are two roundings apart: rounding that moves them past
        # the tolerance reorders near-tied tokens (a bfloat16 two-layer DeepSeek-V3 whose weights every
        # engine holds exactly, its reference 1 nat from float32: 1 of 69 positions, session 39)
        if not by_definition and not rounding and diff.topk_misses > tol.max_topk_miss_fraction * diff.positions:
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


def _exact_forward(judgement: Judgement, engine: str, rows: list[torch.Tensor]):
    """The reference's weight-only logits in float32 and how far its own in the engine's dtype
    (`rows`) lie from them: this checkpoint's sensitivity to rounding in that dtype. None in
    float32, for an engine that quantizes online (its baseline is another model), or where the
    reference cannot. Computed where an engine is beyond the fixed tolerance only, once per dtype
    (a reload of the reference)."""
    dtype = judgement.engine_dtype(engine)
    if dtype == "float32" or judgement.reference_variant(engine).startswith("quantization="):
        return None
    if dtype not in judgement.exact_forwards:
        worker, found = judgement.session.process(REFERENCE), None
        if worker is not None:
            try:
                worker.load(judgement.directory, variant="dtype=float32")
                exact = worker.logprobs(judgement.sequences, judgement.scratch_file(REFERENCE, "logprobs-float32"))
                noise = compare_logprobs(rows, exact, judgement.sequences, judgement.engine_tol(REFERENCE))
                found = (exact, noise.max_abs_delta) if math.isfinite(noise.max_abs_delta) else None
            except (EngineError, EngineFailure):
                found = None
        judgement.exact_forwards[dtype] = found
    return judgement.exact_forwards[dtype]


def _within_rounding(judgement: Judgement, rows: list[torch.Tensor], exact, tol, metrics: dict) -> bool:
    """Whether an engine's logits beyond the fixed tolerance from the reference's in the same dtype
    are two faithful roundings apart: the engine lies within twice the reference's own distance
    from the float32 forward (`exact`: (its logits, that distance)). A trained model's peaked logits
    amplify rounding: the shipped tiny-llama's bfloat16 reference lies 0.15 from float32 (float64:
    0.15 too), vLLM's 0.19, the two 0.29 apart (a random generated model: 0.04)."""
    if exact is None:
        return False
    logits, noise = exact
    to_exact = compare_logprobs(rows, logits, judgement.sequences, tol).max_abs_delta
    metrics |= {"to_float32": to_exact, "reference_to_float32": noise}
    return within_rounding(to_exact, noise, tol)


def within_rounding(to_exact: float, noise: float, tol) -> bool:
    """An engine `to_exact` from the float32 forward, where the reference's own rounding lies
    `noise` from it: within twice that, or within the fixed tolerance."""
    return to_exact <= max(tol.logprob_max_abs_delta, 2 * noise)


def _baseline(judgement: Judgement, engine: str, baseline):
    """The reference's weight-only logits `engine` is held to, and the tolerances it is judged with:
    `baseline` (the reference's, None where non-finite) and the checkpoint dtype's, or for an engine
    loaded in another model dtype the reference's forward in that dtype and that dtype's. (None, _)
    where there is none, said in the engine's outcome where the reason is this dtype's."""
    variant = judgement.reference_variant(engine)
    if not variant:
        return baseline, judgement.tol
    own = judgement.baselines.get(engine)
    reason = judgement.baseline_reasons.get(engine, f"the reference computed no forward with {variant}")
    if own is not None and not all(torch.isfinite(r).all() for r in own):
        reason, own = f"the reference's own logits with {variant} are non-finite", None
    if own is None:
        judgement.result.outcomes[engine].detail = f"logits not judged: {reason}"
    return own, judgement.engine_tol(engine)


def ill_conditioned(judgement: Judgement, engine: str, weights_exact: bool, diff, tol) -> bool:
    """Whether logits beyond tolerance are the model's, not the engine's: the recipe scales every
    weight x1000 (`extreme_amax=huge`, a perturbation for scale ranges), the engine holds the
    reference's weights and its Linears apply them (no post-load finding). There q and k reach
    ~3e3 and attention scores ~1e8: softmax picks one key, and a kernel that rounds its products in
    another order than the reference's flips which (measured: GPTQModel's int8 kernel, every Linear
    within one bfloat16 ulp, 4.1 log-probability at 1 of 69 positions)."""
    beyond = (
        diff.max_abs_delta > tol.logprob_max_abs_delta or diff.topk_misses > tol.max_topk_miss_fraction * diff.positions
    )
    huge = ((judgement.manifest or {}).get("recipe") or {}).get("perturb", {}).get("extreme_amax") == "huge"
    applied = not any(f.engine == engine and f.kind == "post-load" for f in judgement.result.findings)
    return beyond and huge and weights_exact and applied


def _module_notes(manifest) -> list[str]:
    notes = []
    for module, info in (manifest or {}).get("modules", {}).items():
        notes.extend(f"{module}: {n}" for n in info.get("notes", []) if info.get("expectation") == "refuse")
    return notes


def _judge_report(
    engine: str, report: dict, finding, unused: set[str] = frozenset(), redundant: set[str] = frozenset()
) -> bool:
    """Weights left unloaded, then scale keys missing or unexpected, then any other key, each their
    own kind of finding; True if any anomaly. Tensors the checkpoint holds for no module (`unused`)
    are rightly unexpected, and those whose values the format defines as their absence would
    (`redundant`: a g_idx of k // g) may be left unread."""
    missing = report.get("missing", [])
    orphans = {name.rpartition(".")[0] for name in unused}  # an engine may rename the orphan's suffix
    unexpected = [
        k
        for k in report.get("unexpected", [])
        if canonical_name(k).rpartition(".")[0] not in orphans and canonical_name(k) not in redundant
    ]
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
        judgement.engine_dtype(engine),
        judgement.engine_tol(engine),
        judgement.fmt,
        judgement.knobs,
        judgement.finding,
        judgement.module_notes,
        judgement.misreadings,
    )


def module_block(fmt, knobs, name: str, want: torch.Tensor) -> tuple[int, int] | None:
    """The scale block of the weight `name` (its module's own format's in a mixed checkpoint), None
    for a tensor that is not a matrix."""
    if want.dim() != 2:
        return None
    own, own_knobs = fmt.for_module(name.removesuffix(".weight"), knobs)
    try:
        return own.scale_block(own_knobs, tuple(want.shape))
    except FormatError:  # a mixed checkpoint's module no group names, its groups' blocks differing
        return None


def _judge_weights(engine, held, truth, dtype, tol, fmt, knobs, finding, module_notes, misreadings=None) -> None:
    """Every truth tensor against what the engine holds; a finding names what the generator did
    to that module (its manifest notes), so a reader sees the perturbation behind it."""
    for name, want in sorted(truth.items()):
        if name not in held:
            finding(engine, "weight-missing", f"no weight held for {name}", module=name)
            continue
        got = held[name]
        block = module_block(fmt, knobs, name, want)
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
    sequences, tol = judgement.sequences, judgement.engine_tol(engine)
    candidate, bound, scheme = judgement.candidate(engine)
    specified = compare_logprobs(rows, candidate, sequences, tol)
    to_specified = specified.max_abs_delta
    apart = compare_logprobs(candidate, weights_only, sequences, tol).max_abs_delta
    metrics.update(
        to_specified=to_specified, candidates_apart=apart, activation_bound=bound, noise_floor=judgement.specified_noise
    )
    if to_specified <= bound:
        return specified
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
