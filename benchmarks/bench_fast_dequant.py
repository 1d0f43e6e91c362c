"""Throughput of the fast dequantizer (harness/oracle/fast.py) on a real-size weight, next to a
plain copy of its output timed in the same process.

Not a test: it asserts nothing about speed. For each format it quantizes one random bfloat16
[size, size] weight once (untimed), then for each output dtype (float32, bfloat16) times
`FastDequantizer(dtype, verify=False, reuse_output=True).dequantize` (the output and scratch
buffers are allocated by one untimed warm-up call, as `dequant --fast` reuses them from tensor
to tensor), the same with the sampled verification against the float64 reference (`verify=True`,
what `dequant --fast` runs), and `copy_()` of a [size, size] tensor of the output dtype into an
existing one. Once per format the whole result is compared with the float64 reference, bit for
bit, and the bfloat16 elements that differ from the float64 value rounded once are counted.

    .venv/bin/python benchmarks/bench_fast_dequant.py                 # 8192 x 8192, 2 threads
    .venv/bin/python benchmarks/bench_fast_dequant.py --size 2048 --repeat 3 --formats fp8-block

Results go to a JSON file (default benchmarks/results/fast-dequant-<host>.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from machine import cpu_model, machine_tag  # noqa: E402  (benchmarks/ is the script directory)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.formats import FORMAT_NAMES, get_format  # noqa: E402
from harness.oracle.fast import TILE_ELEMENTS, WITHOUT_KERNEL, FastDequantizer, first_difference  # noqa: E402

OUTPUTS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_and_median(fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"best_s": round(min(times), 6), "median_s": round(statistics.median(times), 6)}


def rounded_once_to_bfloat16(reference: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16 with a single rounding: round to odd into float32 (24 >= 8 + 2 bits),
    then to nearest-even bfloat16."""
    nearest = reference.to(torch.float32)
    inexact = nearest.to(torch.float64) != reference
    overshot = nearest.to(torch.float64).abs() > reference.abs()
    toward_zero = torch.where(overshot, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    odd = (toward_zero.view(torch.int32) | inexact.to(torch.int32)).view(torch.float32)
    return odd.to(torch.bfloat16)


def bench_output(fmt, knobs, tensors, name, dtype, reference, repeat: int, tile_elements: int) -> dict:
    elements = reference.numel()
    bytes_in = sum(t.numel() * t.element_size() for t in tensors.values())
    plain = FastDequantizer(dtype, verify=False, reuse_output=True, tile_elements=tile_elements)
    checked = FastDequantizer(dtype, verify=True, reuse_output=True, tile_elements=tile_elements)
    out = plain.dequantize(fmt, knobs, tensors)  # warm-up: allocates the output and scratch buffers
    checked.dequantize(fmt, knobs, tensors, name)
    fast = best_and_median(functools.partial(plain.dequantize, fmt, knobs, tensors), repeat)
    verified = best_and_median(functools.partial(checked.dequantize, fmt, knobs, tensors, name), repeat)
    source, target = out.clone(), torch.empty_like(out)
    target.copy_(source)
    copy = best_and_median(functools.partial(target.copy_, source), repeat)
    bytes_out = elements * out.element_size()
    entry = {
        "fast": fast,
        "fast_with_sampled_verification": verified,
        "copy_output_into_existing": copy,
        "output_bytes": bytes_out,
        "fast_melem_per_s_best": round(elements / fast["best_s"] / 1e6, 1),
        "fast_gb_per_s_in_plus_out_best": round((bytes_in + bytes_out) / fast["best_s"] / 1e9, 3),
        "copy_melem_per_s_best": round(elements / copy["best_s"] / 1e6, 1),
        "copy_gb_per_s_in_plus_out_best": round(2 * bytes_out / copy["best_s"] / 1e9, 3),
        "fast_over_copy_time_best": round(fast["best_s"] / copy["best_s"], 3),
        "fast_over_copy_time_median": round(fast["median_s"] / copy["median_s"], 3),
        "verification_overhead_s_median": round(verified["median_s"] - fast["median_s"], 4),
        "equal_to_reference_rounded": first_difference(out, reference) is None,
    }
    extra = ""
    if dtype == torch.bfloat16:
        differs = int((out.view(torch.int16) != rounded_once_to_bfloat16(reference).view(torch.int16)).sum())
        entry["bfloat16_elements_off_by_double_rounding"] = differs
        extra = f", bf16 elements off by double rounding: {differs}"
    print(
        f"[{name}] {str(dtype).removeprefix('torch.')}: fast {fast['best_s'] * 1e3:.1f} ms best / "
        f"{fast['median_s'] * 1e3:.1f} median ({entry['fast_melem_per_s_best']:.0f} Melem/s, "
        f"{entry['fast_gb_per_s_in_plus_out_best']:.2f} GB/s in+out), with verification "
        f"{verified['median_s'] * 1e3:.1f} ms median | copy {copy['best_s'] * 1e3:.1f} ms "
        f"({entry['copy_gb_per_s_in_plus_out_best']:.2f} GB/s) | fast/copy {entry['fast_over_copy_time_best']:.2f}x "
        f"| equal to the reference: {entry['equal_to_reference_rounded']}{extra}",
        flush=True,
    )
    return entry


def upstream_dequantizers(name: str, tensors: dict) -> dict:
    """The FP8 block dequantizations users get from transformers and compressed-tensors, each called
    as that library calls it on CPU (a library that cannot be imported is left out, its reason kept)."""
    runs, missing = {}, {}
    if name == "fp8-block":
        try:
            from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
        except ImportError as error:
            missing["transformers"] = f"{type(error).__name__}: {error}"
        else:
            weight, scale = tensors["weight"], tensors["weight_scale_inv"]
            # load with dequantize=True: float32 arithmetic, the scale's dtype (bfloat16 here) out
            runs["transformers Fp8Dequantize (dequantize=True load), bfloat16 out"] = functools.partial(
                Fp8Dequantize(None)._dequantize_one, weight, scale, torch.bfloat16
            )
            runs["transformers _dequantize_fp8_weight (FP8Linear without a kernel), float32 out"] = functools.partial(
                _dequantize_fp8_weight, weight, scale, [128, 128], torch.float32
            )
    if name == "ct-fp8-block":
        try:
            from compressed_tensors.quantization import QuantizationArgs
            from compressed_tensors.quantization.lifecycle.forward import dequantize
        except ImportError as error:
            missing["compressed-tensors"] = f"{type(error).__name__}: {error}"
        else:
            args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128])
            runs["compressed-tensors dequantize (decompression), float32 out"] = functools.partial(
                dequantize, tensors["weight"], tensors["weight_scale"], None, args, torch.float32
            )
    return runs, missing


