"""Tensor-parallel sharding without several devices (docs/tensor-parallel.md).

vLLM's parallel Linears of one decoder layer are built under a mocked rank for each tp size and
rank, inside vLLM's interpreter (`worker`, started through `harness.engines.process`); what each
rank holds is judged against the slice of the reference it must own (`judge`, `layout`). A layer
with routed experts is also placed at expert-parallel sizes (vLLM's enable_expert_parallel: each
rank owns whole experts).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import HarnessError, first_line
from harness.engines.vllm.tensor_parallel.layout import EP, TP

#: the worker, as an engine spec `harness.engines.worker` can host
WORKER_SPEC = "harness.engines.vllm.tensor_parallel.worker:TensorParallelShards"
EXACT, FINDING, REFUSED = "exact", "finding", "refused"


class LaneRefused(HarnessError):
    """vLLM refuses the checkpoint on purpose before any layer is built (its config's check of the
    quantization method, e.g. a model dtype the method declines): its words."""


@dataclass
class TpOutcome:
    """One tp (or ep) size: exact (every rank of every Linear), refused (vLLM would not load the
    layer at this size: its reasons), or finding (some rank holds values other than its slice)."""

    tp: int
    status: str
    reasons: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    parallel: str = TP  # or EP: expert parallelism (layout)

    def line(self) -> str:
        if self.status == EXACT:
            return f"{self.parallel} {self.tp}: exact"
        text = f"{self.parallel} {self.tp}: {self.status}"
        if self.status == FINDING and self.reasons:
            text += " (latent: vLLM refuses another Linear of the layer at this size)"
        return text


@dataclass
class TpResult:
    directory: str
    vllm: str
    outcomes: list[TpOutcome]
    verdicts: list
    kernel_notes: list[str]
    #: with `post_load`: each dense Linear after its method's processing (post_load.PostLoadVerdict)
    post_load: list = field(default_factory=list)

    @property
    def findings(self) -> bool:
        return any(o.status == FINDING for o in self.outcomes)

    def to_json(self) -> dict:
        return {
            "checkpoint": self.directory,
            "vllm": self.vllm,
            "outcomes": [o.__dict__ for o in self.outcomes],
            "ranks": [v.__dict__ for v in self.verdicts],
            "kernel_notes": self.kernel_notes,
            "post_load": [v.__dict__ for v in self.post_load],
        }


def lane_judges(fmt, knobs) -> bool:
    """Whether the lane can judge this format's shards: tensors that hold each output row on its own
    (sliced and compared byte for byte, and through the weight they decode to), with at most some
    packed across rows (compressed-tensors' asymmetric zero points, 8 rows a word: a rank's rows can
    start inside a word, so each rank's are judged by their unpacked values and through the weight
    its tensors decode to), or GPTQ/AWQ's (outputs along dim 1, packed along both axes: judged
    through the weight each rank's tensors decode to)."""
    from harness.engines.gptqmodel_modules import MARKER

    return fmt.splits_by_rows(knobs) or bool(fmt.packed_across_rows(knobs)) or fmt.marker == MARKER


def parse_tp_sizes(text: str, option: str = "--tp-sizes") -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise HarnessError(f"{option} {text!r}: expected comma-separated integers, e.g. 2,4") from None
    if not sizes or any(size < 1 for size in sizes):
        raise HarnessError(f"{option} {text!r}: expected sizes >= 1, e.g. 2,4")
    return sorted(set(sizes))


