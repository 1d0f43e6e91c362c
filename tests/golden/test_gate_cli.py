"""`quantize`, `ppl` and `gate` from the command line: exit 0 pass, 1 fail, 2 error, one line on error."""

from __future__ import annotations

import pytest

from harness.lm import faults
from tests.cli import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "v"
    done = run_cli("quantize", "tiny-qwen2", "--format", "fp8-block", "--out", out)
    assert done.returncode == 0, done.stderr
    return out


def test_ppl_prints_perplexity_and_continuations(clean):
    done = run_cli("ppl", clean, "--engine", "reference")
    assert done.returncode == 0, done.stderr
    assert "perplexity 1.4" in done.stdout and "'the old ' -> " in done.stdout


def test_gate_passes_clean_and_fails_faulty(clean, tmp_path):
    passed = run_cli("gate", clean, "--engine", "reference")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.strip().endswith("gate: PASS")
    import shutil

    faulty = tmp_path / "faulty"
    shutil.copytree(clean, faulty)
    faults.drop_scale(faulty, "model.layers.1.self_attn.v_proj")
    failed = run_cli("gate", faulty, "--engine", "reference")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "gate: FAIL" in failed.stdout and "perplexity" in failed.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("gate", "/nonexistent/dir"),
        ("ppl", "/nonexistent/dir"),
        ("quantize", "tiny-gpt", "--format", "fp8-block", "--out", "x"),
        ("quantize", "tiny-qwen2", "--format", "int3", "--out", "x"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, tmp_path):
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "x").exists()


def test_gate_of_a_directory_not_made_from_a_tiny_model_is_an_error(tmp_path):
    done = run_cli("gate", tmp_path, "--engine", "reference")
    assert done.returncode == 2 and "not made from a tiny model" in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("golden", "--engines", "nope"),
        ("golden", "--formats", "int3"),
        ("golden", "--models", "tiny-gpt"),
        ("quantize", "tiny-qwen2", "--format", "fp8-block", "--producer", "compressed-tensors", "--out", "x"),
    ],
)
def test_golden_and_quantize_refuse_bad_input_before_any_work(args, tmp_path):
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not any(tmp_path.iterdir()), "nothing written"
