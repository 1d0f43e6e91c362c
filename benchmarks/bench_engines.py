"""Examples per second of the differential harness, per engine, next to the engine's bare cost.

Not a test: it asserts nothing about speed. In one run, on the same N generated checkpoints
(`--format`, `--arch`, seeds 0..N-1, the architecture's default tiny sizes):

(a) harness: `harness.differential.runner.evaluate` with one persistent `EngineSession` (a worker
    subprocess per engine, as `quant-load-harness` and the pytest plugin run it), once with
    `engines=[engine]` and once with `engines=["reference", engine]` (the pair the harness
    really runs: logits are judged against the reference). Checkpoint 0 is the warm-up (worker
    start and the engine's lazy imports; reported as startup seconds); examples/s counts
    checkpoints 1..N-1. Each request to a worker and the parent-side steps of `evaluate`
    (truth read, weight comparisons, log-prob comparison) are timed by wrapping them in this
    process, so the per-example seconds split into where they went.
(b) bare: in a fresh subprocess under the interpreter that engine's worker uses, only the
    engine's own load plus one forward over the same probe sequences, then freeing the model
    (no harness, no weights read back, no comparisons, no generation); checkpoint 0 is the
    warm-up, 1..N-1 are timed inside that subprocess.

overhead = harness seconds per example / bare seconds per example (for the pair row, also over
the sum of the two bare costs).

Engines run one after another (reference first), each as: warm-up, harness row(s), bare run, so
that the two sides of a ratio are measured minutes, not a whole run, apart. The machine may be
shared: each phase records the load average and the CPU cores busy with other processes
(/proc/stat minus this run's own processes). `--threads N` sets OMP_NUM_THREADS for the run,
its workers and its bare runs (torch otherwise uses one thread per core, which a busy machine
punishes hard on a model this small).

    .venv/bin/python benchmarks/bench_engines.py                    # all four engines, 5 checkpoints
    .venv/bin/python benchmarks/bench_engines.py --threads 1 --out benchmarks/results/engines-vm-threads1.json
    .venv/bin/python benchmarks/bench_engines.py --engines reference,transformers --examples 3

Results go to a JSON file (default benchmarks/results/engines-<host>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from machine import cpu_model, machine_tag  # noqa: E402  (benchmarks/ is the script directory)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_ENGINES = "reference,transformers,compressed-tensors,vllm"
#: the steps of one evaluate() (worker requests, timed as the parent waits on them; parent-side
#: reads and comparisons) -> what they are for
LOAD, WEIGHTS, COMPARE = (
    "load (frees the previous model first)",
    "weights out (engine -> safetensors -> parent)",
    "weights compared with the truth",
)
LOGPROBS, GENERATE, OTHER = "logprobs 3x24 (+ transfer, comparison)", "generate 8 tokens", "other"
GROUPS = {
    "worker:load": LOAD,
    "worker:weights": WEIGHTS,
    "read:weights": WEIGHTS,
    "compare:weights": COMPARE,
    "worker:logprobs": LOGPROBS,
    "read:logprobs": LOGPROBS,
    "compare:logprobs": LOGPROBS,
    "compare:perplexity": LOGPROBS,
    "worker:generate": GENERATE,
    "worker:unsupported": OTHER,
    "read:truth": OTHER,
}


# ---------------------------------------------------------------- machine


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def source_state() -> dict:
    """The commit, and which harness files differ from it (the harness is measured as it is on disk)."""

    def git(*words):
        try:
            return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted": git("status", "--short", "--", "harness", "benchmarks").splitlines(),
    }


def machine_info() -> dict:
    import torch

    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return info


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    return {
        "mean": round(statistics.fmean(values), 4),
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
        "each": [round(v, 4) for v in values],
    }


class CpuMeter:
    """Who used the CPUs during a phase: the machine's busy time (/proc/stat) against this run's
    own (this process, its finished children, its live workers); the rest is other users."""

    def __init__(self, live_pids=lambda: []):
        self.live_pids = live_pids
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def sample(self) -> tuple[float, float, float] | None:
        try:
            values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
            busy = sum(values) - values[3] - values[4]  # all but idle and iowait
            times = os.times()
            mine = times.user + times.system + times.children_user + times.children_system
            for pid in self.live_pids():
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    mine += sum(int(v) for v in fields[11:15]) / self.tick  # utime stime cutime cstime
                except OSError:
                    pass
            return time.perf_counter(), busy / self.tick, mine
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def between(start, end) -> dict:
        if start is None or end is None or end[0] <= start[0]:
            return {}
        wall, busy, mine = end[0] - start[0], end[1] - start[1], end[2] - start[2]
        return {
            "machine_busy_cores": round(busy / wall, 2),
            "this_run_cores": round(mine / wall, 2),
            "others_cores": round(max(0.0, busy - mine) / wall, 2),
        }


# ---------------------------------------------------------------- (b) bare engine, in a child process


def bare_child(spec_path: str) -> int:
    """Runs under the engine's interpreter: import, then load + one forward per checkpoint."""
    spec = json.loads(Path(spec_path).read_text())
    engine, directories, sequences = spec["engine"], spec["directories"], spec["sequences"]
    t0 = time.perf_counter()
    import gc

    import torch

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if engine == "vllm":
        # as harness/engines/vllm/engine.py: the engine core in this process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        if engine == "compressed-tensors":
            from compressed_tensors.compressors import ModelCompressor
            from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
            from safetensors.torch import load_file
        elif engine == "reference":
            from harness.oracle.reference import dequantize_checkpoint
    import_s = time.perf_counter() - t0

    def config_of(directory):
        raw = json.loads((Path(directory) / "config.json").read_text())
        return raw, raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"

    def hf_config(directory):
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        return config

    def load(directory):
        raw, dtype_name = config_of(directory)
        dtype = dtypes[dtype_name]
        if engine == "transformers":
            return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
        if engine == "reference":
            weights = {name: tensor.to(dtype) for name, tensor in dequantize_checkpoint(directory)}
            model = AutoModelForCausalLM.from_config(hf_config(directory), dtype=dtype).eval()
            model.load_state_dict(weights, strict=False)
            return model
        if engine == "compressed-tensors":  # ct_engine.py's load, minus the harness
            quantization = QuantizationConfig.model_validate(raw["quantization_config"])
            model = AutoModelForCausalLM.from_config(hf_config(directory), dtype=dtype).eval()
            apply_quantization_config(model, quantization)
            compressor = ModelCompressor(quantization_config=quantization)
            compressor.compress_model(model)
            state = {}
            for shard in sorted(Path(directory).glob("*.safetensors")):
                state.update(load_file(str(shard)))
            model.load_state_dict(state, strict=False)
            compressor.decompress_model(model)
            return model
        if engine == "vllm":  # the same LLM(...) arguments as vllm_engine.py
            return LLM(
                model=directory,
                tokenizer=directory,
                dtype=dtype_name,
                enforce_eager=True,
                max_model_len=min(256, raw.get("max_position_embeddings", 256)),
                kv_cache_memory_bytes=32 * 2**20,
                max_logprobs=raw["vocab_size"],
                seed=0,
                trust_remote_code=False,
            )
        raise ValueError(f"no bare path for engine {engine!r}")

    def forward(model, directory):
        if engine == "vllm":  # log-probs of the whole vocabulary at every prompt position, as the harness asks
            vocab = config_of(directory)[0]["vocab_size"]
            params = SamplingParams(max_tokens=1, prompt_logprobs=vocab, detokenize=False)
            outputs = model.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
            return len(outputs)
        with torch.no_grad():  # one batched forward over the probe sequences
            return model(input_ids=torch.tensor(sequences)).logits.shape[0]

    rows = []
    for directory in directories:
        t0 = time.perf_counter()
        model = load(directory)
        t1 = time.perf_counter()
        forward(model, directory)
        t2 = time.perf_counter()
        del model  # timed too: the harness's load request frees the previous model first,
        if (
            engine == "vllm"
        ):  # harness/engines/vllm/engine.py's unload also runs the collector (HF engines drop the reference)
            gc.collect()
        t3 = time.perf_counter()
        rows.append(
            {
                "checkpoint": Path(directory).name,
                "load_s": t1 - t0,
                "forward_s": t2 - t1,
                "unload_s": t3 - t2,
                "total_s": t3 - t0,
            }
        )
    Path(spec["out"]).write_text(
        json.dumps(
            {
                "import_s": import_s,
                "python": sys.executable,
                "torch": torch.__version__,
                "torch_num_threads": torch.get_num_threads(),
                "rows": rows,
            }
        )
    )
    return 0