def check_tensor_parallel(
    directory: str | Path,
    tp_sizes: list[int],
    layer: int = 0,
    work: Path | None = None,
    process=None,
    ep_sizes: list[int] = (),
    placement: str = "linear",
    post_load: bool = False,
):
    """Shard one decoder layer at each tp size in vLLM and judge every rank; with routed experts in
    the layer, also place its experts at each expert-parallel size in `ep_sizes` by vLLM's
    expert_placement_strategy `placement` (linear or round_robin); a TpResult. With `post_load`,
    each dense Linear is also processed after loading and judged (harness.engines.vllm.post_load).
    `process`: a started EngineProcess hosting WORKER_SPEC to use (left running), else one of its own."""
    from harness.engines.vllm.post_load import judge_post_load
    from harness.engines.vllm.tensor_parallel.judge import judge, load_truth, shards_from_worker
    from harness.engines.vllm.tensor_parallel.layout import decoder_linears, sparse

    directory = Path(directory)
    truth = load_truth(directory, layer)  # a CheckpointError (exit 2) for an unusable checkpoint
    try:
        decoder_linears(truth.config, layer)
    except (KeyError, ValueError) as error:
        raise HarnessError(f"{directory}: cannot lay out its decoder layer ({error})") from None
    if not any(name.startswith(f"model.layers.{layer}.") for name in truth.raw):
        raise HarnessError(f"{directory}: no tensors of decoder layer {layer}")
    ep_sizes = sorted(set(ep_sizes)) if sparse(truth.config, layer) else []
    with tempfile.TemporaryDirectory(prefix="tp-shards-") as scratch:
        report, tensors = run_worker(
            directory, tp_sizes, layer, Path(scratch), work, process, ep_sizes, placement, post_load
        )
    verdicts = judge(shards_from_worker(report, tensors, truth.config), truth, ep_sizes)
    outcomes = summarize(verdicts, tp_sizes) + summarize(verdicts, ep_sizes, EP)
    processed = judge_post_load(report, tensors, truth) if post_load else []
    return TpResult(str(directory), report["vllm"], outcomes, verdicts, report["kernel_notes"], processed)


def run_worker(
    directory: Path,
    tp_sizes: list[int],
    layer: int,
    scratch: Path,
    work: Path | None,
    process=None,
    ep_sizes=(),
    placement: str = "linear",
    post_load: bool = False,
):
    from harness.engines.process import EngineError, EngineFailure, EngineProcess, Limits
    from harness.engines.vllm.engine import find_vllm_python

    job = scratch / "job.json"
    job.write_text(
        json.dumps(
            {
                "checkpoint": str(directory.resolve()),
                "tp_sizes": tp_sizes,
                "ep_sizes": list(ep_sizes),
                "layer": layer,
                "placement": placement,
                "post_load": post_load,
            }
        )
    )
    own = process is None
    if own:
        python = find_vllm_python()
        if python is None:
            raise HarnessError("no Python with vLLM found (set HARNESS_VLLM_PYTHON, or build it: tox -e vllm-cpu)")
        log = (work or scratch) / "tp-shards-worker.log"
        process = EngineProcess(WORKER_SPEC, python, log, Limits(timeout_s=600, memory_mb=8000))
    try:
        if own:
            process.start()
        report = process.load(job)
        tensors = process.weights(scratch / "held.safetensors")
    except EngineError as error:
        if error.refuses:  # vLLM refuses the checkpoint on purpose (a check of its method)
            raise LaneRefused(str(error).removeprefix("EngineRefuses: ")) from None
        raise HarnessError(f"the vLLM worker failed: {first_line(error)} (log: {process.log_path})") from None
    except EngineFailure as error:
        raise HarnessError(f"the vLLM worker failed: {first_line(error)} (log: {process.log_path})") from None
    finally:
        if own:
            process.close()
    return report, tensors


def summarize(verdicts: list, sizes: list[int], parallel: str = TP) -> list[TpOutcome]:
    """Per tp (or ep) size: its findings (one line per rank and Linear) and vLLM's refusals (one
    line per Linear and reason, naming the ranks)."""
    from harness.core.spans import ranges

    outcomes = []
    for tp in sizes:
        mine = [v for v in verdicts if v.tp == tp and v.parallel == parallel]
        refusals: dict[tuple[str, str], list[int]] = {}
        for verdict in mine:
            if verdict.status == REFUSED:
                refusals.setdefault((verdict.module, verdict.details[0]), []).append(verdict.rank)
        reasons = [f"{module} (rank {ranges(ranks)}): {reason}" for (module, reason), ranks in refusals.items()]
        findings = [v.line() for v in mine if v.status == FINDING]
        status = FINDING if findings else REFUSED if reasons else EXACT
        outcomes.append(TpOutcome(tp, status, reasons, findings, parallel))
    return outcomes
