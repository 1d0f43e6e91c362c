"""The activation probe: what an engine does to each quantized Linear's input, judged module by
module on purpose-built inputs (harness.oracle.probe_inputs) whose quantization no rounding order
can change. Whole-model logits cannot tell dynamic FP8 activations from none in bfloat16 (the two
candidates are as far apart as rounding moves either); one Linear's output on these inputs can:
on llama checkpoints at the campaign's default sizes, quantizing moves each row's output 2.4-3.4%
(FP8) or 14-15% (NVFP4) as a relative norm, while the bound is 0.6% in bfloat16, 0.085% in
float16 and 0.011% in float32 (at least 4x apart in bfloat16), and transformers and
compressed-tensors land within 0.009% of the specified output
(scripts/measure-probe-separation, docs/measurements/probe-separation.json).

The reference gives each module's input and that input quantized as specified
(ReferenceEngine.probe_reference); the engine runs the same modules on the same inputs
(Engine.probe_linears). Its output is judged against what its own held weights (already judged
against the truth) compute from the quantized input, and from the raw one: so a weight one ulp off
(inside the weight tolerance) is not mistaken for an activation difference. The bound: one ulp of
every output element in the model dtype (both sides round once), plus float32 accumulation in
another order (in_features * 2**-23 * |W| |Q(x)|) and its flushing subnormal products to zero
(in_features * 2**-126 each), as a norm relative to the expected output, row by row; with a static
scale, plus that scale's relative rounding to the model dtype (engines hold it there: every
quantized value moves by that factor); an engine that also dequantizes its input in the model
dtype (each value rounded on its own, with the held scale) is judged against exactly that input.
A module whose weights are already a finding is not probed (its outputs are that finding's
consequence).

Routed experts that transformers packs in 3-D (one experts module per layer, no Linear to run) are
probed too: the module runs the probe's rows routed to one expert at a time, each expert judged
against the reference's outputs (`judge_experts`): every verdict in float32 models, "not applied"
only in bfloat16 and float16 ones (docs/measurements/expert-probe-precision.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from harness.core.errors import first_line
from harness.differential.effective_weights import already_explained
from harness.engines.hf_common import LEAD
from harness.engines.process import EngineError, EngineProcess
from harness.oracle.expert_activations import EXPERTS

PROBE_ROWS = 8
#: a routed expert's verdict in a reduced-precision model when it is not "not applied" (judge_experts)
NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class ModuleVerdict:
    module: str
    to_specified: float  # max over rows of ||output - specified|| / ||specified||
    to_weights_only: float
    apart: float  # the two expectations, the same way
    bound: float
    verdict: str  # "as specified", "not applied", "scale inverted", "not as specified"


def reference_probe(judgement, worker: EngineProcess, outcome) -> None:
    """The reference's probe inputs for the checkpoint it loaded (`judgement.probe`, None where there
    are none); for an activation-quantized checkpoint, `outcome.activation_probe` says how many or why none."""
    try:
        probe = worker.probe_reference(judgement.scratch_file(outcome.engine, "probe"), PROBE_ROWS)
        why = "no quantized Linear's probe input fits the model dtype"
    except EngineError as error:
        probe, why = None, first_line(error)
    judgement.probe = probe or None
    if judgement.specified is not None:
        inputs = sum(key.endswith(".input") for key in probe or {})
        experts = sum(key.endswith(EXPERTS) for key in probe or {})
        outcome.activation_probe = (
            f"inputs for {inputs} quantized Linear(s)" + (f" and {experts} packed experts module(s)" if experts else "")
            if inputs or experts
            else why
        )


def expected_outputs(rows: torch.Tensor, quantized: torch.Tensor, weight: torch.Tensor, bias, dtype):
    """(specified, weights-only, bound) for one module holding `weight` and `bias` (float32 copies
    of what the engine holds), in float64 and rounded once to the model dtype."""
    weight = weight.double()
    bias = bias.double() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
    specified = (quantized.double() @ weight.T + bias).to(dtype)
    weights_only = (rows.double() @ weight.T + bias).to(dtype)
    held = specified.abs()
    ulp = torch.nextafter(held, torch.full_like(held, float("inf"))).double() - held.double()
    accumulation = weight.shape[1] * 2.0**-23 * (quantized.double().abs() @ weight.abs().T).norm(dim=-1)
    # a float32 accumulator may flush subnormal products to zero (subnormal weights: the
    # subnormal-block perturbation): up to in_features * 2**-126 per output element
    flushed = weight.shape[1] * 2.0**-126 * weight.shape[0] ** 0.5
    return specified, weights_only, (ulp.norm(dim=-1) + accumulation + flushed) / _row_norms(specified)


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    norms = rows.double().norm(dim=-1)
    return torch.where(norms > 0, norms, torch.ones_like(norms))


def _relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row (token): ||got - want|| / ||want||. Rows are judged one by one: the probe's rows
    differ in scale by up to 2**12, and a whole-tensor norm would hear only the largest."""
    return (got.double() - want.double()).norm(dim=-1) / _row_norms(want)


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> bool:
    return bool((_relative(got, want) <= bound).all())


