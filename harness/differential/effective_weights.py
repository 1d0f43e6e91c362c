"""The effective-weight probe: the weights each Linear really applies once the engine is done with
them (process_weights_after_loading's repacking, requantizing, fused scales, a kernel's own
layout; lazy decompression at the first forward), judged against those its loader placed.

The weights an engine holds are read where its loaders put them (vLLM's before
`process_weights_after_loading`), and judged against the truth there; what the kernel then runs
on is private to it. Its output on basis inputs is not: each Linear runs on rows c * e_j
(harness.oracle.basis), whose outputs are d * W[:, j] + b, so (output - b) / d is column j of the
weight the kernel applies, and each element is judged against the held weight's. c quantizes
exactly under every activation scheme (d is known), so the activation quantization, judged by the
activation probe, does not enter. Every probed column's output is one product (no accumulation):
the bound per element is one ulp of the model dtype for a kernel that holds its weight there, plus
the output's rounding to the model dtype, plus a static scale's rounding to it, plus float32's
flushing of a subnormal product; for an integer format with zero points (GPTQ, AWQ), plus two
roundings of (2**bits - 1) * scale to the model dtype: CPU int4 kernels fold the zero point into a
float offset, each of its two terms at most that large (GPTQModel's TorchAtenLinear computes
(q - 8) * s + (8 - z) * s in bfloat16; on asymmetric GPTQ it measured up to 0.072 of a quantization
step, an eighth of a step in bfloat16 being the bound), while a zero point read wrong moves an
element by a whole step. A Linear with a static input scale is left to the activation
probe: by outputs alone a static scale read wrong and a weight scale read wrong are the same, and
engines round a static scale (and NVFP4's global one) into their own arithmetic in ways the basis
does not model (the main job flagged compressed-tensors' NVFP4 W4A4 and static FP8 Linears on
basis rows, one example's flagged elements at a median 1.31x, while the activation probe finds
them as specified).

A module whose held weights are already a finding is not probed; a difference is a `post-load`
finding naming the modules, the rows that differ (a fused part's, an expert's) and the ratio of
applied to placed (0.5: halved; -1: negated)."""

from __future__ import annotations

import torch

from harness.core.errors import first_line
from harness.core.findings import WEIGHT_KINDS
from harness.core.naming import canonical_name
from harness.core.spans import ranges
from harness.engines.hf_common import LEAD
from harness.engines.process import EngineError, EngineProcess

#: float32 arithmetic in the kernel: its relative rounding, and its smallest normal (a product below
#: it may be flushed to zero)
FLOAT32_ROUNDING = 2.0**-22
FLOAT32_TINY = 2.0**-126


def reference_basis(judgement, worker: EngineProcess) -> None:
    """The reference's basis inputs for the checkpoint it loaded (`judgement.basis`), or why none."""
    judgement.basis, judgement.basis_reason = basis_of(judgement, worker, "basis")


def basis_of(judgement, worker: EngineProcess, what: str) -> tuple[dict | None, str]:
    """The basis inputs of the reference's current load, or (None, why there are none)."""
    try:
        basis = worker.basis_reference(judgement.scratch_file("reference", what)) or None
        return basis, "" if basis else "the model has no Linear"
    except EngineError as error:
        return None, first_line(error)


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of |values| in `dtype` (float64)."""
    held = values.abs().to(dtype)
    return (torch.nextafter(held, torch.full_like(held, float("inf"))).double() - held.double()).nan_to_num(
        float("inf")
    )


def applied_columns(output: torch.Tensor, bias: torch.Tensor | None, candidate: torch.Tensor) -> torch.Tensor:
    """[out, C] float64: the weight columns a Linear applied, from its output [C, out] on the basis."""
    output = output.double()
    if bias is not None:
        output = output - bias.double()
    return (output / candidate.unsqueeze(1)).T


def column_bound(
    weight: torch.Tensor, bias, candidate: torch.Tensor, rounding: float, dtype, folded: torch.Tensor | None = None
) -> torch.Tensor:
    """[out, C]: how far an applied column may sit from the held one's `weight` [out, C];
    `folded` [out, C]: an integer format's largest code times scale, bounding both terms a kernel
    that folds the zero point into a float offset rounds to the model dtype."""
    d = candidate.abs().unsqueeze(0)
    fold = 2 * ulp(folded, dtype) if folded is not None else 0
    product = weight.abs() * d + (bias.double().abs().unsqueeze(1) if bias is not None else 0)
    # a product below float32's (and bfloat16's) smallest normal may be flushed to zero whole
    flushed = torch.where(weight.abs() * d < 2 * FLOAT32_TINY, weight.abs(), torch.zeros_like(weight))
    return (
        ulp(weight, dtype)
        + ulp(product, dtype) / d
        + weight.abs() * (rounding + FLOAT32_ROUNDING)
        + flushed
        + 2 * FLOAT32_TINY / d
        + fold
    )


def judge_module(name: str, output, weight, bias, basis: dict, dtype) -> dict | None:
    """None when the applied columns fit the held weight under some candidate d; else what differs."""
    columns = basis[f"{name}.columns"]
    held = weight.double()[:, columns]
    rounding = float(basis[f"{name}.scale_rounding"])
    worst = None
    for candidate in basis[f"{name}.candidates"]:
        applied = applied_columns(output, bias, candidate)
        if applied.shape != held.shape:
            return {"module": name, "shape": list(applied.shape), "held_shape": list(held.shape)}
        bound = column_bound(held, bias, candidate, rounding, dtype, basis.get(f"{name}.zero_point_products"))
        off = ~((applied - held).abs() <= bound)  # NaN counts as off
        judged = torch.isfinite(bound)
        off &= judged
        if not off.any():
            return None
        if worst is None or int(off.sum()) < worst["elements"]:
            ratio = applied[off] / held[off]
            worst = {
                "module": name,
                "elements": int(off.sum()),
                "judged": int(judged.sum()),
                "rows": row_ranges(off.any(dim=1)),
                "ratio": float(ratio[torch.isfinite(ratio)].median()) if torch.isfinite(ratio).any() else None,
                "nonfinite": int((~torch.isfinite(applied) & off).sum()),
            }
    return worst


def row_ranges(rows: torch.Tensor) -> str:
    """`0-63, 128-191`: the output rows a mask marks, as runs (the first six)."""
    return ranges(torch.nonzero(rows).flatten().tolist(), limit=6)


def already_explained(judgement, engine: str, outcome) -> set[str]:
    """The modules whose weights, or whose tensors in the load report, are already a finding of
    `engine`: a probe of them would judge that finding's consequence."""
    explained = {
        f.module.removesuffix(".weight").removesuffix(".bias")
        for f in judgement.result.findings
        if f.engine == engine and f.kind in WEIGHT_KINDS and f.module
    }
    reported = outcome.report.get("missing", []) + outcome.report.get("unexpected", [])
    reported = [key for key in reported if canonical_name(key) not in judgement.redundant_tensors]
    return explained | {canonical_name(key).rpartition(".")[0] for key in reported}


