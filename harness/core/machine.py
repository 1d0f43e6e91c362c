"""What a measurement depends on besides the software: the CPU's instruction-set class and the
thread count. Recorded with every golden (their kernels round differently: docs/golden.md) and
used to key cached capability probes. Imports no torch."""

from __future__ import annotations

import os
import platform
import sys
from functools import cache
from pathlib import Path

#: most capable first: the class a CPU belongs to is the first whose flags it has
ISA_CLASSES = (
    ("amx-fp8", {"amx_fp8"}),
    ("amx", {"amx_tile", "amx_bf16"}),
    ("avx512-bf16", {"avx512_bf16"}),
    ("avx512", {"avx512f"}),
    ("avx2", {"avx2"}),
)


@cache
def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return []


#: the flags a CPU of an emulated class lacks (scripts/isa_emulation: HARNESS_EMULATE_ISA avx2 or
#: avx512, where torch and vLLM act as on such a CPU), by prefix or by name
EMULATED_WITHOUT = {"avx2": ("avx512", "amx"), "avx512": ("avx512_bf16", "amx")}


def cpu_flags() -> frozenset[str]:
    line = next((line for line in _cpuinfo() if line.startswith(("flags", "Features"))), "")
    flags = frozenset(line.partition(":")[2].split())
    lacking = EMULATED_WITHOUT.get(os.environ.get("HARNESS_EMULATE_ISA", ""))
    return flags if lacking is None else frozenset(f for f in flags if not f.startswith(lacking))


def cpu_model() -> str:
    fallback = platform.processor() or platform.machine()
    return next((line.partition(":")[2].strip() for line in _cpuinfo() if line.startswith("model name")), fallback)


def isa_class(flags: frozenset[str] | None = None) -> str:
    """`amx`, `avx512-bf16`, `avx512`, `avx2` (x86) or the machine name (e.g. `aarch64`)."""
    flags = cpu_flags() if flags is None else flags
    for name, needed in ISA_CLASSES:
        if needed <= flags:
            return name
    return platform.machine() or "unknown"


def thread_count() -> int:
    """The intra-op threads torch uses in this process (torch if imported, else its defaults' source)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    return int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
