"""The scales an engine's FP8 KV cache really uses, judged against the checkpoint's. Logits hear a
wrong KV scale only where it pushes keys or values off the E4M3 grid (saturation, underflow): with
another in-range scale every cached value still rounds by E4M3's few percent, inside the bound an
FP8 cache's logits are judged with. So where an engine tells its scales (Engine.kv_cache_scales),
they are compared with what the checkpoint stores, attention module by attention module:

- a complete pair: the engine must hold it exactly, or each scale rounded once to the model dtype
  (compressed-tensors keeps them as parameters of the model dtype); anything else is a `kv-scales`
  finding naming what it holds (1.0: the checkpoint's scales ignored);
- the config declares an FP8 cache and the engine's cache is not quantized: `kv-scales`;
- half a pair, or none: the checkpoint defines no scale for the other; an engine that runs its FP8
  cache anyway loaded a checkpoint it must refuse: `accepted-invalid`, naming the value it used.

An engine whose load report already names a key missing or unexpected is not judged here (that
finding explains it), nor one that cannot tell (EngineUnsupported)."""

from __future__ import annotations

import torch

from harness.core.dtypes import MODEL_DTYPES
from harness.core.errors import HarnessError
from harness.core.naming import canonical_name
from harness.engines.process import EngineError, EngineProcess
from harness.oracle.kv_cache import declares_fp8_kv_cache

PARTS = ("k_scale", "v_scale")


def judge_kv_scales(judgement, engine: str, worker: EngineProcess) -> bool:
    """Judge the KV-cache scales `engine` uses; True when that made a finding (its logits are then
    that finding's consequence)."""
    try:
        if not declares_fp8_kv_cache(judgement.config.get("quantization_config") or {}):
            return False
    except HarnessError:  # a KV scheme the oracle does not define: nothing to hold the engine to
        return False
    try:
        held = {_module(name): pair for name, pair in worker.kv_cache_scales().items()}
    except EngineError as error:
        if error.unsupported:
            return False
        raise
    stored = {_module(name): pair for name, pair in judgement.stored_kv_scales.items()}
    problems = [
        problem
        for module, pair in sorted(stored.items())
        if (problem := judge_module(module, pair, held.get(module), MODEL_DTYPES[judgement.engine_dtype(engine)]))
    ]
    if not problems:
        return False
    kind, message = problems[0]
    more = f" (and {len(problems) - 1} more attention module(s))" if len(problems) > 1 else ""
    judgement.finding(engine, kind, message + more, metrics={"kv_scales": [m for _, m in problems][:50]})
    return True


def judge_module(
    module: str, stored: tuple[float | None, float | None], held: tuple[float, float] | None, dtype: torch.dtype
) -> tuple[str, str] | None:
    """(finding kind, message) for one attention module, or None when the engine holds what it must."""
    absent = [part for part, value in zip(PARTS, stored, strict=True) if value is None]
    if absent:
        if held is None:
            return None  # an unquantized cache: no scale made up (refusing would be better; not judged)
        used = ", ".join(f"{part} {_describe(value, stored)}" for part, value in zip(PARTS, held, strict=True))
        return (
            "accepted-invalid",
            f"{module}: ran its FP8 KV cache with {' and '.join(absent)} the checkpoint does not hold ({used})",
        )
    if held is None:
        return "kv-scales", f"{module}: KV cache not quantized, though the config declares an FP8 cache"
    wrong = [
        f"{part} {got:.6g} where the checkpoint stores {want:.6g}"
        for part, want, got in zip(PARTS, stored, held, strict=True)
        if got not in (want, _rounded(want, dtype))
    ]
    return ("kv-scales", f"{module}: FP8 KV cache with {'; '.join(wrong)}") if wrong else None


def _describe(value: float, stored: tuple[float | None, float | None]) -> str:
    """A used scale, and where it came from when that shows."""
    if value in stored:
        return f"{value:.6g} = the stored {PARTS[stored.index(value)]}"
    return f"{value:.6g} (a default)" if value == 1.0 else f"{value:.6g}"


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


def _module(name: str) -> str:
    return canonical_name(f"{name}.k_scale").removesuffix(".k_scale")