def judge_module(
    name: str,
    got: torch.Tensor,
    specified,
    weights_only,
    bound: torch.Tensor,
    inverted: tuple | None = None,
    held_scale: tuple | None = None,
) -> ModuleVerdict:
    """`bound`: per row; `inverted`: (output, bound) the module computes with its static scale in
    the other convention; `held_scale`: (output, bound) with the static scale and each dequantized
    input value rounded to the model dtype, the other way to compute as specified. The distances
    reported are the largest over the rows."""
    apart = _relative(specified, weights_only)
    if _within(got, specified, bound) or (held_scale is not None and _within(got, *held_scale)):
        verdict = "as specified"
    elif _within(got, weights_only, bound) and bool((apart > 2 * bound).all()):
        verdict = "not applied"
    elif inverted is not None and _within(got, *inverted) and not _within(specified, *inverted):
        verdict = "scale inverted"
    else:
        verdict = "not as specified"
    worst = lambda values: float(values.max())  # noqa: E731
    return ModuleVerdict(
        name,
        worst(_relative(got, specified)),
        worst(_relative(got, weights_only)),
        worst(apart),
        worst(bound),
        verdict,
    )


def layer_of(name: str) -> str:
    """`model.layers.3.mlp.experts` -> `3` (where a module's decoder layer is named)."""
    return name.partition(".layers.")[2].partition(".")[0]


def judge_experts(experts: list[str], probe: dict, outputs: dict) -> list[ModuleVerdict]:
    """Each packed experts module's experts, each judged on the probe's rows routed to it alone: its
    output against the reference's (specified and weight-only, computed in float32 from the model's
    weights, rounded to the model dtype), the bound a quarter of the two's distance, row by row. An
    expert's down input (act(gate) * up) is no purpose-built row. In float32 its rounding (about
    1e-7 relative) is far below what quantizing moves (about 1e-2): every verdict. In a bfloat16 or
    float16 model the engine's own rounding of it flips E4M3 roundings and moves the specified
    output up to about the candidates' distance, while the weight-only output moves little, so the
    one verdict left is "not applied" (measured, docs/measurements/expert-probe-precision.json:
    in bfloat16 a weight-only forward lands within 0.103 of the candidates' distance from its
    candidate, transformers' too, and a specified one never closer than 0.485 of it, against the
    bound's 0.25); any other output is "not judged"."""
    verdicts = []
    for name in experts:
        expert = 0
        while f"{name}{EXPERTS}.{expert}" in outputs and f"{name}{EXPERTS}.{expert}.specified" in probe:
            specified = probe[f"{name}{EXPERTS}.{expert}.specified"]
            weights_only = probe[f"{name}{EXPERTS}.{expert}.weights_only"]
            got = outputs[f"{name}{EXPERTS}.{expert}"]
            if got.shape == specified.shape:
                bound = _relative(specified, weights_only) / 4
                verdict = judge_module(f"{name}.{expert}", got, specified, weights_only, bound)
                if specified.dtype != torch.float32 and verdict.verdict != "not applied":
                    verdict = dataclasses.replace(verdict, verdict=NOT_JUDGED)
                verdicts.append(verdict)
            expert += 1
    return verdicts


def probe_engine(judgement, engine: str, worker: EngineProcess, outcome, held: dict[str, torch.Tensor]) -> None:
    """Run the probe on `engine` (which holds `held`, its weights under checkpoint names) and judge
    it: one `activations` finding per kind of deviation, naming its modules; what was probed in
    `outcome.activation_probe`."""
    probe = judgement.probe
    judged, experts = _modules_to_probe(judgement, engine, outcome, held)
    if not judged and not experts:
        outcome.activation_probe = "not run: every probed module's weights or load report are already a finding"
        return
    try:
        sent = {n: probe[f"{n}.input"] for n in judged} | {k: v for k, v in probe.items() if k.endswith(LEAD)}
        sent |= {f"{n}{EXPERTS}": probe[f"{n}{EXPERTS}"] for n in experts}
        outputs = worker.probe(sent, judgement.scratch_file(engine, "probe"))
    except EngineError as error:
        outcome.activation_probe = f"not run: {first_line(error)}"
        return
    expert_verdicts = judge_experts(experts, probe, outputs)
    verdicts, overflow = _judge_linears(judged, probe, outputs, held)
    outcome.activation_probe = _summary(len(judged), verdicts, overflow, len(experts), expert_verdicts)
    _report_deviations(judgement, engine, verdicts, expert_verdicts)


