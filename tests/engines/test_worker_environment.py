"""Engine workers inherit the user's environment, but for the overrides their registry entry names
because correctness needs them (harness.engines.EngineEntry.overrides): the CPU engines run with no
GPU visible, so a machine with one cannot send them down a CUDA path; a user's own engine, given as
`module:Class`, inherits everything."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.differential.runner import EngineSession
from harness.engines import ENGINES

USERS_ENGINE = "tests.doubles.buggy_engines:DroppedScaleEngine"


def environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_cpu_engines_hide_gpus_and_inherit_everything_else(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HARNESS_TEST_INHERITED", "yes")
    session = EngineSession(["reference", USERS_ENGINE], tmp_path)
    try:
        ours, users = (environment_of(session.process(e).process.pid) for e in ("reference", USERS_ENGINE))
    finally:
        session.close()
    assert ours["CUDA_VISIBLE_DEVICES"] == "" and ours["HARNESS_TEST_INHERITED"] == "yes"
    assert users["CUDA_VISIBLE_DEVICES"] == "0" and users["HARNESS_TEST_INHERITED"] == "yes"


def test_only_the_cpu_engines_override_anything():
    """sglang too: its loaders run on CPU with stand-in kernel choices (harness.engines.sglang)."""
    overriding = {name: dict(entry.overrides) for name, entry in ENGINES.items() if entry.overrides}
    assert overriding == {
        name: {"CUDA_VISIBLE_DEVICES": ""} for name in ("reference", "transformers", "compressed-tensors", "sglang")
    }
