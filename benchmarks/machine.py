"""Machine facts the benchmark scripts record beside their figures."""

import platform
import re
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", platform.node() or platform.machine() or "unknown")
