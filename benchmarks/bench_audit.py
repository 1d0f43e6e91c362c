"""Peak memory and time of `python -m harness audit` on a multi-GB sharded checkpoint.

Generates one FP8 block-scaled Llama layer with `python -m harness gen` (default hidden 2048,
intermediate 5632, vocabulary 32000: a 125 MiB bfloat16 embedding and lm_head, the largest
tensors), then replicates that layer into `--layers` layers across shards of `--shard-mib`,
one tensor in memory at a time (the streaming writer), without the harness's manifest: a
checkpoint the harness did not write, 2.9 GiB in 3 shards at the defaults. `python -m harness
audit` then runs on it, on the one-layer checkpoint (the same largest tensors) and, for the
baseline (the interpreter, torch and the harness), on a tiny default checkpoint, each in a child
process that reports its own peak RSS (`ru_maxrss`, as benchmarks/bench_dequant_memory.py
measures). The audit streams: its peak should stay within the largest tensor + 512 MiB of that
baseline whatever the checkpoint's size. A measurement, not a test: nothing asserts.

    .venv/bin/python benchmarks/bench_audit.py [--layers 64] [--label after]

Appends one record to benchmarks/results/audit-<host>.json (1-2 minutes on 2 cores, 8 GB of
temporary disk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dequant_memory import git_revision, run  # noqa: E402
from machine import cpu_model, machine_tag  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYER = re.compile(r"^model\.layers\.0\.")


def generate(out: Path, args) -> float:
    settings = {
        "num_hidden_layers": 1,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "vocab_size": args.vocab,
        "num_attention_heads": args.hidden // 128,
        "num_key_value_heads": max(args.hidden // 1024, 1),
        "head_dim": 128,
    }
    command = ["gen", "--format", "fp8-block", "--arch", "llama", "--seed", "0", "--out", str(out)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    return run(command)[0]


def replicate(base: Path, out: Path, layers: int, shard_bytes: int) -> int:
    """Write `base`'s layer 0 as layers 0..layers-1 into shards of about `shard_bytes`, one
    tensor in memory at a time; the bytes written."""
    from harness.checkpoints.reader import INDEX_FILE, Checkpoint
    from harness.checkpoints.streaming import StreamingSafetensorsWriter

    source = Checkpoint(base)
    plan: list[tuple[str, str]] = []  # (name written, name in base)
    for name in source.names():
        if LAYER.match(name):
            plan += [(LAYER.sub(f"model.layers.{layer}.", name), name) for layer in range(layers)]
        else:
            plan.append((name, name))
    nbytes = {}
    for name in source.names():
        start, end = source.headers[source.shard_of(name)][name]["data_offsets"]
        nbytes[name] = end - start
    shards: list[list[tuple[str, str]]] = [[]]
    filled = 0
    for written, original in plan:
        if filled and filled + nbytes[original] > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append((written, original))
        filled += nbytes[original]
    out.mkdir()
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        with StreamingSafetensorsWriter(out / file, [w for w, _ in shard], {"format": "pt"}) as writer:
            for written, original in shard:
                writer.add(written, source.tensor(original))
                weight_map[written] = file
    total = sum(nbytes[original] for _, original in plan)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((base / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in base.glob("*.json"):
        if extra.name not in ("config.json", INDEX_FILE, "harness_manifest.json"):
            shutil.copy(extra, out / extra.name)
    return total


def largest_tensor_mib(directory: Path) -> float:
    from harness.checkpoints.reader import Checkpoint

    checkpoint = Checkpoint(directory)
    largest = 0
    for header in checkpoint.headers.values():
        for entry in header.values():
            largest = max(largest, entry["data_offsets"][1] - entry["data_offsets"][0])
    return largest / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mib", type=int, default=1024)
    parser.add_argument("--label", default="", help="a name for this record (e.g. before/after a change)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as work:
        base, big = Path(work) / "base", Path(work) / "big"
        tiny = Path(work) / "tiny"
        run(["gen", "--format", "fp8-block", "--arch", "llama", "--seed", "0", "--out", str(tiny)])
        tiny_s, tiny_peak = run(["audit", str(tiny)])
        gen_s = generate(base, args)
        stored = replicate(base, big, args.layers, args.shard_mib * 2**20)
        one_s, one_peak = run(["audit", str(base)])
        shutil.rmtree(base)
        audit_s, peak = run(["audit", str(big)])
        largest = largest_tensor_mib(big)
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
                "vocab": args.vocab,
                "shards": len(list(big.glob("model-*.safetensors"))),
                "stored_mib": stored / 2**20,
                "largest_tensor_mib": largest,
            },
            "gen_one_layer_s": gen_s,
            "audit_s": audit_s,
            "audit_peak_rss_mib": peak,
            "one_layer_audit_s": one_s,
            "one_layer_peak_rss_mib": one_peak,
            "baseline_tiny_audit_s": tiny_s,
            "baseline_tiny_peak_rss_mib": tiny_peak,
            "bound_mib": tiny_peak + largest + 512,
        }
    path = ROOT / "benchmarks" / "results" / f"audit-{machine_tag()}.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(records + [record], indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
