"""`python -m harness ...` in a subprocess, as a user runs it: offline, the caller's environment
plus whatever variables a test adds."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )
