"""Machine facts the benchmark scripts record beside their figures (the CPU model and instruction-set
class from harness.core.machine, the one place that reads them)."""

import platform
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.core.machine import cpu_model, isa_class  # noqa: E402

__all__ = ["cpu_model", "isa_class", "machine_tag"]


def machine_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", platform.node() or platform.machine() or "unknown")
