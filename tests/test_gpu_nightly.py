"""scripts/gpu-nightly without CUDA: the CPU fallback runs every section small and writes results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-nightly"


def test_cpu_fallback_writes_results(tmp_path):
    out = tmp_path / "nested" / "results.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--formats", "fp8-block,ct-nvfp4a16", "--size", "128"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())
    assert results["fallback"] is True and results["machine"]["device"] == "cpu" and results["errors"] == []
    agreement = results["dequant_agreement"]
    assert {r["format"] for r in agreement} == {"fp8-block", "ct-nvfp4a16"}
    assert any(r["name"].startswith("case:") for r in agreement) and any(
        r["name"].startswith("promoted:") for r in agreement
    )
    assert all(r["status"] in ("bit-exact", "refused") and r["max_ulps"] == 0 for r in agreement)
    assert {e: r["status"] for e, r in results["engines"].items()} == {
        "transformers-cuda": "skipped",
        "vllm": "skipped",
    }
    assert all("no CUDA device" in r["reason"] for r in results["engines"].values())
    assert [r["format"] for r in results["throughput"]] == ["fp8-block", "ct-nvfp4a16"]
    assert all(r["dequant_best_s"] > 0 and r["copy_best_s"] > 0 for r in results["throughput"])
    assert results["summary"]["over_max_ulps"] == [] and results["exit"] == 0


def test_ulp_distance():
    import importlib.machinery
    import importlib.util

    import torch

    loader = importlib.machinery.SourceFileLoader("gpu_nightly", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_nightly", loader))
    loader.exec_module(module)
    a = torch.tensor([1.0, -2.0, 0.0, float("nan")], dtype=torch.float64)
    assert module.ulp_distance(a, a.clone()) == 0
    b = a.clone()
    b[0] = torch.nextafter(b[0], torch.tensor(2.0, dtype=torch.float64))
    b[1] = torch.nextafter(torch.nextafter(b[1], b[0]), b[0])
    assert module.ulp_distance(a, b) == 2
    c = a.clone()
    c[2] = -0.0
    assert module.ulp_distance(a, c) == 0
    c[3] = 1.0
    assert module.ulp_distance(a, c) == float("inf")
