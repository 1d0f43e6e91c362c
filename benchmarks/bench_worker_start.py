"""What an engine worker costs to start: started afresh (`python -m harness.engines.worker`, every
import paid again) against forked from a zygote (harness.engines.zygote: torch and transformers
imported once).

Not a test: it asserts nothing about speed. Per engine and mode, `--starts` workers are started one
after another, each then loading one small generated checkpoint and computing one forward's
log-probabilities (the first load and forward import what the greeting did not), then closed (asked
to quit and waited for: what an engine session pays for every worker it ends). For the forked
mode the first start includes starting the zygote itself (its own row: `first`); the zygote and
one worker's resident memory are recorded. Engines whose interpreter is missing are skipped.

    .tox/ci/bin/python benchmarks/bench_worker_start.py                      # reference, transformers, compressed-tensors
    .tox/ci/bin/python benchmarks/bench_worker_start.py --engines vllm --starts 2 --format ct-fp8-channel

Results go to a JSON file (default benchmarks/results/worker-start-<host>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from machine import cpu_model, isa_class, machine_tag  # noqa: E402  (benchmarks/ is the script directory)

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.differential.runner import EngineSession
from harness.engines.process import resident_mb


def one_start(session: EngineSession, engine: str, checkpoint: Path, scratch: Path) -> dict:
    started = time.monotonic()
    worker = session.process(engine)
    if worker is None:
        raise RuntimeError(session.unavailable.get(engine, "cannot start"))
    greeted = time.monotonic()
    worker.load(checkpoint)
    loaded = time.monotonic()
    worker.logprobs([[1, 5, 9, 2, 7, 3]], scratch / f"{engine}.safetensors")
    done = time.monotonic()
    row = {
        "greeting_s": greeted - started,
        "first_load_s": loaded - greeted,
        "first_forward_s": done - loaded,
        "total_s": done - started,
        "forked": type(worker.process).__name__ == "ForkedWorker",
        "worker_rss_mb": resident_mb(worker.process.pid),
    }
    if row["forked"]:
        zygote = Path(f"/proc/{worker.process.pid}/stat").read_text().rpartition(")")[2].split()[1]
        row["zygote_rss_mb"] = resident_mb(int(zygote))
    closing = time.monotonic()
    worker.close()  # asked to quit, waited for until the zygote (or the OS) reaps it
    row["close_s"] = time.monotonic() - closing
    session.processes.pop(engine, None)
    return row


def measure(engine: str, mode: str, starts: int, checkpoint: Path, scratch: Path) -> dict:
    if mode == "fresh":
        os.environ["HARNESS_FORK_WORKERS"] = "0"
    else:
        os.environ.pop("HARNESS_FORK_WORKERS", None)
        os.environ["HARNESS_ZYGOTES"] = tempfile.mkdtemp(prefix="bench-zygotes-")  # a zygote of its own
    session = EngineSession([engine], scratch / f"{engine}-{mode}")
    try:
        rows = [one_start(session, engine, checkpoint, scratch) for _ in range(starts)]
    finally:
        session.close()
        os.environ.pop("HARNESS_FORK_WORKERS", None)
    later = rows[1:] or rows
    return {
        "engine": engine,
        "mode": mode,
        "first": rows[0],
        "later_total_s_median": statistics.median(r["total_s"] for r in later),
        "later_greeting_s_median": statistics.median(r["greeting_s"] for r in later),
        "close_s_median": statistics.median(r["close_s"] for r in rows),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="reference,transformers,compressed-tensors")
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument(
        "--format", default="ct-fp8-tensor", help="the checkpoint's format (one vLLM runs here for vllm)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / f"worker-start-{machine_tag()}.json"
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-worker-start-") as scratch:
        scratch = Path(scratch)
        checkpoint = scratch / "checkpoint"
        generate(Recipe(format=args.format, arch="llama", seed=1), checkpoint)
        for engine in args.engines.split(","):
            for mode in ("fresh", "forked"):
                try:
                    result = measure(engine, mode, args.starts, checkpoint, scratch)
                except RuntimeError as error:
                    print(f"{engine} {mode}: skipped ({error})")
                    break
                results.append(result)
                first = result["first"]
                print(
                    f"{engine:>18} {mode:>6}: first {first['total_s']:6.2f} s (greeting {first['greeting_s']:.2f}),"
                    f" later median {result['later_total_s_median']:6.2f} s"
                    f" (greeting {result['later_greeting_s_median']:.2f}), close {result['close_s_median']:.2f} s"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpu_model": cpu_model(),
        "isa": isa_class(),
        "cores": len(os.sched_getaffinity(0)),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
    }
    record = {"machine": machine, "starts": args.starts, "format": args.format, "results": results}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
