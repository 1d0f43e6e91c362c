"""Build, load, judge, print.

Exit 1 while the bug is present, 0 once fixed, 2 when the script cannot run here (the engine
missing, no kernel for this machine, the script itself failing)."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import re
import sys
import tempfile
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

from harness.lanes.upstream.parts.activations import (  # only where JUDGE_ACTIVATIONS is set
    ActivationRecorder,
    activation_problems,
)
from harness.lanes.upstream.parts.checkpoint import build_checkpoint
from harness.lanes.upstream.parts.common import (
    EXIT_BUG,
    EXIT_CANNOT_RUN,
    EXIT_FIXED,
    MODEL_DTYPE,
    CapturedLogs,
    describe_error,
    weight_problems,
)
from harness.lanes.upstream.parts.engine_transformers import (  # or another engine piece
    ENGINE_DISTRIBUTIONS,
    ENGINE_LOGGERS,
    ENGINE_PACKAGE,
    check_loaded,
    load_model,
)
from harness.lanes.upstream.parts.fp8 import scale_block  # or nvfp4: the format piece
from harness.lanes.upstream.parts.kv_cache_vllm import kv_cache_problems  # only where JUDGE_KV_CACHE is set
from harness.lanes.upstream.parts.parameters import (
    CANNOT_RUN_HERE,
    CONFIG,
    ENGINE_OPTIONS,
    EXPECTATION,
    EXPECTED,
    FORMAT,
    ISSUE,
    JUDGE_ACTIVATIONS,
    JUDGE_KV_CACHE,
    RELATION,
    REPORTED_ERROR,
    TENSOR_PARALLEL,
)
from harness.lanes.upstream.parts.relation_transformers import relation_problems  # only where RELATION is set
from harness.lanes.upstream.parts.relation_vllm import shard_problems  # only where TENSOR_PARALLEL is set

# ---- reproduce.py ----

BEGIN, END = "==== reproduce.py: result ====", "==== end of result ===="


def versions() -> str:
    for name in ENGINE_DISTRIBUTIONS:
        try:
            engine = f"{name} {importlib.metadata.version(name)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        engine = f"{ENGINE_PACKAGE} (version unknown)"
    return (
        f"{engine}, torch {torch.__version__}, Python {platform.python_version()} "
        f"({platform.system()} {platform.machine()}, {'CUDA' if torch.cuda.is_available() else 'CPU'})"
    )


def error_text(error: BaseException, logged: list[str]) -> tuple[str, list[str]]:
    """The exception's first lines, and the errors the engine logged while it was raised."""
    causes = [line.strip()[:300] for entry in logged for line in entry.splitlines()]
    causes = [line for line in causes if re.match(r"\w*(Error|Exception)\b", line)]
    return " ".join(describe_error(error, 600).split("\n")[:3]), list(dict.fromkeys(causes))[:5]


def reported(text: str) -> str:
    if REPORTED_ERROR is None:
        return ""
    if re.search(REPORTED_ERROR, text):
        return " (the error reported)"
    return f" (NOT the error reported, /{REPORTED_ERROR}/: a different failure)"


def judge_refusal(error: BaseException, logged: list[str]) -> tuple[int, list[str]]:
    message, causes = error_text(error, logged)
    everything = " ".join([message, *causes])
    lines = [f"actual: loading fails: {message}", *(f"  logged: {cause}" for cause in causes)]
    if CANNOT_RUN_HERE and re.search(CANNOT_RUN_HERE, everything):
        return EXIT_CANNOT_RUN, [*lines, "verdict: cannot run here: the engine has no kernel for this machine"]
    if EXPECTATION in ("refuse", "exact-or-refuse"):
        return EXIT_FIXED, [*lines, "verdict: fixed: the engine refuses the checkpoint, as a correct loader does"]
    return EXIT_BUG, [*lines, f"verdict: bug present: a valid checkpoint fails to load{reported(everything)}"]


