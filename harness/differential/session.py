"""The engines' workers for a run of checkpoints: one per engine (and per helper), kept alive
from checkpoint to checkpoint and restarted after a failure."""

from __future__ import annotations

import re
from pathlib import Path

from harness.engines import ENGINES, engine_spec
from harness.engines.environments import engine_python
from harness.engines.options import base_engine
from harness.engines.process import EngineFailure, EngineProcess, Limits


class EngineSession:
    """Keeps one worker per engine alive across checkpoints; restarts one after a failure."""

    def __init__(self, engines: list[str], work: Path, limits: Limits | None = None):
        self.engines = engines
        self.work = Path(work)
        self.limits = limits or Limits()
        self.processes: dict[str, EngineProcess] = {}
        self.unavailable: dict[str, str] = {}
        self.versions: dict[str, str] = {}
        #: each worker's greeting: version, interpreter, instruction-set class, threads
        self.infos: dict[str, dict] = {}
        #: every worker started, restarted ones included (their time counts: time_spent)
        self.started: list[tuple[str, EngineProcess]] = []

    def process(self, engine: str) -> EngineProcess | None:
        return self._worker(engine, engine_spec(engine), engine)

    def helper(self, engine: str, spec: str, name: str) -> EngineProcess | None:
        """A worker hosting `spec` (`module:Class`) in `engine`'s interpreter, kept alive like the
        engines' own (the tensor-parallel lane in vLLM's: one vLLM import per session, not per check)."""
        return self._worker(engine, spec, f"{engine}-{name}")

    def _worker(self, engine: str, spec: str, key: str) -> EngineProcess | None:
        if engine in self.unavailable:
            return None
        current = self.processes.get(key)
        if current and current.process and current.process.poll() is None:
            return current
        python, why = engine_python(engine)
        if python is None:
            self.unavailable[engine] = why
            return None
        entry = ENGINES.get(base_engine(engine))
        plain = spec.partition("[")[0]  # an engine with options is its entry's, not a helper's
        overrides = entry.overrides if entry is not None and plain == entry.spec else ()
        log = self.work / "logs" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.log"
        worker = EngineProcess(spec, python, log, self.limits, overrides)
        self.started.append((key, worker))
        try:
            info = worker.start()
        except EngineFailure as failure:
            if key != engine:  # a helper that cannot start says nothing of the engine
                raise
            self.unavailable[engine] = f"cannot start ({python}): {failure}"
            return None
        if key == engine:
            self.versions[engine] = info.get("version", "?")
            self.infos[engine] = info
        self.processes[key] = worker
        return worker

    def time_spent(self) -> dict[str, dict[str, float]]:
        """Seconds waited on each worker (engine, or engine-helper), per request op."""
        spent: dict[str, dict[str, float]] = {}
        for key, worker in self.started:
            ops = spent.setdefault(key, {})
            for op, seconds in worker.busy.items():
                ops[op] = ops.get(op, 0.0) + seconds
        return spent

    def close(self) -> None:
        for worker in self.processes.values():  # every worker exits at once, then each is waited for
            worker.ask_to_quit()
        for worker in self.processes.values():
            worker.close()
        self.processes.clear()