def run_bare(engine: str, python: str, directories: list[Path], sequences, work: Path) -> dict:
    spec_path, out = work / f"bare-{engine}.json", work / f"bare-{engine}-result.json"
    spec_path.write_text(
        json.dumps(
            {"engine": engine, "directories": [str(d) for d in directories], "sequences": sequences, "out": str(out)}
        )
    )
    log = work / f"bare-{engine}.log"
    meter = CpuMeter()
    before = meter.sample()
    t0 = time.perf_counter()
    with log.open("wb") as sink:
        code = subprocess.call(
            [python, str(Path(__file__).resolve()), "--bare-child", str(spec_path)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            timeout=900,
        )
    wall = time.perf_counter() - t0
    cpu = CpuMeter.between(before, meter.sample())
    if code != 0 or not out.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        return {"python": python, "error": f"exit status {code}", "log_tail": tail, "process_wall_s": round(wall, 2)}
    result = json.loads(out.read_text())
    warmup, timed = result["rows"][0], result["rows"][1:]
    return {
        "python": python,
        "torch": result["torch"],
        "torch_num_threads": result["torch_num_threads"],
        "process_wall_s": round(wall, 2),
        "import_s": round(result["import_s"], 3),
        "warmup_s": round(warmup["total_s"], 3),
        "load_s": summary([r["load_s"] for r in timed]),
        "forward_s": summary([r["forward_s"] for r in timed]),
        "unload_s": summary([r["unload_s"] for r in timed]),
        "seconds_per_example": summary([r["total_s"] for r in timed]),
        "examples_per_s": round(len(timed) / sum(r["total_s"] for r in timed), 3) if timed else None,
        "cpu": cpu,
        "loadavg_after": loadavg(),
    }


# ---------------------------------------------------------------- (a) the harness, instrumented


class Clock:
    """Accumulates seconds per (engine, step) for the example being evaluated."""

    def __init__(self):
        self.current: dict[tuple[str, str], float] = defaultdict(float)

    def reset(self) -> dict[tuple[str, str], float]:
        taken, self.current = self.current, defaultdict(float)
        return taken


def instrument(clock: Clock) -> None:
    """Wrap EngineProcess.request and the parent-side steps of evaluate() (in this process only)."""
    from harness.differential import runner
    from harness.engines import REGISTRY
    from harness.engines.process import EngineProcess

    names = {spec: name for name, spec in REGISTRY.items()}
    request = EngineProcess.request

    def timed_request(self, op, timeout_s=None, **payload):
        t0 = time.perf_counter()
        try:
            return request(self, op, timeout_s, **payload)
        finally:
            clock.current[(names.get(self.spec, self.spec), f"worker:{op}")] += time.perf_counter() - t0

    EngineProcess.request = timed_request

    def wrap(function, step, engine_of):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                clock.current[(engine_of(args), step)] += time.perf_counter() - t0

        return timed

    import safetensors.torch

    # the harness imports load_file where it reads a file (process.py, manifest.py): patch its home
    load_file = safetensors.torch.load_file

    def timed_load_file(path, *args, **kwargs):
        name = Path(str(path)).name  # scratch files are <engine>-weights.safetensors, <engine>-logprobs...
        if "-weights" in name or "-logprobs" in name:
            step = "read:weights" if "-weights" in name else "read:logprobs"
            owner = name.split("-weights")[0].split("-logprobs")[0]
        else:
            step, owner = "read:truth", "(parent)"
        t0 = time.perf_counter()
        try:
            return load_file(path, *args, **kwargs)
        finally:
            clock.current[(owner, step)] += time.perf_counter() - t0

    safetensors.torch.load_file = timed_load_file
    from harness.checkpoints import manifest

    manifest.load_file = timed_load_file  # the truth (imported by name there)
    # where runner.py has been reorganised, a step it no longer has lands in "(parent) other"
    for attribute, step, engine_of in (
        ("_judge_weights", "compare:weights", lambda a: a[0]),
        ("compare_logprobs", "compare:logprobs", lambda a: "(parent)"),
        ("perplexity", "compare:perplexity", lambda a: "(parent)"),
    ):
        if callable(getattr(runner, attribute, None)):
            setattr(runner, attribute, wrap(getattr(runner, attribute), step, engine_of))
        else:
            print(
                f"note: harness.differential.runner has no {attribute}; its time is counted as other", file=sys.stderr
            )


def live_workers(session):
    return lambda: [w.process.pid for w in session.processes.values() if w.process and w.process.poll() is None]


def harness_row(label: str, engines: list[str], directories: list[Path], session, clock: Clock) -> dict:
    from harness.differential.runner import evaluate

    meter = CpuMeter(live_workers(session))
    before = meter.sample()
    examples = []
    for directory in directories:
        clock.reset()
        t0 = time.perf_counter()
        result = evaluate(directory, session, engines=engines)
        wall = time.perf_counter() - t0
        steps = clock.reset()
        statuses = {e: o.status + (f" ({o.detail[:120]})" if o.detail else "") for e, o in result.outcomes.items()}
        examples.append(
            {
                "checkpoint": directory.name,
                "wall_s": wall,
                "steps": steps,
                "statuses": statuses,
                "findings": [f"{f.engine}: {f.kind}: {f.message[:160]}" for f in result.findings],
            }
        )
    cpu = CpuMeter.between(before, meter.sample())
    walls = [e["wall_s"] for e in examples]
    keys = sorted({k for e in examples for k in e["steps"]})
    breakdown = {}
    for key in keys:
        breakdown[" ".join(key)] = round(statistics.fmean(e["steps"].get(key, 0.0) for e in examples), 4)
    attributed = statistics.fmean(sum(e["steps"].values()) for e in examples)
    breakdown["(parent) other"] = round(statistics.fmean(walls) - attributed, 4)
    grouped = defaultdict(float)
    for (_, step), seconds in ((k, v) for e in examples for k, v in e["steps"].items()):
        grouped[GROUPS.get(step, OTHER)] += seconds / len(examples)
    grouped[OTHER] += breakdown["(parent) other"]
    return {
        "row": label,
        "engines": engines,
        "seconds_per_example": summary(walls),
        "examples_per_s": round(len(walls) / sum(walls), 3),
        "breakdown_mean_s": breakdown,
        "grouped_mean_s": {group: round(grouped.get(group, 0.0), 4) for group in dict.fromkeys(GROUPS.values())},
        "statuses": examples[-1]["statuses"],
        "findings": sorted({f for e in examples for f in e["findings"]}),
        "cpu": cpu,
        "loadavg_after": loadavg(),
    }


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=DEFAULT_ENGINES)
    parser.add_argument("--format", default="ct-fp8-channel", help="every engine supports it on this CPU")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--examples", type=int, default=5, help="checkpoints (seeds 0..N-1); the first is the warm-up")
    parser.add_argument("--out", default=None, help="default benchmarks/results/engines-<host>.json")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="set OMP_NUM_THREADS for this run, its workers and bare runs (default: leave as is)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and worker logs")
    parser.add_argument("--bare-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_child:
        return bare_child(args.bare_child)
    if args.examples < 2:
        parser.error("--examples must be at least 2 (the first is the warm-up)")
    if args.threads:  # before torch is imported here; workers and bare runs inherit the environment
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate
    from harness.differential.judgement import probe_sequences
    from harness.differential.runner import EngineSession
    from harness.engines.environments import engine_python
    from harness.engines.process import Limits

    started = time.perf_counter()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"engines-{machine_tag()}.json"
    report = {
        "benchmark": "bench_engines",
        "command": " ".join([Path(sys.executable).name, "benchmarks/bench_engines.py", *(argv or sys.argv[1:])]),
        "settings": {
            "engines": engines,
            "format": args.format,
            "arch": args.arch,
            "examples": args.examples,
            "seeds": list(range(args.examples)),
            "timed_examples": args.examples - 1,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "machine": machine_info(),
        "source": source_state(),
        "loadavg_start": loadavg(),
    }
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if report["loadavg_start"][0] > 0.5 * cores:
        print(
            f"warning: load average {report['loadavg_start']} on {cores} cores: figures will be inflated",
            file=sys.stderr,
        )

    temporary = tempfile.TemporaryDirectory(prefix="bench-engines-")
    work = Path(temporary.name)
    t0 = time.perf_counter()
    directories = []
    for seed in range(args.examples):
        directory = work / f"{args.format}-{args.arch}-seed{seed}"
        manifest = generate(Recipe(format=args.format, arch=args.arch, seed=seed), directory)
        directories.append(directory)
    config = json.loads((directories[0] / "config.json").read_text())
    sequences = probe_sequences(int(config.get("vocab_size", 260)))
    report["checkpoints"] = {
        "generate_s_total": round(time.perf_counter() - t0, 3),
        "expectation": manifest["expectation"],
        "config": {
            k: config.get(k)
            for k in (
                "model_type",
                "hidden_size",
                "num_attention_heads",
                "head_dim",
                "intermediate_size",
                "num_hidden_layers",
                "vocab_size",
                "dtype",
            )
        },
        "bytes_each": sum(f.stat().st_size for f in directories[0].glob("*.safetensors")),
        "probe": {"sequences": len(sequences), "tokens": len(sequences[0])},
    }
    print(
        f"{args.examples} checkpoints ({args.format}, {args.arch}) in {report['checkpoints']['generate_s_total']} s",
        flush=True,
    )

    clock = Clock()
    instrument(clock)
    session = EngineSession(
        engines if "reference" in engines else ["reference", *engines], work / "session", Limits(timeout_s=600)
    )
    warmup, timed = directories[0], directories[1:]
    report["startup"], report["harness"], report["bare"] = {}, [], {}

    def start(engine: str) -> bool:
        """Worker start plus the first evaluate (the engine's lazy imports): the warm-up."""
        from harness.differential.runner import evaluate

        t0 = time.perf_counter()
        worker = session.process(engine)
        worker_s = time.perf_counter() - t0
        if worker is None:
            report["startup"][engine] = {"unavailable": session.unavailable[engine]}
            print(f"{engine}: unavailable: {session.unavailable[engine]}", flush=True)
            return False
        meter = CpuMeter(live_workers(session))
        before = meter.sample()
        t1 = time.perf_counter()
        result = evaluate(warmup, session, engines=[engine])
        clock.reset()
        first_s = time.perf_counter() - t1
        cpu = CpuMeter.between(before, meter.sample())
        outcome = result.outcomes[engine]
        report["startup"][engine] = {
            "python": worker.python,
            "version": session.versions.get(engine),
            "worker_start_s": round(worker_s, 3),
            "first_example_s": round(first_s, 3),
            "startup_s": round(worker_s + first_s, 3),
            "status": outcome.status,
            "detail": outcome.detail,
            "first_example_cpu": cpu,
        }
        print(f"{engine}: worker start {worker_s:.1f} s, first example {first_s:.1f} s ({outcome.status})", flush=True)
        return outcome.status == "loaded"

    # per engine, adjacent in time: warm-up, its harness row(s), then its bare run
    order = ["reference"] + [e for e in engines if e != "reference"]
    usable = {}
    try:
        for engine in order:
            usable[engine] = start(engine)
            if not usable[engine]:
                continue
            rows = [(engine, [engine])] if engine in engines else []
            if engine != "reference" and usable.get("reference"):
                rows.append((f"reference+{engine}", ["reference", engine]))
            for label, row_engines in rows:
                row = harness_row(label, row_engines, timed, session, clock)
                report["harness"].append(row)
                print(
                    f"harness [{label}]: {row['seconds_per_example']['mean']:.3f} s/example, "
                    f"{row['examples_per_s']} examples/s; cores used by others {row['cpu'].get('others_cores')}",
                    flush=True,
                )
            python, how = engine_python(engine)
            bare = run_bare(engine, python, directories, sequences, work)
            bare["interpreter_chosen_by"] = how
            report["bare"][engine] = bare
            if "error" in bare:
                print(f"bare {engine}: {bare['error']}\n{bare['log_tail']}", flush=True)
            else:
                print(
                    f"bare {engine}: import {bare['import_s']:.1f} s, {bare['seconds_per_example']['mean']:.3f} "
                    f"s/example (load {bare['load_s']['mean']:.3f} + forward {bare['forward_s']['mean']:.3f} + unload "
                    f"{bare['unload_s']['mean']:.3f}); "
                    f"cores used by others {bare['cpu'].get('others_cores')}",
                    flush=True,
                )
    finally:
        session.close()

    def bare_mean(engine):
        bare = report["bare"].get(engine, {})
        return bare.get("seconds_per_example", {}).get("mean")

    overhead = []
    for row in report["harness"]:
        engine = row["engines"][-1]
        bare_engine = bare_mean(engine)
        entry = {
            "row": row["row"],
            "harness_s_per_example": row["seconds_per_example"]["mean"],
            "harness_examples_per_s": row["examples_per_s"],
            "startup_s": report["startup"][engine]["startup_s"],
            "bare_s_per_example": bare_engine,
        }
        if bare_engine:
            entry["overhead_vs_bare_engine"] = round(row["seconds_per_example"]["mean"] / bare_engine, 2)
            entry["overhead_vs_bare_engine_best"] = round(
                row["seconds_per_example"]["min"] / report["bare"][engine]["seconds_per_example"]["min"], 2
            )
            entry["overhead_vs_bare_engine_medians"] = round(
                row["seconds_per_example"]["median"] / report["bare"][engine]["seconds_per_example"]["median"], 2
            )
        if len(row["engines"]) == 2 and bare_engine and bare_mean("reference"):
            both = bare_engine + bare_mean("reference")
            entry["bare_s_per_example_reference_plus_engine"] = round(both, 4)
            entry["overhead_vs_bare_reference_plus_engine"] = round(row["seconds_per_example"]["mean"] / both, 2)
        overhead.append(entry)
    report["overhead"] = overhead
    report["loadavg_end"] = loadavg()
    report["total_s"] = round(time.perf_counter() - started, 1)
    if args.keep:
        report["work"] = str(work)
        temporary._finalizer.detach()
    else:
        temporary.cleanup()

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(f"{'row':32} {'harness s/ex':>12} {'ex/s':>7} {'bare s/ex':>10} {'overhead':>9} {'startup s':>10}")
    for entry in overhead:
        ratio = entry.get("overhead_vs_bare_reference_plus_engine", entry.get("overhead_vs_bare_engine"))
        print(
            f"{entry['row']:32} {entry['harness_s_per_example']:12.3f} {entry['harness_examples_per_s']:7.3f} "
            f"{entry['bare_s_per_example'] or float('nan'):10.3f} {ratio or float('nan'):8.2f}x "
            f"{entry['startup_s']:10.1f}"
        )
    print(
        f"load average {report['loadavg_start']} -> {report['loadavg_end']}; total {report['total_s']} s; "
        f"written to {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
