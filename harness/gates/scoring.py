"""A tiny model's variant loaded in an engine's worker, ready to be gated, and what its golden records
about the machine it ran on."""

from __future__ import annotations

from pathlib import Path

from harness.core.errors import HarnessError, first_line


def loaded_scorer(session, engine: str, directory: Path, fmt: str):
    """(scorer, None) for `directory` loaded in `engine`, or (None, why not)."""
    from harness.engines.process import EngineError, EngineFailure
    from harness.gates.gate import WorkerScorer

    worker = session.process(engine)
    if worker is None:
        return None, f"unavailable: {session.unavailable[engine]}"
    try:
        reason = worker.unsupported(fmt) if fmt != "bf16" else None
        if reason:
            return None, f"unsupported: {reason}"
        worker.load(directory)
    except (EngineError, EngineFailure) as error:
        if getattr(error, "unsupported", False):
            return None, f"unsupported: {str(error).splitlines()[0]}"
        raise HarnessError(f"{engine} cannot load {directory}: {first_line(error)}") from None
    return WorkerScorer(worker, session.work / "scratch", directory), None


def provenance(session, engine: str, producer: str, command: str) -> dict:
    info = session.infos.get(engine, {})
    return {
        "engine_version": session.versions.get(engine, ""),
        "isa": info.get("isa", ""),
        "threads": int(info.get("threads", 0)),
        "dtype": "bfloat16",
        "producer": producer,
        "command": command,
    }


def unsupported_record(session, model: str, fmt: str, engine: str, why: str) -> dict:
    """golden/unsupported.toml's entry for a combination that cannot run on this machine."""
    import datetime

    from harness.core.machine import isa_class

    return {
        "model": model,
        "format": fmt,
        "engine": engine,
        "reason": why.removeprefix("unsupported: "),
        "engine_version": session.versions.get(engine, ""),
        "isa": isa_class(),
        "date": datetime.date.today().isoformat(),
    }
