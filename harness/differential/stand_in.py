"""An engine with no kernel for a format on this machine still has loaders. Where vLLM says it
has none here (no FP8 block kernel without AMX tiles, no NVFP4 on CPU), its real loaders are run
on one device for the checkpoint's first decoder layer (and its first layer with routed experts),
the kernel choice alone stood in (harness.engines.vllm.tensor_parallel, the lane that also shards
them at tensor-parallel sizes), and what they place is judged against the truth: a loader that
raises on a checkpoint the format allows is a `load-error`, one that refuses it on purpose (a
check of the method or of a layer's shape, a ValueError while the layer is built) `refused-valid`,
one that places other values a `weight-mismatch`, each "with stand-in kernels". Each dense Linear
is then processed by its method's `process_weights_after_loading` and what it holds decoded to the
weight it applies (harness.engines.vllm.post_load): other weights are a `post-load` finding. The
kernel itself did not run: the engine stays `unsupported` for the forward, and its detail says what
its loaders and its methods' processing did."""

from __future__ import annotations

import re

from harness.core.errors import HarnessError, first_line
from harness.core.findings import normalise
from harness.engines.options import base_engine, split_engine
from harness.engines.process import EngineFailure
from harness.engines.vllm.tensor_parallel import LaneRefused, lane_judges

#: one device: the loaders as a single-GPU (or CPU) load runs them
ONE_DEVICE = [1]
#: the checkpoint part a refusal names: "weight_scale_inv of up_proj: RuntimeError: ..."
REFUSED_PART = re.compile(r"\bof (\w+):")
PREFIX = "with stand-in kernels (no kernel here)"
#: a layer refusing the checkpoint on purpose while it is built, as the lane reports it: its own
#: check (validate_fp8_block_shape's ValueError), or a bare assert where vLLM picks a quantization
#: method (a scheme it does not implement)
DELIBERATE = re.compile(r"in construct: (ValueError|AssertionError)\b")
#: a crash of vLLM's own weight loader on a part (a scale slice past its grid): a load error
CRASH = re.compile(r"in weight_loader: \w+ of \w+: RuntimeError: ")
#: the lane's own approximations of a model (its vocabulary modules, the names it feeds): what it
#: cannot place there is not said to be vLLM's (docs/tensor-parallel.md)
VOCABULARY = ("lm_head", "embed_tokens")
#: the tensor-parallel judge's words for a parameter no loader wrote (its name, group 1)
UNWRITTEN = re.compile(r"\d+ element\(s\) of (\w+) never written")


def judge_with_stand_in_kernels(judgement, engine: str, outcome) -> None:
    """Run `engine`'s loaders with stand-in kernels where it has no kernel here (its reason in
    `outcome.detail`), judge them, and say so in `outcome.detail`."""
    from harness.differential.relations import RELATIONS
    from harness.engines.vllm.capability import missing_kernel

    relation = RELATIONS["tensor-parallel"]
    if base_engine(engine) not in (relation.engines or ()) or not missing_kernel(outcome.detail):
        return
    if "quantization" in split_engine(engine)[1]:  # online quantization's layer-wise loader is its own
        outcome.detail += "; its online quantization was not run with stand-in kernels"
        return
    if base_engine(engine) != engine:  # another option changes no loader: the plain engine's are judged
        outcome.detail += f"; its loaders are judged with stand-in kernels as {base_engine(engine)}'s"
        return
    why = relation.inapplicable(judgement.config) or ("a hostile layout" if judgement.hazards else "")
    if not why and judgement.fmt is not None and not lane_judges(judgement.fmt, judgement.knobs or {}):
        why = f"{judgement.fmt.name} does not store each output row on its own"  # a format the lane cannot slice
    if not why and judgement.expectation == "refuse":
        why = "the checkpoint must be refused (a full load judges that)"
    if why:
        outcome.detail += f"; its loaders were not run with stand-in kernels: {why}"
        return
    results = _run(judgement, engine)
    if isinstance(results, LaneRefused):
        outcome.detail += f"; with stand-in kernels it refuses the checkpoint: {results}"
        _refusal(judgement, engine, f"{PREFIX}: {results}", {"stand_in": True})
        return
    if isinstance(results, str):
        outcome.detail += f"; its loaders were not run with stand-in kernels: {results}"
        return
    judged = _findings(judgement, engine, results)
    layers = ", ".join(str(layer) for layer in results)
    outcome.detail += (
        f"; its loaders, run with stand-in kernels on one device (layer {layers}; no kernel ran): {judged}"
    )


