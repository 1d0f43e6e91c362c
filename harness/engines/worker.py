"""Worker process: hosts one engine, answers JSON requests line by line.

`python -m harness.engines.worker SPEC` is started by `EngineProcess`, possibly under another
Python environment (vLLM's). Requests arrive on stdin; answers leave on a private copy of
stdout, while fd 1 itself is pointed at stderr, so that whatever a library prints can never
corrupt the protocol. Tensors travel as safetensors files in a directory the parent names.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import NoReturn

from harness.engines.wire import on_the_wire, sequence_key


def error_text(error: BaseException) -> str:
    """`Type: message`; for an error raised without a message (a bare `assert` in a loader), where
    it was raised and its source line instead, so that a finding says which check failed."""
    message = str(error)
    frames = traceback.extract_tb(error.__traceback__)
    if message.strip() or not frames:
        return f"{type(error).__name__}: {message}"
    last = frames[-1]
    where = last.filename.rpartition("site-packages/")[2]
    return f"{type(error).__name__}: raised without a message in {last.name} ({where}:{last.lineno}): {last.line}"


def serve(spec: str) -> int:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(**payload) -> None:
        channel.write(json.dumps(payload) + "\n")

    try:
        from harness.engines import load_engine

        engine = load_engine(spec)
    except BaseException as error:  # the engine could not even be imported: say why, then stop
        answer(ok=False, error=error_text(error), traceback=traceback.format_exc())
        return 1
    from harness.core.machine import isa_class, thread_count

    answer(
        ok=True,
        name=engine.name or spec,
        version=engine.version(),
        python=sys.executable,
        isa=isa_class(),
        threads=thread_count(),
    )
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            exit_worker(0)  # the engine still held: its teardown is not waited for either
        before = set(sys.modules)  # a failed load changes the process as much as one that loaded
        try:
            payload = {"ok": True, **handle(engine, op, request)}
        except BaseException as error:
            payload = {
                "ok": False,
                "error": error_text(error),
                "traceback": traceback.format_exc(),
                "unsupported": type(error).__name__ == "EngineUnsupported",
                "refuses": type(error).__name__ == "EngineRefuses",
            }
        answer(**payload, changed_process=process_changed_by(set(sys.modules) - before))
    return 0


#: packages whose import changes how this process loads every later checkpoint: auto-round patches
#: transformers when its quantizer imports it (measured with transformers 5.23 and auto-round 0.16.1: a
#: Qwen3-MoE checkpoint loaded after an AutoRound one keeps its experts random, the same checkpoint
#: loaded first is exact), so a worker that imported one serves no other checkpoint
PROCESS_CHANGING_PACKAGES = ("auto_round",)


def process_changed_by(imported: set[str]) -> str:
    """The package among the modules a load `imported` that changes later loads, or ""."""
    return next((name for name in PROCESS_CHANGING_PACKAGES if name in imported), "")


def handle(engine, op: str, request: dict) -> dict:
    import torch
    from safetensors.torch import save_file

    if op == "unsupported":
        return {"reason": engine.unsupported_reason(request["format"])}
    if op == "load":  # `variant`: another load path that must agree (harness.differential.relations)
        engine.unload()
        variant = request.get("variant")
        report = engine.load_variant(request["directory"], variant) if variant else engine.load(request["directory"])
        return {"report": report.to_json()}
    if op == "save":
        engine.save(request["directory"])
        return {}
    if op == "weights":
        weights = {name: on_the_wire(tensor) for name, tensor in engine.weights().items()}
        save_file(weights, request["out"])
        return {"count": len(weights)}
    if op == "logprobs":  # `activations`: the reference's candidate with activations quantized as specified
        variant = request.get("activations")  # harness.oracle.specified.VARIANTS
        if variant:
            rows = engine.activation_logprobs(request["sequences"], variant=variant)
        else:
            rows = engine.logprobs(request["sequences"])
        save_file(
            {sequence_key(i): r.detach().to("cpu", torch.float32).contiguous() for i, r in enumerate(rows)},
            request["out"],
        )
        return {"count": len(rows)}
    if op == "probe_reference":  # the activation probe's inputs and expectations (harness.differential.probe)
        save_file({k: v.contiguous() for k, v in engine.probe_reference(request["rows"]).items()}, request["out"])
        return {}
    if op == "basis_reference":  # the effective-weight probe's inputs (harness.differential.effective_weights)
        save_file({k: v.contiguous() for k, v in engine.basis_reference().items()}, request["out"])
        return {}
    if op == "probe":  # each named Linear run on its probe input
        from safetensors.torch import load_file

        outputs = engine.probe_linears(load_file(request["inputs"]))
        save_file({name: t.detach().to("cpu").contiguous() for name, t in outputs.items()}, request["out"])
        return {"count": len(outputs)}
    if op == "kv_cache_scales":  # the scales the engine's FP8 KV cache uses (harness.differential.kv_scales)
        return {"scales": {name: list(pair) for name, pair in engine.kv_cache_scales().items()}}
    if op == "generate":
        return {"tokens": engine.generate(request["prompt"], request["max_new_tokens"])}
    raise ValueError(f"unknown op {op!r}")


def exit_worker(status: int) -> NoReturn:
    """End this worker with `status` as soon as it is done. What libraries registered to run at exit
    runs (atexit: temporary directories, weakref finalizers, vLLM's engine shutdown), stdio is
    flushed, then `os._exit` skips the interpreter's teardown of every module and object. Garbage
    collections asked for on the way (vLLM's shutdown runs a full one, 0.8 s with vLLM and
    transformers imported) free memory that the exit frees anyway. A worker asked to quit took
    1.0 s to exit with torch and transformers imported, 2.6-2.9 s with vLLM; this way 0.05-0.23 s (docs/ci.md,
    session 41). Every answer was written before the request to quit."""
    import atexit
    import gc

    gc.collect = _collect_nothing
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _collect_nothing(generation: int = 2) -> int:
    return 0


if __name__ == "__main__":
    exit_worker(serve(sys.argv[1]))