def _modules_to_probe(judgement, engine: str, outcome, held: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The Linears and the packed experts modules worth probing on `engine`: those no finding
    already explains (a weight, its load report, or a Linear applying other weights than it holds)."""
    probe = judgement.probe
    names = sorted(key.removesuffix(".input") for key in probe if key.endswith(".input"))
    explained = already_explained(judgement, engine, outcome)
    # a Linear that applies other weights than it holds (harness.differential.effective_weights)
    explained |= {
        m
        for f in judgement.result.findings
        if f.engine == engine and f.kind == "post-load"
        for m in f.metrics.get("modules", [])
    }
    judged = [name for name in names if name not in explained and f"{name}.weight" in held]
    experts = sorted(k.removesuffix(EXPERTS) for k in probe if k.endswith(EXPERTS))
    experts = [name for name in experts if layer_of(name) not in {layer_of(m) for m in explained if ".experts." in m}]
    return judged, experts


def _judge_linears(
    judged: list[str], probe: dict, outputs: dict, held: dict[str, torch.Tensor]
) -> tuple[list[ModuleVerdict], int]:
    """Each probed Linear's output against what its held weights compute from the specified input;
    the verdicts, and how many were not judged because their output leaves the model dtype's range."""
    verdicts, overflow = [], 0
    for name in (n for n in judged if n in outputs):
        rows, quantized = probe[f"{name}.input"], probe[f"{name}.quantized"]
        expected = expected_outputs(rows, quantized, held[f"{name}.weight"], held.get(f"{name}.bias"), rows.dtype)
        # a static scale held in the model dtype scales every quantized value by (1 + its rounding)
        expected = (*expected[:2], expected[2] + float(probe.get(f"{name}.scale_rounding", torch.zeros(1))))
        if outputs[name].shape != expected[0].shape:  # e.g. padded rows: not the module the truth has
            continue
        if not all(torch.isfinite(t).all() for t in expected[:2]) or bool((expected[2] >= 0.5).any()):
            overflow += 1  # outside the model dtype's range (x1000 weights in float16; subnormal weights)
            continue
        held_scale = None
        if f"{name}.quantized_held" in probe:  # a static scale held, and the input dequantized, in the model dtype
            alternative = expected_outputs(
                rows, probe[f"{name}.quantized_held"], held[f"{name}.weight"], held.get(f"{name}.bias"), rows.dtype
            )
            held_scale = (alternative[0], alternative[2]) if torch.isfinite(alternative[0]).all() else None
        inverted = None
        if f"{name}.inverted" in probe:  # a static scale: what reading it in the other convention computes
            other = expected_outputs(
                rows, probe[f"{name}.inverted"], held[f"{name}.weight"], held.get(f"{name}.bias"), rows.dtype
            )
            inverted = (other[0], other[2]) if torch.isfinite(other[0]).all() else None
        verdicts.append(judge_module(name, outputs[name], *expected, inverted=inverted, held_scale=held_scale))
    return verdicts, overflow


def _summary(
    judged: int, verdicts: list[ModuleVerdict], overflow: int, experts: int, expert_verdicts: list[ModuleVerdict]
) -> str:
    """What the probe found, in one line (`outcome.activation_probe`)."""
    fine = sum(v.verdict == "as specified" for v in verdicts)
    absent = judged - len(verdicts) - overflow
    summary = (
        f"{fine}/{len(verdicts)} quantized Linear(s) as specified"
        + (f"; {absent} not found in the engine's model (or of another shape)" if absent else "")
        + (f"; {overflow} not judged: their output leaves the model dtype's normal range" if overflow else "")
    )
    if experts:
        held_packed = len({v.module.rpartition(".")[0] for v in expert_verdicts})
        unjudged = sum(v.verdict == NOT_JUDGED for v in expert_verdicts)
        fine = sum(v.verdict == "as specified" for v in expert_verdicts)
        summary += (
            f"; {fine}/{len(expert_verdicts)} routed expert(s) as specified"
            if not unjudged
            else f"; routed experts in a reduced-precision model: {len(expert_verdicts) - unjudged}/"
            f"{len(expert_verdicts)} not applied, the others not judged (only 'not applied' is told apart there)"
        ) + f" ({held_packed}/{experts} packed experts module(s) found)"
    return summary


def _report_deviations(
    judgement, engine: str, verdicts: list[ModuleVerdict], expert_verdicts: list[ModuleVerdict]
) -> None:
    """One `activations` finding per kind of deviation (among Linears, among routed experts), at its worst module."""
    scheme = judgement.specified_reason or "activations"
    for kind, group, what_of in (
        *((kind, verdicts, "quantized Linear(s)") for kind in ("not applied", "scale inverted", "not as specified")),
        *((kind, expert_verdicts, "routed expert(s)") for kind in ("not applied", "not as specified")),
    ):
        failed = [v for v in group if v.verdict == kind]
        if not failed:
            continue
        worst = max(failed, key=lambda v: v.to_specified)
        if kind == "not applied":
            what = f"activation quantization not applied ({scheme})"
        elif kind == "scale inverted":
            what = f"activations quantized with the static scale in the other convention, 1/s for s ({scheme})"
        else:
            what = f"activations not quantized as specified ({scheme})"
        judgement.finding(
            engine,
            "activations",
            f"activation probe: {what} at {len(failed)}/{len(group)} {what_of}, e.g. "
            f"{worst.module}: output {worst.to_specified:.2g} from the specified one and "
            f"{worst.to_weights_only:.2g} from the weight-only one (relative norms, worst row; bound {worst.bound:.2g})",
            module=worst.module,
            metrics={
                "probe": "activation",
                "modules": [v.module for v in failed],
                "to_specified": worst.to_specified,
                "to_weights_only": worst.to_weights_only,
                "candidates_apart": worst.apart,
                "activation_bound": worst.bound,
            },
        )