def judge_effective_weights(
    judgement, engine: str, worker: EngineProcess, outcome, held: dict, basis: tuple[dict | None, str] | None = None
) -> None:
    """Run the basis on `engine` (which holds `held`, its weights under checkpoint names) and judge
    what each Linear applies: one `post-load` finding naming every module that differs;
    `outcome.effective_weights` says what was probed. `basis`: (inputs, why none) of another load of
    the reference (an engine option's, Judgement.variant_bases); default the checkpoint's own."""
    basis, reason = basis if basis is not None else (judgement.basis, judgement.basis_reason)
    if basis is None:
        outcome.effective_weights = f"not run: {reason}"
        return
    explained = already_explained(judgement, engine, outcome)
    names = sorted(key.removesuffix(".basis") for key in basis if key.endswith(".basis"))
    # a held weight of another shape (a scalar placeholder, a transposed or padded layout) is the
    # weight judgement's: the basis probes what a 2-D [out, in] weight applies; a Linear with a
    # static input scale is the activation probe's (see the module's docstring)
    width = {n: basis[f"{n}.basis"].shape[1] for n in names}
    judged = [
        n
        for n in names
        if n not in explained
        and f"{n}.weight" in held
        and held[f"{n}.weight"].dim() == 2
        and held[f"{n}.weight"].shape[1] == width[n]
        and not bool(basis.get(f"{n}.static", torch.zeros(1, dtype=torch.bool)).any())
    ]
    if not judged:
        outcome.effective_weights = (
            "not run: no Linear left to probe (its weights or load report already a finding, or a static "
            "input scale: the activation probe's)"
        )
        return
    sent = {n: basis[f"{n}.basis"] for n in judged} | {k: v for k, v in basis.items() if k.endswith(LEAD)}
    try:
        outputs = worker.probe(sent, judgement.scratch_file(engine, "basis"))
    except EngineError as error:
        outcome.effective_weights = f"not run: {first_line(error)}"
        return
    differing, found = [], [n for n in judged if n in outputs]
    for name in found:
        dtype = basis[f"{name}.basis"].dtype
        verdict = judge_module(name, outputs[name], held[f"{name}.weight"], held.get(f"{name}.bias"), basis, dtype)
        if verdict is not None:
            differing.append(verdict)
    # routed experts by their per-expert names: an engine that packs them holds no Linear by that name
    absent = [n for n in judged if n not in outputs and f"{n}.expert" not in basis]
    outcome.effective_weights = f"{len(found) - len(differing)}/{len(found)} Linear(s) apply the weights placed" + (
        f"; {len(absent)} not run by this engine by that name" if absent else ""
    )
    if differing:
        coarser = coarser_arithmetic(differing, outputs, held, basis)
        judgement.finding(
            engine,
            "post-load",
            describe(differing, len(found)) + (f"; every one fits {coarser} arithmetic" if coarser else ""),
            module=differing[0]["module"],
            metrics={"probe": "basis", "modules": [d["module"] for d in differing], "worst": differing[0]},
        )


def coarser_arithmetic(differing: list[dict], outputs: dict, held: dict, basis: dict) -> str | None:
    """The finest dtype coarser than the model's (float16, then bfloat16) whose bound every
    differing module's applied weights fit: a kernel that computes in that dtype (a precision it
    chose, not a weight read wrong); None when there is none."""
    dtypes = {basis[f"{d['module']}.basis"].dtype for d in differing}
    if "shape" in differing[0] or len(dtypes) != 1:
        return None
    coarser = {torch.float32: (torch.float16, torch.bfloat16), torch.float16: (torch.bfloat16,)}.get(dtypes.pop(), ())
    for dtype in coarser:
        fits = all(
            judge_module(
                d["module"],
                outputs[d["module"]],
                held[f"{d['module']}.weight"],
                held.get(f"{d['module']}.bias"),
                basis,
                dtype,
            )
            is None
            for d in differing
        )
        if fits:
            return str(dtype).removeprefix("torch.")
    return None


def describe(differing: list[dict], probed: int) -> str:
    first = differing[0]
    if "shape" in first:
        detail = f"applies a weight of shape {first['shape']} where it placed {first['held_shape']}"
    else:
        ratio = f"; applied / placed: median {first['ratio']:.3g}" if first["ratio"] is not None else ""
        nonfinite = f", {first['nonfinite']} non-finite" if first["nonfinite"] else ""
        detail = (
            f"{first['elements']}/{first['judged']} probed elements beyond bound{nonfinite}, "
            f"in rows {first['rows']}{ratio}"
        )
    return (
        f"after loading: {len(differing)}/{probed} Linear(s) apply other weights than their loader placed "
        f"(basis inputs), e.g. {first['module']}: {detail}"
    )