def distinct_layers(judgement) -> list[int]:
    """In a mixed checkpoint (harness.formats.mixed), the first decoder layer of each assignment
    of its Linears to config groups (a group naming one layer's MLP as Unsloth's NVFP4 releases do):
    the loaders choose a scheme per Linear there as well; none for any other checkpoint."""
    from harness.checkpoints.reader import Checkpoint
    from harness.formats.mixed_groups import layer_assignments

    if judgement.fmt is None or not judgement.fmt.groups(judgement.knobs):
        return []
    return sorted(layer_assignments(Checkpoint(judgement.directory).names(), judgement.knobs).values())


def _run(judgement, engine: str) -> dict | str | LaneRefused:
    from harness.engines.vllm.tensor_parallel import WORKER_SPEC, check_tensor_parallel
    from harness.engines.vllm.tensor_parallel.layout import first_sparse_layer

    layers = sorted({0, first_sparse_layer(judgement.config) or 0, *distinct_layers(judgement)})
    try:
        worker = judgement.session.helper(engine, WORKER_SPEC, "tensor-parallel")
        if worker is None:
            return judgement.session.unavailable.get(engine, f"{engine} unavailable")
        return {
            layer: check_tensor_parallel(
                judgement.directory, ONE_DEVICE, layer, judgement.scratch, worker, post_load=True
            )
            for layer in layers
        }
    except EngineFailure as failure:
        return f"the worker cannot start: {first_line(failure)}"
    except LaneRefused as refused:
        return refused
    except HarnessError as error:
        return first_line(error)
    except (KeyError, IndexError, ValueError, RuntimeError) as error:
        # the lane's judge meets a held layout it does not read (seen: an expert shard without a
        # `weight`): said in the engine's line, never a finding and never the end of a campaign
        return f"the stand-in judge does not read this layout ({type(error).__name__}: {error})"


def _findings(judgement, engine: str, results: dict) -> str:
    """One finding per Linear the loaders refuse or fill wrong; the tally."""
    from harness.engines.vllm.capability import missing_kernel
    from harness.engines.vllm.tensor_parallel import FINDING, REFUSED

    block = [judgement.knobs.get("block_rows"), judgement.knobs.get("block_cols")] if judgement.knobs else []
    counts = {"exact": 0, FINDING: 0, REFUSED: 0}
    seen: set[str] = set()  # one finding per cause: every expert refused alike is one refusal
    unjudged: list[str] = []
    unwritten: set[str] = set()  # parameters a loader never wrote, its weights otherwise exact
    approximated: set[str] = set()  # the lane's own vocabulary modules it could not place exactly
    for layer, result in results.items():
        for verdict in result.verdicts:
            if verdict.status != "exact" and any(name in verdict.module for name in VOCABULARY):
                approximated.add(verdict.module)
                continue
            unwritten |= set(verdict.placeholders)  # placeholders the judge excused: said, not judged
            if verdict.status == FINDING and not verdict.wrong and all(map(UNWRITTEN.fullmatch, verdict.details)):
                # only parameters never written that a forward applies (a bias): uninitialised outputs
                counts[FINDING] += 1
                message = f"{PREFIX}: layer {layer} {verdict.module}: {'; '.join(verdict.details)}"
                judgement.finding(engine, "weight-mismatch", message, metrics={"stand_in": True, "layer": layer})
                continue
            counts[verdict.status] = counts.get(verdict.status, 0) + 1
            if verdict.status == "exact":
                continue
            metrics = {"stand_in": True, "layer": layer, "tp": 1, "parallel": "tp", "kernel_notes": result.kernel_notes}
            if all(isinstance(b, int) for b in block):
                metrics["block"] = block
            cause = normalise(f"{verdict.status} {verdict.module} {'; '.join(verdict.details)}")
            if cause in seen:
                continue
            seen.add(cause)
            if verdict.status == REFUSED:
                detail = verdict.details[0]
                part = REFUSED_PART.search(detail)
                module = _checkpoint_module(judgement, layer, part.group(1) if part else verdict.module)
                if module:
                    metrics["shape"] = list(judgement.truth[f"{module}.weight"].shape)
                message = f"{PREFIX}: layer {layer} {verdict.module}: {detail}"
                if DELIBERATE.match(detail) and not missing_kernel(detail):
                    _refusal(judgement, engine, message, metrics, module)
                elif CRASH.match(detail):
                    judgement.finding(engine, "load-error", message, module=module, metrics=metrics)
                else:  # a kernel it lacks for that part too, or a refusal of the lane's approximations
                    unjudged.append(f"{verdict.module}: {detail}")
            else:
                for module, shape in verdict.wrong.items():
                    judgement.finding(
                        engine,
                        "weight-mismatch",
                        f"{PREFIX}: {module}: {'; '.join(verdict.details)}",
                        module=f"{module}.weight",
                        metrics=metrics | {"shape": shape},
                    )
    return _tally(counts, unjudged, approximated, unwritten) + _post_load(judgement, engine, results)