def bench_upstream(name: str, tensors: dict, reference: torch.Tensor, repeat: int) -> dict:
    runs, missing = upstream_dequantizers(name, tensors)
    results = {label: {"not_run": why} for label, why in missing.items()}
    for label, run in runs.items():
        out = run()  # warm-up
        timed = best_and_median(run, repeat)
        timed["melem_per_s_best"] = round(reference.numel() / timed["best_s"] / 1e6, 1)
        timed["equal_to_reference_rounded"] = first_difference(out.reshape(reference.shape), reference) is None
        results[label] = timed
        print(
            f"[{name}] {label}: {timed['best_s'] * 1e3:.1f} ms best ({timed['melem_per_s_best']:.0f} Melem/s) "
            f"| equal to the reference: {timed['equal_to_reference_rounded']}",
            flush=True,
        )
    return results


def bench_format(name: str, weight: torch.Tensor, repeat: int, tile_elements: int) -> dict:
    fmt = get_format(name)
    knobs = fmt.resolve_knobs({})
    start = time.perf_counter()
    quantized = fmt.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=4.0)
    record = {"format": name, "quantize_s": round(time.perf_counter() - start, 2)}
    tensors = quantized.tensors
    record["input_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    start = time.perf_counter()
    reference = fmt.dequantize(tensors, knobs)
    record["reference_s_once"] = round(time.perf_counter() - start, 3)
    for label, dtype in OUTPUTS.items():
        record[label] = bench_output(fmt, knobs, tensors, name, dtype, reference, repeat, tile_elements)
    upstream = bench_upstream(name, dict(tensors), reference, repeat)
    if upstream:
        record["upstream"] = upstream
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--formats", default=",".join(n for n in FORMAT_NAMES if n not in WITHOUT_KERNEL))
    parser.add_argument("--tile-elements", type=int, default=TILE_ELEMENTS)
    parser.add_argument("--out", default=None, help="default benchmarks/results/fast-dequant-<host>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    out_path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"fast-dequant-{machine_tag()}.json"
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    print(f"machine: {info['cpu_model']}, {info['cpu_count']} cores, torch {info['torch']}, {args.threads} threads")
    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load[0]:.2f}: other processes use the CPUs; figures will be noisy")
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.size, args.size, generator=generator) * 0.02).to(torch.bfloat16)
    report = {
        "benchmark": "fast dequantize (float32 / bfloat16) vs copy of its output",
        "command": " ".join([".venv/bin/python", "benchmarks/bench_fast_dequant.py", *(argv or sys.argv[1:])]),
        "settings": {
            "size": args.size,
            "repeat": args.repeat,
            "threads": args.threads,
            "tile_elements": args.tile_elements,
            "weight": f"randn * 0.02 -> bfloat16 [{args.size}, {args.size}], default knobs",
        },
        "machine": info,
        "loadavg_start": [round(x, 2) for x in load],
        "definitions": {
            "fast": "FastDequantizer(verify=False, reuse_output=True).dequantize: preallocated output",
            "fast_with_sampled_verification": "the same with verify=True (dequant --fast): corner and seeded "
            "tiles recomputed by the float64 reference",
            "copy_output_into_existing": "copy_() of a [size, size] tensor of the output dtype into an existing one",
            "gb_per_s_in_plus_out": "(bytes of the stored tensors + bytes of the output) / best time; "
            "copy: 2 x output bytes / best time",
            "equal_to_reference_rounded": "bit for bit equal to fmt.dequantize(...).to(float32).to(dtype)",
            "bfloat16_elements_off_by_double_rounding": "elements differing from the float64 reference "
            "rounded once to bfloat16",
            "upstream": "the same weight dequantized by transformers' and compressed-tensors' own CPU code "
            "in the same process (fp8-block and ct-fp8-block), best and median of --repeat",
        },
        "results": [],
    }
    for name in names:
        report["results"].append(bench_format(name, weight, args.repeat, args.tile_elements))
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["total_s"] = round(time.perf_counter() - started, 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_path} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
