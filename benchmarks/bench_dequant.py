"""Throughput of the reference dequantizers on a real-size weight, next to a plain copy.

Not a test: it asserts nothing about speed. For each format it quantizes one random
bfloat16 [size, size] weight once (untimed), then times `fmt.dequantize` (float64 output)
and, in the same process on the same device, `Tensor.clone()` of a float64 [size, size]
tensor (the size of the dequantized result) and of the bfloat16 input, so that the ratio
dequantize / copy says how far the reference is from memory speed on this machine.

    .venv/bin/python benchmarks/bench_dequant.py                 # 8192 x 8192, CPU
    .venv/bin/python benchmarks/bench_dequant.py --size 2048 --repeat 3
    .venv/bin/python benchmarks/bench_dequant.py --device cuda   # where a GPU is present
    .venv/bin/python benchmarks/bench_dequant.py --profile       # where does the time go

Results go to a JSON file (default benchmarks/results/dequant-<host>.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from machine import cpu_model, machine_tag  # noqa: E402  (benchmarks/ is the script directory)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_FORMATS = "fp8-block,ct-fp8-block,ct-nvfp4,modelopt-nvfp4"
MIB = 1024 * 1024


# ---------------------------------------------------------------- machine and memory


def machine_info(device: torch.device) -> dict:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(device),
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 1024**3, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 1024**3, 1)
        info["cuda"] = torch.version.cuda
    return info


def rss_mib() -> float | None:
    """Current resident set size, from /proc/self/statm (Linux)."""
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return round(resident * os.sysconf("SC_PAGE_SIZE") / MIB, 1)


_PROCESS_PEAK_MIB = 0.0


def peak_rss_mib() -> float:
    """Peak RSS since the last `reset_peak_rss` (getrusage ru_maxrss; KiB on Linux, bytes on macOS)."""
    global _PROCESS_PEAK_MIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = round(peak / (MIB if sys.platform == "darwin" else 1024), 1)
    _PROCESS_PEAK_MIB = max(_PROCESS_PEAK_MIB, peak)
    return peak


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0: `5` into /proc/self/clear_refs), so
    the next `peak_rss_mib` is the peak of what ran in between. False where that is not possible."""
    peak_rss_mib()  # fold the peak so far into the process-wide maximum first
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_snapshot(device: torch.device) -> dict:
    snap = {"rss_mib": rss_mib(), "peak_rss_mib": peak_rss_mib()}
    if device.type == "cuda":
        snap["cuda_allocated_mib"] = round(torch.cuda.memory_allocated(device) / MIB, 1)
        snap["cuda_peak_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
    return snap


# ---------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, repeat: int, device: torch.device, warmup: bool = True) -> dict:
    """Best and median wall time of `fn()` over `repeat` calls (after one untimed warm-up)."""
    if warmup:
        out = fn()
        sync(device)
        del out
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
        del out
    return {"best_s": min(times), "median_s": statistics.median(times), "times_s": times}


def rates(timing: dict, elements: int, bytes_read: int, bytes_written: int) -> dict:
    best, median = timing["best_s"], timing["median_s"]
    return {
        **{k: round(v, 6) for k, v in timing.items() if k != "times_s"},
        "times_s": [round(t, 6) for t in timing["times_s"]],
        "elements_per_s_best": elements / best,
        "elements_per_s_median": elements / median,
        "input_bytes": bytes_read,
        "output_bytes": bytes_written,
        "input_gb_per_s_best": bytes_read / best / 1e9,
        "input_gb_per_s_median": bytes_read / median / 1e9,
        "output_gb_per_s_best": bytes_written / best / 1e9,
    }


# ---------------------------------------------------------------- per format


def load_format(name: str):
    """The format object, or (None, reason) when it cannot be imported yet."""
    from harness.formats import get_format

    try:
        return get_format(name), None
    except Exception as error:  # ImportError, FormatError (unknown name), AttributeError
        return None, f"{type(error).__name__}: {error}"


def profile_dequantize(fmt, tensors, knobs, device: torch.device, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        out = fmt.dequantize(tensors, knobs)
        sync(device)
    del out
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows, max_name_column_width=40)


def bench_format(name: str, args, device: torch.device, weight_cpu: torch.Tensor) -> dict:
    fmt, reason = load_format(name)
    if fmt is None:
        print(f"[{name}] skipped: not importable ({reason})", flush=True)
        return {"format": name, "skipped": reason}

    rows, cols = weight_cpu.shape
    elements = rows * cols
    record: dict = {"format": name, "description": fmt.description, "notes": []}
    record["memory_before"] = memory_snapshot(device)
    knobs = fmt.resolve_knobs({})
    record["knobs"] = {k: v for k, v in knobs.items()}

    # quantize once, on the CPU (the quantizers are the producers' CPU path; not timed as part of the result)
    start = time.perf_counter()
    quantized = fmt.quantize(weight_cpu, knobs, model_dtype=torch.bfloat16, activation_amax=4.0)
    record["quantize_s"] = round(time.perf_counter() - start, 3)
    quantized.truth = None  # the quantizer's own float64 truth is not needed; free it
    tensors = {k: v.to(device) for k, v in quantized.tensors.items()}
    del quantized
    record["tensors"] = {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."), "bytes": v.numel() * v.element_size()}
        for k, v in tensors.items()
    }
    bytes_read = sum(v.numel() * v.element_size() for v in tensors.values())

    # one checked, untimed warm-up call: shape, dtype and device of the result, and its peak memory
    gc.collect()
    can_reset = reset_peak_rss()
    rss_before = rss_mib()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
    try:
        out = fmt.dequantize(tensors, knobs)
        sync(device)
    except Exception as error:
        if device.type != "cpu":
            message = f"dequantize is not device-generic: it failed on {device} with {type(error).__name__}: {error}"
            print(f"[{name}] {message}", flush=True)
            record["notes"].append(message)
            record["device_generic"] = False
            record["error_trace"] = traceback.format_exc()
            return record
        raise
    if tuple(out.shape) != (rows, cols) or out.dtype != torch.float64:
        record["notes"].append(f"dequantize returned {list(out.shape)} {out.dtype}, expected [{rows}, {cols}] float64")
    if out.device != device:
        message = f"dequantize is not device-generic: inputs on {device}, result on {out.device}"
        print(f"[{name}] {message}", flush=True)
        record["notes"].append(message)
        record["device_generic"] = False
    else:
        record["device_generic"] = True
    out_bytes = out.numel() * out.element_size()
    call_memory = {"rss_before_mib": rss_before}
    if can_reset and rss_before is not None:
        peak = peak_rss_mib()
        call_memory |= {
            "peak_rss_mib": peak,
            "peak_minus_before_mib": round(peak - rss_before, 1),
            "peak_over_result_size": round((peak - rss_before) * MIB / out_bytes, 2),
        }
    if device.type == "cuda":
        cuda_peak = torch.cuda.max_memory_allocated(device) - cuda_before
        call_memory |= {
            "cuda_peak_minus_before_mib": round(cuda_peak / MIB, 1),
            "cuda_peak_over_result_size": round(cuda_peak / out_bytes, 2),
        }
    record["dequantize_call_memory"] = call_memory
    result_f64 = out  # reused as the source of the float64 copy baselines
    del out

    # the checked call above was the dequantize warm-up
    dq = time_call(functools.partial(fmt.dequantize, tensors, knobs), args.repeat, device, warmup=False)
    copy_f64 = time_call(result_f64.clone, args.repeat, device)
    target = torch.empty_like(result_f64)
    copy_into = time_call(functools.partial(target.copy_, result_f64), args.repeat, device)
    del target
    weight_dev = weight_cpu.to(device)
    copy_bf16 = time_call(weight_dev.clone, args.repeat, device)

    record["dequantize"] = rates(dq, elements, bytes_read, out_bytes)
    record["copy_float64"] = rates(copy_f64, elements, out_bytes, out_bytes)
    record["copy_float64_into_existing"] = rates(copy_into, elements, out_bytes, out_bytes)
    record["copy_bf16_input"] = rates(copy_bf16, elements, weight_dev.numel() * 2, weight_dev.numel() * 2)
    record["ratio_dequant_over_copy_float64"] = {
        "best": dq["best_s"] / copy_f64["best_s"],
        "median": dq["median_s"] / copy_f64["median_s"],
    }
    record["ratio_dequant_over_copy_float64_into_existing"] = {
        "best": dq["best_s"] / copy_into["best_s"],
        "median": dq["median_s"] / copy_into["median_s"],
    }
    record["ratio_dequant_over_copy_bf16"] = {
        "best": dq["best_s"] / copy_bf16["best_s"],
        "median": dq["median_s"] / copy_bf16["median_s"],
    }
    record["memory_after"] = memory_snapshot(device)

    if args.profile:
        table = profile_dequantize(fmt, tensors, knobs, device)
        record["profile"] = table
        print(f"[{name}] profile of one dequantize call:\n{table}", flush=True)

    del result_f64, weight_dev, tensors
    r = record["ratio_dequant_over_copy_float64"]["best"]
    print(
        f"[{name}] dequantize best {dq['best_s']:.4f}s median {dq['median_s']:.4f}s "
        f"({elements / dq['best_s'] / 1e6:.1f} Melem/s, {bytes_read / dq['best_s'] / 1e9:.4f} GB/s read) | "
        f"copy f64 {copy_f64['best_s']:.4f}s (into existing {copy_into['best_s']:.4f}s), "
        f"copy bf16 {copy_bf16['best_s']:.4f}s | "
        f"dequant/copy_f64 {r:.1f}x, dequant/copy_bf16 {record['ratio_dequant_over_copy_bf16']['best']:.1f}x | "
        f"quantize {record['quantize_s']:.2f}s | one dequantize call peaks "
        f"{call_memory.get('peak_minus_before_mib', '?')} MiB over its start "
        f"({call_memory.get('peak_over_result_size', '?')}x the result)",
        flush=True,
    )
    if r > 20:
        print(
            f"[{name}] note: dequantize is {r:.0f}x a float64 copy; run with --profile to see where the time goes",
            flush=True,
        )
    return record


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=8192, help="weight is SIZE x SIZE (default 8192)")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per measurement (default 5)")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated (default {DEFAULT_FORMATS})")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    parser.add_argument(
        "--out", default=None, help="JSON output (default benchmarks/results/dequant-<host>[-cuda].json)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one dequantize call")
    args = parser.parse_args(argv)
    if args.size < 1 or args.repeat < 1:
        parser.error("--size and --repeat must be positive")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"--device cuda asked for, but torch.cuda.is_available() is False here; torch {torch.__version__}",
            file=sys.stderr,
        )
        return 2
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: only cpu and cuda are supported")
    if args.threads:
        torch.set_num_threads(args.threads)

    suffix = "" if device.type == "cpu" else f"-{device.type}"
    out_path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"dequant-{machine_tag()}{suffix}.json"
    names = [n.strip() for n in args.formats.split(",") if n.strip()]

    info = machine_info(device)
    print(
        f"machine: {info['cpu_model']}, {info['cpu_count']} cores, torch {info['torch']} "
        f"({info['torch_num_threads']} threads), device {device}"
        + (f" ({info.get('gpu')})" if device.type == "cuda" else ""),
        flush=True,
    )
    print(f"weight: {args.size} x {args.size} bfloat16, repeat {args.repeat}, formats {', '.join(names)}", flush=True)

    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {load[0]:.2f} on {os.cpu_count()} cores: other processes are using the "
            "CPUs and the figures will be noisy",
            flush=True,
        )
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    weight = (torch.randn(args.size, args.size, generator=generator) * 0.02).to(torch.bfloat16)
    report = {
        "benchmark": "reference dequantize vs tensor copy",
        "command": " ".join(
            [".venv/bin/python", "benchmarks/bench_dequant.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "settings": {
            "size": args.size,
            "repeat": args.repeat,
            "device": str(device),
            "seed": args.seed,
            "formats": names,
            "weight": f"randn * 0.02 -> bfloat16 [{args.size}, {args.size}]",
        },
        "machine": info,
        "memory_start": memory_snapshot(device),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "definitions": {
            "best_s/median_s": "over --repeat calls after one untimed warm-up; time.perf_counter, "
            "torch.cuda.synchronize before and after each call on GPU",
            "input_bytes": "bytes of the tensors the call reads (dequantize: all stored tensors of the format)",
            "output_bytes": "bytes of the result (dequantize: float64 [size, size])",
            "ratio_dequant_over_copy_float64": "dequantize time / clone() of a float64 [size, size] tensor",
            "ratio_dequant_over_copy_float64_into_existing": "dequantize time / copy_() of a float64 "
            "[size, size] tensor into an already allocated one "
            "(no allocation or page faults: memory bandwidth)",
            "ratio_dequant_over_copy_bf16": "dequantize time / clone() of the bfloat16 input weight",
            "memory": "rss_mib is current RSS (/proc/self/statm); peak_rss_mib is getrusage ru_maxrss since "
            "the last reset (the high-water mark is reset through /proc/self/clear_refs before each "
            "format's checked dequantize call); dequantize_call_memory is the peak RSS of that one "
            "call over the RSS at its start; process_peak_rss_mib is the maximum over the run",
        },
        "results": [],
    }
    for name in names:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        report["results"].append(bench_format(name, args, device, weight))
    report["memory_end"] = memory_snapshot(device)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["process_peak_rss_mib"] = _PROCESS_PEAK_MIB
    report["total_s"] = round(time.perf_counter() - started, 1)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"total {report['total_s']}s; wrote {out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