def _tally(counts: dict, unjudged: list[str], approximated: set[str], unwritten: set[str]) -> str:
    """What the stand-in lane judged, in one line: Linears placed exactly, refused or wrong, and
    what it said without judging."""
    from harness.engines.vllm.tensor_parallel import FINDING, REFUSED

    total = sum(counts.values())
    if counts[FINDING] == counts[REFUSED] == 0:
        tally = f"{total}/{total} Linear(s) placed exactly"
    else:
        tally = f"{counts['exact']}/{total} Linear(s) placed exactly, {counts[REFUSED]} refused, {counts[FINDING]} placed wrong"
    if unjudged:  # said, not judged
        tally += f" (refusals not judged: {'; '.join(unjudged[:3])}{'; ...' if len(unjudged) > 3 else ''})"
    if approximated:
        tally += f" (the lane's approximated vocabulary modules, not judged: {', '.join(sorted(approximated))})"
    if unwritten:
        tally += f" (parameters never written, not judged: {', '.join(sorted(unwritten))})"
    return tally


def _post_load(judgement, engine: str, results: dict) -> str:
    """One `post-load` finding per Linear whose method's processing after loading makes it apply
    other weights than the checkpoint's (harness.engines.vllm.post_load); the tally."""
    from harness.engines.vllm.post_load import EXACT, FINDING

    verdicts = [(layer, verdict) for layer, result in results.items() for verdict in result.post_load]
    if not verdicts:
        return ""
    block = [judgement.knobs.get("block_rows"), judgement.knobs.get("block_cols")] if judgement.knobs else []
    seen: set[str] = set()
    for layer, verdict in verdicts:
        if verdict.status != FINDING:
            continue
        cause = normalise(f"{verdict.module} {'; '.join(verdict.details)}")
        if cause in seen:
            continue
        seen.add(cause)
        modules = sorted(verdict.wrong)
        metrics = {"stand_in": True, "layer": layer, "tp": 1, "parallel": "tp", "method": verdict.method}
        metrics |= {"modules": modules} | ({"shape": verdict.wrong[modules[0]]} if modules else {})
        if all(isinstance(b, int) for b in block):
            metrics["block"] = block
        judgement.finding(
            engine,
            "post-load",
            f"{PREFIX}: after {verdict.method}.process_weights_after_loading: layer {layer} {verdict.module}: "
            + "; ".join(verdict.details),
            module=f"{modules[0]}.weight" if modules else None,
            metrics=metrics,
        )
    counts = {status: sum(v.status == status for _, v in verdicts) for status in (EXACT, FINDING)}
    tally = (
        f"; after its methods' processing (kernels' own steps not run): {counts[EXACT]}/{len(verdicts)} "
        f"apply the checkpoint's weights, {counts[FINDING]} other weights"
    )
    unjudged = sorted({f"{v.method}: {v.details[0]}" for _, v in verdicts if v.status not in (EXACT, FINDING)})
    if unjudged:
        tally += f", {len(verdicts) - counts[EXACT] - counts[FINDING]} not judged ({'; '.join(unjudged[:2])})"
    return tally


def _refusal(judgement, engine: str, message: str, metrics: dict, module: str | None = None) -> None:
    """A refusal on purpose: a finding where the checkpoint's expectation is to load exactly."""
    if judgement.expectation not in ("refuse", "exact-or-refuse"):
        judgement.finding(engine, "refused-valid", message, module=module, metrics=metrics)


def _checkpoint_module(judgement, layer: int, part: str) -> str | None:
    """The checkpoint's name of decoder layer `layer`'s module `part` (e.g. up_proj), if unique."""
    ending = f".{part}.weight"
    names = [n for n in judgement.truth if f"layers.{layer}." in n and n.endswith(ending) and ".experts." not in n]
    return names[0].removesuffix(".weight") if len(names) == 1 else None
