"""A TEST DOUBLE, not an engine to use: the reference engine, registering at each load what libraries
register to run when a process ends (an atexit handler, a weakref finalizer, a garbage collection
asked for on the way), each writing a file under $HARNESS_TEST_EXIT_HOOKS, and an object only the
interpreter's teardown would delete, so a test sees which ran when its worker exited
(harness.engines.worker.exit_worker)."""

from __future__ import annotations

import atexit
import gc
import os
import weakref
from pathlib import Path

from harness.engines.reference_engine import ReferenceEngine


class _DeletedAtTeardown:
    def __init__(self, path: Path):
        self.path = path

    def __del__(self):
        self.path.write_text("ran")


_HELD: list[_DeletedAtTeardown] = []


class ExitHooksEngine(ReferenceEngine):
    def load(self, directory):
        report = super().load(directory)
        record = Path(os.environ["HARNESS_TEST_EXIT_HOOKS"])
        atexit.register(lambda: record.joinpath("atexit").write_text(f"collected {gc.collect()}"))
        weakref.finalize(self, record.joinpath("finalizer").write_text, "ran")
        _HELD.append(_DeletedAtTeardown(record / "teardown"))
        return report
