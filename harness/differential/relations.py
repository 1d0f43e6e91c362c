"""Relations that need no reference: load paths of one engine that must agree bit for bit.

Each relation is data (`RELATIONS`): how an engine's worker makes a second load of the checkpoint
it has just loaded and been judged on, and what of the two loads must be equal. Loading twice in
one worker, saving and reloading, loading into NaN-filled storage (as vLLM's reload tests do, so a
parameter the loader never writes stays NaN), a quantizer's dequantize-at-load option and a
device_map that offloads to disk all hold the first load's weights or compute its logits, whatever
the truth is: no oracle is needed, and a wrong load that the truth cannot tell apart (a scale
applied again on a second load, a parameter left as allocated) still shows. One relation is
checked once per checkpoint rather than on a load: `tensor-parallel` runs vLLM's own weight loaders
for every rank at tensor-parallel sizes 1, 2 and 4 (harness.engines.vllm.tensor_parallel) and holds each
rank's shard to its slice, whatever vLLM's one-device load did. One that does not hold is a
`relation` finding naming the relation and the first differing tensor and position (for
tensor-parallel: the smallest size, the rank and the Linear); one an engine or checkpoint cannot
perform is "not checked" with the reason, never a pass. Opt-in per call: `evaluate(...,
relations=...)`, `compare --relations`, and the campaign on every `CAMPAIGN_EVERY`-th example
(`sampled`). Imports no torch at import time.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.core.errors import HarnessError, first_line
from harness.core.naming import canonical_name
from harness.engines.options import base_engine
from harness.engines.process import EngineError, EngineFailure
from harness.engines.vllm.tensor_parallel.layout import ARCHITECTURES as TP_ARCHITECTURES

if TYPE_CHECKING:
    import torch

    from harness.differential.judgement import Judgement
    from harness.engines.process import EngineProcess


#: how the tensor-parallel relation's "second load" is made: vLLM's loaders under a mocked rank
SHARDS = "tp-shards"


@dataclass(frozen=True)
class Relation:
    name: str
    #: what must hold, in one line (each finding carries it: metrics["must_hold"])
    holds: str
    #: how the second load is made: `again` (the same load once more), `saved` (Engine.save into
    #: the engine's scratch, then a load of the saved copy), or an Engine.load_variant name
    second: str
    #: what of the two loads must be equal: `report` (missing and unexpected keys), `weights`,
    #: `logprobs` (on the runner's probe sequences)
    compares: tuple[str, ...]
    #: the quant_method values of the checkpoints it applies to (None: every checkpoint)
    methods: tuple[str, ...] | None = None
    #: the engines it is checked on (None: every engine that loads the checkpoint)
    engines: tuple[str, ...] | None = None
    #: the config `architectures` it applies to (None: every one)
    architectures: tuple[str, ...] | None = None

    def inapplicable(self, config: dict) -> str:
        """Why this relation says nothing about a checkpoint with `config` ('' when it applies)."""
        quantization = config.get("quantization_config")
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if self.methods is not None and method not in self.methods:
            return f"{self.name} applies to quant_method {', '.join(self.methods)}, not {method}"
        architecture = (config.get("architectures") or ["?"])[0]
        if self.architectures is not None and architecture not in self.architectures:
            return f"{self.name} knows the decoder layers of {', '.join(self.architectures)}, not {architecture}"
        return ""


RELATIONS: dict[str, Relation] = {
    relation.name: relation
    for relation in (
        Relation(
            "load-twice",
            "a second load of the same checkpoint in the same worker reports the same keys, holds the same "
            "weights and computes the same log-probabilities, bit for bit",
            "again",
            ("report", "weights", "logprobs"),
        ),
        Relation(
            "round-trip",
            "the loaded model saved as its users save it (save_pretrained) and loaded again holds the first "
            "load's weights and computes its log-probabilities, bit for bit",
            "saved",
            ("weights", "logprobs"),
        ),
        Relation(
            "sentinel",
            "loaded into parameters materialized NaN-filled, no parameter stays NaN and every weight equals the "
            "first load's (a NaN left is a parameter the loader never wrote)",
            "sentinel",
            ("report", "weights"),
        ),
        Relation(
            "dequantize",
            "the quantizer's dequantize-at-load option (compressed-tensors dequantize=True, formerly "
            "run_compressed=False; FineGrainedFP8 dequantize=True) holds the default path's weights bit for bit (not "
            "its logits: a dequantized model runs no activation quantization, by design)",
            "dequantize",
            ("weights",),
            methods=("compressed-tensors", "fp8"),
        ),
        Relation(
            "offload",
            "loaded with a device_map that offloads part of the model to disk (half the checkpoint's bytes in "
            "memory), it computes the same log-probabilities bit for bit (its weights are not all in memory to read)",
            "offload",
            ("logprobs",),
        ),
        Relation(
            "tensor-parallel",
            "vLLM's own weight loaders, run for every rank at tensor-parallel sizes 1, 2 and 4 (one decoder layer "
            "under a mocked rank, as vLLM's own loading tests mock it), and for routed experts at expert-parallel "
            "sizes 2 and 4 (whole experts, one rank each), give each rank exactly its slice of the "
            "checkpoint's values, or refuse the split; checked whatever vLLM's one-device load did (no kernel runs)",
            SHARDS,
            ("shards",),
            engines=("vllm",),
            architectures=TP_ARCHITECTURES,
        ),
    )
}
RELATION_NAMES = tuple(RELATIONS)
#: the tensor-parallel sizes the tensor-parallel relation shards at (1: the one-device baseline)
TP_SIZES = (1, 2, 4)
#: the expert-parallel sizes it places a layer's routed experts at (vLLM's enable_expert_parallel)
EP_SIZES = (2, 4)
#: the campaign checks one relation on every CAMPAIGN_EVERY-th example, the relations in turn (`run
#: --relations-every`). Measured on the tiny checkpoints the campaign writes (session 19, AVX2 host, 10-min
#: main jobs, docs/campaign.md runs 28-32): an example with a relation took 0.35-0.39 s against
#: 0.28-0.31 s without, so one in 2 kept about as many examples as one in 10 (1751 against 1762,
#: the former with 60 more cells) while checking 5x more relations (875 against 176): gpt-oss,
#: Llama-4 and DeepSeek-V3 got tensor-parallel checks at all. One in 1 kept fewer (run 32).
CAMPAIGN_EVERY = 2
#: the relations the main job checks by default: all six. round-trip, dequantize, offload and
#: tensor-parallel found upstream bugs (cases/known_issues.toml), so the main job rediscovers them
#: too; a relation of engines a run does not load is left out (harness.commands.run)
CAMPAIGN_DEFAULT = RELATION_NAMES


def relation_named(message: str) -> str | None:
    """The relation a relation finding's message, or a known issue's regex for it, begins with
    ("round-trip: ...", "^dequantize: ...")."""
    name = message.removeprefix("^").partition(":")[0]
    return name if name in RELATION_NAMES else None


def parse_relations(text: str | None) -> tuple[str, ...]:
    """`--relations`: comma-separated names, `all`, or `none` (also empty)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if names in ([], ["none"]):
        return ()
    if names == ["all"]:
        return RELATION_NAMES
    unknown = [n for n in names if n not in RELATIONS]
    if unknown:
        raise HarnessError(f"unknown relation(s) {', '.join(unknown)} (known: {', '.join(RELATION_NAMES)}, all, none)")
    return tuple(dict.fromkeys(names))


def sampled(
    example: int,
    names: tuple[str, ...] = RELATION_NAMES,
    every: int = CAMPAIGN_EVERY,
    config: dict | None = None,
    checked: Mapping[str, float] | None = None,
) -> tuple[str, ...]:
    """The relations the campaign checks on its `example`-th example (1-based): one, in turn, on
    every `every`-th, so that the relations cost about 1/`every` of the campaign's loads. Given the
    example's `config`, a turn whose relation says nothing about it passes to the next one that
    does (no sampled load wasted on a relation that does not apply). Given `checked` (relation ->
    how often it was checked on checkpoints like this one: the campaign counts per format and
    architecture), the least checked of those goes first, ties in turn: each relation reaches each
    format and architecture, not only the ones its turns happen to fall on."""
    if not names or every <= 0 or example % every:
        return ()
    turn = (example // every - 1) % len(names)
    in_turn = names[turn:] + names[:turn]
    applicable = [name for name in in_turn if config is None or not RELATIONS[name].inapplicable(config)]
    pool = applicable or in_turn
    if checked is not None:
        pool = sorted(pool, key=lambda name: checked.get(name, 0))  # stable: the turn order breaks ties
    return tuple(pool[:1])


@dataclass
class Load:
    """What one load of a checkpoint in an engine's worker reported, held and computed."""

    report: dict
    weights: dict[str, torch.Tensor]
    logprobs: list[torch.Tensor] = field(default_factory=list)
    #: False where the engine has no kernel for the forward here (vLLM's MoE on a CPU without one):
    #: what it loaded is still compared, log-probabilities are neither computed nor compared
    forward: bool = True


def check_relations(judgement: Judgement, engine: str, worker: EngineProcess, first: Load) -> None:
    """Check each of the judgement's relations on `engine`, whose worker holds the `first` load;
    each verdict goes to the engine's outcome (`relations`), each failure is a finding. A worker
    that dies stops the rest (its failure is that engine-* finding)."""
    outcome = judgement.result.outcomes[engine]
    holds_first = True  # after a relation's second load the worker holds that one (or none, if it failed)
    for name in judgement.relations:
        relation = RELATIONS[name]
        if relation.second == SHARDS or (relation.engines is not None and base_engine(engine) not in relation.engines):
            continue  # tensor-parallel: once per checkpoint (check_shard_relations); others: not this engine's
        try:
            if relation.second == "saved" and not holds_first:
                try:
                    worker.load(judgement.directory)  # it saves what it holds: the first load, again
                except EngineError as error:
                    outcome.relations[name] = f"not checked: loading the checkpoint again failed: {first_line(error)}"
                    continue
            outcome.relations[name] = _check(relation, judgement, engine, worker, first)
            holds_first = False
        except EngineFailure as failure:
            outcome.relations[name] = f"not checked: the worker failed ({failure.kind})"
            judgement.finding(
                engine,
                f"engine-{failure.kind}",
                f"{name}: {failure}",
                metrics={"log_tail": failure.log_tail, "relation": name},
            )
            return


def check_shard_relations(judgement: Judgement, engines: list[str]) -> None:
    """The relations checked once per checkpoint, not on a load: tensor-parallel, on vLLM whatever
    its one-device load did (refused, no kernel on this host: its loaders run all the same)."""
    for relation in (RELATIONS[name] for name in judgement.relations if RELATIONS[name].second == SHARDS):
        for engine in relation.engines or ():
            outcome = judgement.result.outcomes.get(engine)
            if engine in engines and outcome is not None and outcome.status != "unavailable":
                outcome.relations[relation.name] = _check_shards(relation, judgement, engine)


def _check_shards(relation: Relation, judgement: Judgement, engine: str) -> str:
    """tp-shards at TP_SIZES on the checkpoint's first decoder layer, and its first layer with
    routed experts where that is another (DeepSeek-V3's dense first layers), whose experts are also
    placed at EP_SIZES; the smallest tensor-parallel size at which a rank holds other values than
    its slice is one finding, the smallest expert-parallel one another (the others in their metrics)."""
    from harness.engines.vllm.tensor_parallel import FINDING, REFUSED, WORKER_SPEC, check_tensor_parallel, lane_judges
    from harness.engines.vllm.tensor_parallel.layout import TP, first_sparse_layer

    why = relation.inapplicable(judgement.config)
    if why or judgement.hazards:
        return f"not checked: {why or 'a hostile layout'}"
    if judgement.fmt is not None and not lane_judges(judgement.fmt, judgement.knobs or {}):
        # a format whose tensors the lane cannot slice: it reads row-major tensors, some packed across
        # rows (ct's asymmetric zero points), and GPTQ/AWQ's
        return f"not checked: {judgement.fmt.name} does not store each output row on its own (its slices are not rows)"
    layers = sorted({0, first_sparse_layer(judgement.config) or 0})
    try:
        worker = judgement.session.helper(engine, WORKER_SPEC, relation.name)
        if worker is None:
            return f"not checked: {judgement.session.unavailable.get(engine, engine + ' unavailable')}"
        results = {
            layer: check_tensor_parallel(
                judgement.directory, list(TP_SIZES), layer, judgement.scratch, worker, list(EP_SIZES)
            )
            for layer in layers
        }
    except EngineFailure as failure:
        return f"not checked: the tensor-parallel worker cannot start: {first_line(failure)}"
    except HarnessError as error:  # the reference refuses the checkpoint, or the worker failed
        return f"not checked: {first_line(error)}"
    outcomes = [(layer, o) for layer, result in results.items() for o in result.outcomes]
    wrong = sorted(
        ((o.parallel, o.tp, layer, o) for layer, o in outcomes if o.status == FINDING),
        key=lambda item: (item[0] != TP, *item[1:3]),  # tensor-parallel first, the smallest size first
    )
    if not wrong:
        refused: dict[str, set[int]] = {}
        for _, o in outcomes:
            if o.status == REFUSED:
                refused.setdefault(o.parallel, set()).add(o.tp)
        where = "; ".join(f"{parallel} {', '.join(map(str, sorted(sizes)))}" for parallel, sizes in refused.items())
        modules = sorted({v.module for result in results.values() for v in result.verdicts if v.status == REFUSED})
        return "holds" + (f" (vLLM refuses {', '.join(modules)} at {where})" if refused else "")
    for kind in dict.fromkeys(kind for kind, _, _, _ in wrong):  # tensor parallelism's, then expert's
        _shard_finding(relation, judgement, engine, results, wrong, next(w for w in wrong if w[0] == kind))
    return "does not hold"


def _shard_finding(
    relation: Relation, judgement: Judgement, engine: str, results: dict, wrong: list, at: tuple
) -> None:
    """One finding for the smallest size of one kind of parallelism (`at`: kind, size, layer,
    outcome) at which a rank holds other values than its slice: an expert-parallel placement is
    judged apart from tensor parallelism's, so that a tensor-parallel finding hides no expert one."""
    from harness.engines.vllm.tensor_parallel import FINDING
    from harness.engines.vllm.tensor_parallel.layout import EP, TP

    parallel, tp, layer, first = at
    verdicts = [v for v in results[layer].verdicts if (v.parallel, v.tp) == (parallel, tp) and v.status == FINDING]
    module, shape = next(iter(verdicts[0].wrong.items()), (None, None))
    latent = bool(first.reasons)  # vLLM refuses another Linear of the layer: the model would not load
    failure = f"{verdicts[0].module} at {parallel} {tp}: a rank holds values other than its slice" + (
        " (latent: vLLM refuses another Linear of the layer)" if latent else ""
    )
    metrics = {
        "relation": relation.name,
        "must_hold": relation.holds,
        "failure": failure,
        "tp": tp,
        "parallel": parallel,
        "layer": layer,
        "tp_sizes_wrong": sorted({size for kind, size, _, _ in wrong if kind == TP}),
        "ep_sizes_wrong": sorted({size for kind, size, _, _ in wrong if kind == EP}),
        "shape": shape,
        "latent": latent,
        "ranks": first.findings[:20],
        "refusals": first.reasons[:10],
        "kernel_notes": sorted({note for result in results.values() for note in result.kernel_notes}),
    }
    more = len(first.findings) - 1
    message = f"{relation.name}: {first.findings[0]}" + (f" (and {more} more at {parallel} {tp})" if more else "")
    block = [judgement.knobs.get("block_rows"), judgement.knobs.get("block_cols")]
    if all(isinstance(b, int) for b in block):
        metrics["block"] = block  # a block format's grid: the known issues' `block_rows`
    judgement.finding(engine, "relation", message, module=module, metrics=metrics)


def _check(relation: Relation, judgement: Judgement, engine: str, worker: EngineProcess, first: Load) -> str:
    why = relation.inapplicable(judgement.config)
    if why:
        return f"not checked: {why}"
    missing = first.report.get("missing", [])
    if missing:  # parameters left as initialised (random) differ between any two loads: that finding is already made
        return f"not checked: the first load reports {len(missing)} missing key(s), left as initialised"
    if not first.forward and set(relation.compares) <= {"logprobs"}:
        return "not checked: the engine has no kernel for the forward here"
    saved = judgement.scratch / f"{engine.replace(':', '_')}-{relation.name}"
    step = "saving the loaded model failed"
    try:
        if relation.second == "saved":
            worker.save(saved)
        step = "the second load failed where the first loaded"
        second = _second_load(relation, judgement, engine, worker, saved, first.forward)
    except EngineError as error:
        if error.unsupported:
            return f"not checked: {first_line(error)}"
        judgement.finding(
            engine,
            "relation",
            f"{relation.name}: {step}: {first_line(error)}",
            metrics={
                "relation": relation.name,
                "must_hold": relation.holds,
                "failure": f"{step}: {first_line(error)}",
                "traceback_tail": error.traceback[-1500:],
            },
        )
        return "does not hold"
    finally:
        shutil.rmtree(saved, ignore_errors=True)
    difference = first_difference(relation, first, second, judgement.config)
    if difference is None:
        return "holds"
    message, metrics = difference
    metrics["must_hold"] = relation.holds
    judgement.finding(engine, "relation", f"{relation.name}: {message}", module=metrics.get("tensor"), metrics=metrics)
    return "does not hold"


def _second_load(
    relation: Relation, judgement: Judgement, engine: str, worker: EngineProcess, saved, forward: bool = True
) -> Load:
    """The second load (of the saved copy for `saved`, by the engine's variant path for a variant);
    its log-probabilities only where the engine runs a forward here (`forward`)."""
    if relation.second in ("again", "saved"):
        report = worker.load(saved if relation.second == "saved" else judgement.directory)
    else:
        report = worker.load(judgement.directory, variant=relation.second)
    weights = {}
    if "weights" in relation.compares:
        weights = worker.weights(judgement.scratch_file(engine, f"{relation.name}-weights"))
    rows = []
    if "logprobs" in relation.compares and forward:
        rows = worker.logprobs(judgement.sequences, judgement.scratch_file(engine, f"{relation.name}-logprobs"))
    return Load(report, weights, rows, forward)


def expert_parts_as(first: dict, second: dict, config: Mapping | None) -> dict:
    """`second`'s weights with each expert's projections under the part names `first` uses, where
    the architecture has several namings (Mixtral's w1/w3/w2 and llm-compressor's
    gate_proj/up_proj/down_proj): a saved model reloads under transformers' naming, the same
    tensors under other names."""
    from harness.checkpoints.architectures import architecture_for

    arch = architecture_for(str((config or {}).get("model_type"))) if config else None
    moe = arch.moe if arch else None
    if moe is None or not moe.other_parts:
        return second
    namings = (moe.parts, *moe.other_parts)
    split = [name.rpartition(".experts.")[2].split(".") for name in first if ".experts." in name]
    used = next((parts for parts in namings if any(len(p) > 2 and p[1] in parts for p in split)), None)
    if used is None:
        return second
    rename = {other[i]: used[i] for other in namings for i in range(3)}
    renamed = {}
    for name, tensor in second.items():
        head, sep, tail = name.rpartition(".experts.")
        pieces = tail.split(".")
        if sep and len(pieces) > 2 and pieces[1] in rename:
            name = f"{head}{sep}{pieces[0]}.{rename[pieces[1]]}." + ".".join(pieces[2:])
        renamed[name] = tensor
    return renamed


def first_difference(
    relation: Relation, first: Load, second: Load, config: Mapping | None = None
) -> tuple[str, dict] | None:
    """The first way `second` differs from `first` in what `relation` compares (a message and its
    metrics), or None. Modules the first load reported missing are left out: their values are the
    engine's initial ones, a load-report finding already."""
    metrics = {"relation": relation.name}
    if "report" in relation.compares:
        for key in ("missing", "unexpected"):
            one, two = sorted(first.report.get(key, [])), sorted(second.report.get(key, []))
            if one != two:
                metrics.update(failure=f"{key} keys differ", key=key, first=one[:20], second=two[:20])
                return f"the second load reports {len(two)} {key} key(s), the first {len(one)}", metrics
    if "weights" in relation.compares:
        missing = {canonical_name(k).rpartition(".")[0] for k in first.report.get("missing", [])}
        found = _weights_difference(
            relation, first.weights, expert_parts_as(first.weights, second.weights, config), missing
        )
        if found:
            return found[0], metrics | found[1]
    if "logprobs" in relation.compares and first.forward:
        found = _logprobs_difference(first.logprobs, second.logprobs)
        if found:
            return found[0], metrics | found[1]
    return None


def _weights_difference(relation, first: dict, second: dict, missing: set[str]) -> tuple[str, dict] | None:
    names = sorted(n for n in first.keys() | second.keys() if n.rpartition(".")[0] not in missing)
    for name in names:
        if name not in second or name not in first:
            held = "the first load holds it, the second does not" if name in first else "only the second load holds it"
            return f"{name}: {held}", {"tensor": name, "failure": "a tensor one load holds and the other does not"}
        one, two = first[name], second[name]
        if one.shape != two.shape:
            shapes = f"shape {list(two.shape)} on the second load, {list(one.shape)} on the first"
            return f"{name}: {shapes}", {"tensor": name, "failure": "shapes differ"}
        differ = ~((one == two) | (one.isnan() & two.isnan()))
        if not bool(differ.any()):
            continue
        unwritten = two.isnan() & ~one.isnan()
        left = relation.second == "sentinel" and bool(unwritten.any())
        position = _first(unwritten if left else differ)
        a, b = float(one[tuple(position)]), float(two[tuple(position)])
        detail = {"tensor": name, "position": position, "first": _json(a), "second": _json(b)}
        detail["differing"] = int(differ.sum())
        if left:
            detail.update(unwritten=int(unwritten.sum()), failure="parameters left unwritten")
            return (
                f"{name} left unwritten: {detail['unwritten']}/{one.numel()} element(s) still the NaN sentinel, "
                f"first at {position} (the first load holds {a:.6g})",
                detail,
            )
        detail["failure"] = "weights differ"
        return (
            f"{name} differs at {position}: {a:.6g} on the first load, {b:.6g} on the second "
            f"({detail['differing']}/{one.numel()} elements differ)",
            detail,
        )
    return None


def _json(value: float) -> float | str:
    """A metric value JSON can hold: non-finite ones as text."""
    return value if math.isfinite(value) else str(value)


def _first(mask) -> list[int]:
    """The index of `mask`'s first True element, in row-major order."""
    return [int(i) for i in mask.nonzero()[0]] if mask.dim() else []


def _logprobs_difference(first: list, second: list) -> tuple[str, dict] | None:
    for sequence, (one, two) in enumerate(zip(first, second, strict=True)):
        same = (one == two) | (one.isnan() & two.isnan())
        if bool(same.all()):
            continue
        position, token = _first(~same)
        a, b = float(one[position, token]), float(two[position, token])
        delta = float((one - two).abs().nan_to_num(float("inf")).max())
        detail = {"sequence": sequence, "position": [position, token], "first": _json(a), "second": _json(b)}
        detail["max_abs_delta"] = _json(delta)
        detail["failure"] = "log-probabilities differ"
        return (
            f"log-probabilities differ: sequence {sequence}, position {position}, token {token}: {a:.6g} on the "
            f"first load, {b:.6g} on the second (max |delta| {delta:.3g})",
            detail,
        )
    return None
