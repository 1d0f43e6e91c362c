"""Run an engine in a worker subprocess that stays alive across checkpoints.

The worker inherits the user's environment (PYTHONPATH, HF_HOME, CUDA_VISIBLE_DEVICES, ...),
unchanged but for the overrides its registry entry names because correctness needs them
(harness.engines.EngineEntry.overrides: the CPU engines hide GPUs). It is killed, and the failure
reported, when it crashes, answers nothing within the timeout, or its resident memory passes the
limit; the run goes on. A worker is forked from a preloaded zygote of its interpreter and
environment (harness.engines.zygote) rather than started afresh.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.engines.wire import sequence_key
from harness.engines.zygote import ForkedWorker, forked_worker


class EngineFailure(Exception):
    """The worker died, hung or blew its memory limit. `kind` is crash, timeout or memory."""

    def __init__(self, kind: str, message: str, log_tail: str = ""):
        super().__init__(message)
        self.kind = kind
        self.log_tail = log_tail


class EngineError(Exception):
    """The engine raised inside the worker (the worker itself is fine)."""

    def __init__(self, message: str, traceback: str, unsupported: bool = False, refuses: bool = False):
        super().__init__(message)
        self.traceback = traceback
        self.unsupported = unsupported
        self.refuses = refuses  # on purpose, in the engine's own words (EngineRefuses)


@dataclass
class Limits:
    timeout_s: float = 600.0
    memory_mb: float = 16_000.0


def resident_mb(pid: int) -> float:
    """RSS of a process and its children, from /proc (0 where /proc is unavailable)."""
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for p in [pid, *map(int, children)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


class EngineProcess:
    def __init__(
        self, spec: str, python: str | None, log_path: Path, limits: Limits, overrides: tuple[tuple[str, str], ...] = ()
    ):
        self.spec = spec
        self.overrides = dict(overrides)
        self.python = python or sys.executable
        self.log_path = Path(log_path)
        self.limits = limits
        self.process: subprocess.Popen | ForkedWorker | None = None
        self.info: dict = {}
        self.peak_mb = 0.0
        self.asked_to_quit = False  # asked once: close() after a session's ask_to_quit() does not ask again
        #: seconds spent waiting on each request op (start included): where a campaign's time goes
        self.busy: dict[str, float] = {}
        #: the package an earlier load imported that changes later loads, and that load's checkpoint
        self.changed_by, self.changed_for = "", None

    def start(self) -> dict:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.asked_to_quit = False
        self.changed_by, self.changed_for = "", None
        started = time.monotonic()
        env = {**os.environ, **self.overrides}
        self.process = forked_worker(self.python, env, self.spec, self._log.fileno(), self.limits.timeout_s)
        if self.process is None:
            self.process = subprocess.Popen(
                [self.python, "-m", "harness.engines.worker", self.spec],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                start_new_session=True,
                text=True,
                bufsize=1,
                env=env,
            )
        try:
            self.info = self._receive(self.limits.timeout_s)
        finally:
            self._spent("start", started)
        return self.info

    def _spent(self, op: str, started: float) -> None:
        self.busy[op] = self.busy.get(op, 0.0) + time.monotonic() - started

    def request(self, op: str, timeout_s: float | None = None, **payload) -> dict:
        if self.process is None or self.process.poll() is not None:
            raise EngineFailure("crash", f"worker for {self.spec} is not running", self.log_tail())
        try:
            self.process.stdin.write(json.dumps({"op": op, **payload}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self._kill()
            raise EngineFailure("crash", f"worker for {self.spec} died", self.log_tail()) from None
        started = time.monotonic()
        try:
            return self._receive(timeout_s or self.limits.timeout_s)
        finally:
            self._spent(op, started)

    def _receive(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        stdout = self.process.stdout
        while True:
            ready, _, _ = select.select([stdout], [], [], 0.2)
            if ready:
                line = stdout.readline()
                if not line:
                    code = self.process.wait(timeout=10)
                    self._kill()
                    raise EngineFailure("crash", f"worker for {self.spec} exited with status {code}", self.log_tail())
                message = json.loads(line)
                if message.get("changed_process") and not self.changed_by:  # any op, answered or failed
                    self.changed_by, self.changed_for = message["changed_process"], None
                if not message.pop("ok"):
                    if not self.info:  # failed before it could serve
                        self._kill()
                        raise EngineFailure("crash", message["error"], message.get("traceback", ""))
                    raise EngineError(
                        message["error"],
                        message.get("traceback", ""),
                        message.get("unsupported", False),
                        message.get("refuses", False),
                    )
                return message
            memory = resident_mb(self.process.pid)
            self.peak_mb = max(self.peak_mb, memory)
            if memory > self.limits.memory_mb:
                self._kill()
                raise EngineFailure(
                    "memory",
                    f"worker for {self.spec} used {memory:.0f} MB, over the {self.limits.memory_mb:.0f} MB limit",
                    self.log_tail(),
                )
            if time.monotonic() > deadline:
                self._kill()
                raise EngineFailure(
                    "timeout", f"worker for {self.spec} gave no answer within {timeout_s:.0f} s", self.log_tail()
                )
            if self.process.poll() is not None and not select.select([stdout], [], [], 0)[0]:
                code = self.process.returncode
                self._kill()
                raise EngineFailure("crash", f"worker for {self.spec} exited with status {code}", self.log_tail())

    # The engine protocol, typed: what a worker answers (harness.engines.worker serves the other side).

    def unsupported(self, fmt: str) -> str | None:
        """Why the engine cannot load format `fmt` here, or None."""
        return self.request("unsupported", format=fmt)["reason"]

    def unsupported_schemes(self, fmt, knobs) -> str | None:
        """Why the engine cannot load a checkpoint of format `fmt` here: the reason of the first of
        the formats its modules are stored in (QuantFormat.schemes: a mixed checkpoint's groups'), unless
        no probe answers for its knobs (QuantFormat.probe_answers): then its own load does."""
        if not fmt.probe_answers(knobs):
            return None
        return next(filter(None, (self.unsupported(scheme.name) for scheme in fmt.schemes(knobs))), None)

    def load(self, directory: str | Path, variant: str | None = None) -> dict:
        """Load a checkpoint (replacing any loaded one); its load report as a dict of lists.
        `variant`: another load path that must agree with the default (Engine.load_variant). A worker
        whose earlier load imported a package that changes later loads (worker.PROCESS_CHANGING_PACKAGES)
        is restarted before it loads another checkpoint, so that no judgement depends on what the
        worker loaded before."""
        if self.changed_by and Path(directory).resolve() != self.changed_for:
            self.close()
            self.start()
        payload = {"directory": str(directory)} | ({"variant": variant} if variant else {})
        try:
            return self.request("load", **payload)["report"]
        finally:  # a load that failed after the import changed the process too
            if self.changed_by and self.changed_for is None:
                self.changed_for = Path(directory).resolve()

    def save(self, directory: str | Path) -> None:
        """Save the loaded model into `directory` as its users would (Engine.save)."""
        self.request("save", directory=str(directory))

    def weights(self, out: Path) -> dict:
        """Every weight the engine holds under HF names, float32 (integer tensors float64, exactly:
        harness.engines.wire.on_the_wire), through the file `out`."""
        from safetensors.torch import load_file

        self.request("weights", out=str(out))
        return load_file(str(out))

    def logprobs(self, sequences: list[list[int]], out: Path, activations: str = "") -> list:
        """Per sequence, float32 [len-1, vocab] next-token log-probabilities (through the file `out`);
        `activations` (a variant of harness.oracle.specified.VARIANTS): the engine's forward with activations
        quantized as the checkpoint specifies (the reference engine's second candidate; others
        answer EngineError, unsupported)."""
        from safetensors.torch import load_file

        self.request("logprobs", sequences=sequences, out=str(out), activations=activations)
        rows = load_file(str(out))
        return [rows[sequence_key(i)] for i in range(len(sequences))]

    def probe_reference(self, out: Path, rows: int = 8) -> dict:
        """The reference's activation probe (ReferenceEngine.probe_reference), through the file `out`."""
        from safetensors.torch import load_file

        self.request("probe_reference", out=str(out), rows=rows)
        return load_file(str(out))

    def basis_reference(self, out: Path) -> dict:
        """The reference's effective-weight probe inputs (ReferenceEngine.basis_reference), through `out`."""
        from safetensors.torch import load_file

        self.request("basis_reference", out=str(out))
        return load_file(str(out))

    def probe(self, inputs: dict, scratch: Path) -> dict:
        """Each named quantized Linear run on its input (Engine.probe_linears), through files in
        `scratch` (`-in`, `-out` suffixes)."""
        from safetensors.torch import load_file, save_file

        into, out = (
            scratch.with_name(scratch.stem + "-in.safetensors"),
            scratch.with_name(scratch.stem + "-out.safetensors"),
        )
        save_file({name: rows.contiguous() for name, rows in inputs.items()}, str(into))
        self.request("probe", inputs=str(into), out=str(out))
        return load_file(str(out))

    def kv_cache_scales(self) -> dict[str, tuple[float, float]]:
        """Attention module -> (k_scale, v_scale) the engine's KV cache uses (Engine.kv_cache_scales)."""
        return {name: tuple(pair) for name, pair in self.request("kv_cache_scales")["scales"].items()}

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return self.request("generate", prompt=list(prompt), max_new_tokens=max_new_tokens)["tokens"]

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _kill(self) -> None:
        if self.process and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def ask_to_quit(self) -> None:
        """Tell the worker to exit, without waiting (close() waits): a session's workers then shut
        down side by side."""
        if self.process and self.process.poll() is None and not self.asked_to_quit:
            self.asked_to_quit = True
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError):  # ValueError: stdin already closed
                pass

    def close(self) -> None:
        if self.process and self.process.poll() is None:
            self.ask_to_quit()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        if hasattr(self, "_log"):
            self._log.close()
