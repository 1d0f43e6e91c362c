"""The instruction-set class the harness says it runs on (harness.core.machine), and that it follows
scripts/isa_emulation: an emulated kind's known-issue preconditions (`isa`) must be the kind torch
and vLLM act as, not the machine's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.machine import EMULATED_WITHOUT, cpu_flags, isa_class

EMULATION = Path(__file__).resolve().parents[1] / "scripts" / "isa_emulation"
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})


def test_the_class_is_the_most_capable_whose_flags_the_cpu_has():
    assert isa_class(AVX512_BF16) == "avx512-bf16"
    assert isa_class(AVX512_BF16 | {"amx_tile", "amx_bf16"}) == "amx"
    assert isa_class(frozenset({"avx2", "fma"})) == "avx2"


@pytest.mark.parametrize(("emulated", "needs"), [("avx2", "avx2"), ("avx512", "avx512f")])
def test_an_emulated_kind_drops_the_flags_such_a_cpu_lacks(monkeypatch, emulated, needs):
    monkeypatch.delenv("HARNESS_EMULATE_ISA", raising=False)
    machine = cpu_flags()
    monkeypatch.setenv("HARNESS_EMULATE_ISA", emulated)
    flags = cpu_flags()
    assert not any(flag.startswith(EMULATED_WITHOUT[emulated]) for flag in flags)
    assert flags <= machine
    if needs in machine:  # emulation only goes downwards
        assert isa_class() == emulated


def test_the_emulation_patches_torch_only_in_a_process_that_imports_it():
    """sitecustomize imports no torch itself (the no-torch import tests hold under it), and patches
    torch's feature queries once a process imports it."""
    env = {"PYTHONPATH": str(EMULATION), "HARNESS_EMULATE_ISA": "avx2", "PATH": "/usr/bin:/bin"}
    probe = "import sys; print('torch' in sys.modules); import torch; print(torch.cpu._is_avx512_supported())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"], done.stderr