def judge_loaded(problems: list[str], notes: list[str]) -> tuple[int, list[str]]:
    details = [*(f"  - {problem}" for problem in problems), *(f"  note: {note}" for note in notes)]
    if CANNOT_RUN_HERE and any(re.search(CANNOT_RUN_HERE, problem) for problem in problems):
        return EXIT_CANNOT_RUN, [
            "actual: loads, but:",
            *details,
            "verdict: cannot run here: no kernel for this machine",
        ]
    if EXPECTATION == "refuse":
        lines = ["actual: loads without an error" + (", and:" if details else ""), *details]
        return EXIT_BUG, [*lines, "verdict: bug present: an invalid checkpoint is accepted"]
    if problems:
        failures = " ".join(problem for problem in problems if " fails: " in problem)
        lines = [f"actual: loads, but {len(problems)} problem(s):", *details]
        return EXIT_BUG, [*lines, f"verdict: bug present{reported(failures) if failures else ''}"]
    lines = ["actual: loads, every weight as defined, and the forward pass runs", *details]
    return EXIT_FIXED, [*lines, "verdict: fixed"]


def reproduce() -> tuple[int, list[str]]:
    with tempfile.TemporaryDirectory(prefix="reproduce-") as scratch:
        expected = build_checkpoint(Path(scratch))
        header = [
            f"checkpoint: {FORMAT} {CONFIG['model_type']}, {len(expected)} quantized Linear weights, "
            f"{str(MODEL_DTYPE).removeprefix('torch.')}"
            + (f", loaded in {ENGINE_OPTIONS['dtype']}" if "dtype" in ENGINE_OPTIONS else ""),
            f"expected: {EXPECTED}",
        ]
        if JUDGE_KV_CACHE:  # vLLM's own cache op: no model is built
            try:
                problems = kv_cache_problems(scratch)
            except (ImportError, NotImplementedError, RuntimeError) as error:  # no such op or ISA here
                return EXIT_CANNOT_RUN, header + [f"verdict: cannot run here: {type(error).__name__}: {error}"]
            if problems:
                lines = ["actual: the FP8 KV cache vLLM writes is not the definition:"]
                return EXIT_BUG, header + lines + [f"  - {p}" for p in problems] + ["verdict: bug present"]
            return EXIT_FIXED, header + ["actual: vLLM writes its FP8 KV cache as defined", "verdict: fixed"]
        if TENSOR_PARALLEL is not None:  # vLLM's loaders under a mocked rank: no model is built, no kernel runs
            problems = shard_problems(scratch, expected)
            if problems:
                lines = [f"actual: {len(problems)} rank(s) hold values other than their slice:"]
                return EXIT_BUG, header + lines + [f"  - {p}" for p in problems] + ["verdict: bug present"]
            return EXIT_FIXED, header + [
                "actual: every rank holds its slice, or vLLM refuses the split",
                "verdict: fixed",
            ]
        with CapturedLogs(ENGINE_LOGGERS) as logs:
            try:
                loaded = load_model(scratch)
            except (Exception, SystemExit) as error:  # a library that exits the interpreter fails the load too
                code, lines = judge_refusal(error, logs.lines)
                return code, header + lines
            recorder = ActivationRecorder(loaded[0], expected) if JUDGE_ACTIVATIONS else nullcontext()
            with recorder:
                held, problems, notes = check_loaded(loaded, expected)
        if held is not None and EXPECTATION != "refuse":
            problems += weight_problems(held, expected, scale_block)
        if JUDGE_ACTIVATIONS and held is not None:
            found, seen = activation_problems(recorder, held, scratch)
            problems, notes = problems + found, notes + seen
        if RELATION is not None and EXPECTATION != "refuse":
            problems += relation_problems(scratch, loaded)
        code, lines = judge_loaded(problems, notes)
        return code, header + lines


def main() -> int:
    try:
        importlib.import_module(ENGINE_PACKAGE)
    except ImportError as error:
        print(f"cannot run: {ENGINE_PACKAGE} is not importable here ({error})")
        return EXIT_CANNOT_RUN
    try:
        code, lines = reproduce()
    except Exception:
        traceback.print_exc()
        code, lines = EXIT_CANNOT_RUN, ["verdict: cannot run: the reproducer itself failed (traceback above)"]
    print("\n".join([BEGIN, f"issue: {ISSUE}", f"versions: {versions()}", *lines, f"exit {code}", END]), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
