"""Peak memory of `python -m harness dequant` against the size of what it writes.

Generates one FP8 block-scaled Llama (default 8 layers, hidden 1024, intermediate 2816: 278 MiB
of float32 output, as recorded in benchmarks/results/) with `python -m harness gen`, then runs
`python -m harness dequant` on it in a child process that reports its own peak RSS at exit
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`, after `harness.commands.cli.main` returns). A bounded-memory writer holds one tensor (and
its float64 working set), not the whole output. A measurement, not a test: nothing asserts.

    .venv/bin/python benchmarks/bench_dequant_memory.py [--layers 8] [--label after]

Appends one record to benchmarks/results/dequant-memory-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, machine_tag  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


#: `python -m harness ARGS` that prints its peak RSS in KiB as its last stderr line
MEASURED_CLI = (
    "import resource, sys; from harness.commands.cli import main; code = main(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)"
)


def run(args: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of `python -m harness ARGS` in a child process."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", MEASURED_CLI, *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if result.returncode:
        sys.exit(f"harness {args[0]} failed: {result.stderr.strip().splitlines()[-2:]}")
    return time.monotonic() - start, int(result.stderr.strip().splitlines()[-1]) / 1024


def git_revision() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "harness"], capture_output=True, text=True, cwd=ROOT)
    return result.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--label", default="", help="a name for this record (e.g. before/after a change)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        checkpoint, out = Path(work) / "ckpt", Path(work) / "dequant.safetensors"
        gen_s, _ = run(
            [
                "gen",
                "--format",
                "fp8-block",
                "--arch",
                "llama",
                "--seed",
                "0",
                "--out",
                str(checkpoint),
                "--set",
                f"num_hidden_layers={args.layers}",
                "--set",
                f"hidden_size={args.hidden}",
                "--set",
                f"intermediate_size={args.intermediate}",
            ]
        )
        dequant_s, peak = run(["dequant", str(checkpoint), "--out", str(out)])
        stored = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
        record = {
            "label": args.label,
            "revision": git_revision(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg()},
            "checkpoint": {
                "format": "fp8-block",
                "layers": args.layers,
                "hidden": args.hidden,
                "intermediate": args.intermediate,
                "stored_mib": stored / 2**20,
            },
            "output_mib": out.stat().st_size / 2**20,
            "dequant_s": dequant_s,
            "gen_s": gen_s,
            "dequant_peak_rss_mib": peak,
        }
    path = ROOT / "benchmarks" / "results" / f"dequant-memory-{machine_tag()}.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(records + [record], indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
