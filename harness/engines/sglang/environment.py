"""Where SGLang's interpreter is. SGLang (0.5.23: torch 2.14 for CUDA 13, transformers 5.19) lives in
an environment of its own, 11 GiB, as vLLM does: $HARNESS_SGLANG_PYTHON names its python, else the
current interpreter if it has `sglang`, else the project's `.venv-sglang` or `.tox/sglang` (the registry's
entry, harness.engines.ENGINES; `tox -e sglang` builds the latter). Imports no SGLang."""

from __future__ import annotations

from pathlib import Path

from harness.engines.environments import engine_python, variable_for

VARIABLE = variable_for("sglang")


def find_sglang_python() -> str | None:
    """An interpreter with SGLang, found without importing SGLang; None where there is none."""
    python, _ = engine_python("sglang")
    return python if python and Path(python).is_file() else None


def sglang_unavailable_reason() -> str | None:
    """Why no SGLang interpreter is found here, in one line; None where one is."""
    python, why = engine_python("sglang")
    if python is None:
        return why
    if not Path(python).is_file():
        return f"{VARIABLE} names {python}, which is not a file"
    return None
