"""Workers forked from a preloaded zygote (harness.engines.zygote) must be indistinguishable from
workers started afresh: same greeting, same numbers, same failures reported; and where a zygote
cannot serve, workers start afresh."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.engines.process import EngineFailure, EngineProcess, Limits
from harness.engines.zygote import ForkedWorker, Zygote

pytestmark = pytest.mark.usefixtures("needs_transformers")


@pytest.fixture
def needs_transformers():
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("zygote") / "checkpoint"
    generate(Recipe(format="ct-fp8-tensor", arch="llama", seed=3), out)
    return out


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def started(spec: str, log: Path) -> EngineProcess:
    worker = EngineProcess(spec, None, log, Limits(timeout_s=300))
    worker.start()
    return worker


def test_a_forked_worker_answers_exactly_as_a_fresh_one(checkpoint, tmp_path, monkeypatch):
    forked = started("reference", tmp_path / "forked.log")
    monkeypatch.setenv("HARNESS_FORK_WORKERS", "0")
    fresh = started("reference", tmp_path / "fresh.log")
    try:
        assert isinstance(forked.process, ForkedWorker) and isinstance(fresh.process, subprocess.Popen)
        assert forked.info == fresh.info
        sequences = [[1, 5, 9, 2, 7], [3, 3, 8]]
        answers = []
        for name, worker in (("forked", forked), ("fresh", fresh)):
            worker.load(checkpoint)
            answers.append(
                (
                    worker.weights(tmp_path / f"{name}-w.safetensors"),
                    worker.logprobs(sequences, tmp_path / f"{name}.st"),
                )
            )
        (forked_weights, forked_rows), (fresh_weights, fresh_rows) = answers
        assert forked_weights.keys() == fresh_weights.keys()
        assert all(torch.equal(forked_weights[k], fresh_weights[k]) for k in fresh_weights)
        assert all(torch.equal(a, b) for a, b in zip(forked_rows, fresh_rows, strict=True))
    finally:
        forked.close()
        fresh.close()
    assert forked.process.returncode == 0 == fresh.process.returncode


def test_one_environment_shares_a_zygote_another_gets_its_own_and_a_gone_zygote_is_not_reused(tmp_path, monkeypatch):
    first, second = started("reference", tmp_path / "a.log"), started("transformers", tmp_path / "b.log")
    monkeypatch.setenv("HARNESS_TEST_ZYGOTE", "other")
    third = started("reference", tmp_path / "c.log")
    workers = [first, second, third]
    try:
        parents = [parent_of(w.process.pid) for w in workers]
        assert parents[0] == parents[1] != parents[2]
        assert os.getpid() not in parents
        environ = Path(f"/proc/{third.process.pid}/environ").read_bytes().split(b"\0")
        assert b"HARNESS_TEST_ZYGOTE=other" in environ
        os.kill(parents[2], signal.SIGKILL)  # the other environment's zygote dies
        workers.append(started("reference", tmp_path / "d.log"))
        assert isinstance(workers[-1].process, subprocess.Popen)  # started afresh
        assert third.unsupported("fp8-block") is None  # the orphaned worker still serves
    finally:
        for worker in workers:
            worker.close()
    assert third.process.returncode is not None


def test_variables_read_only_when_called_share_a_zygote_and_still_reach_the_worker(tmp_path, monkeypatch):
    """The capability cache directory and an engine's interpreter variable are no part of a zygote's
    key (zygote.volatile): a worker asked for with other values forks from the same zygote and holds them."""
    from harness.engines.environments import variable_for

    first = started("reference", tmp_path / "a.log")
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(variable_for("reference"), sys.executable)
    second = started("tests.engines.environment_probe:EnvironmentProbe", tmp_path / "b.log")
    try:
        assert parent_of(first.process.pid) == parent_of(second.process.pid)
        environ = json.loads(second.info["version"])["environ"]
        assert environ["HARNESS_CACHE_DIR"] == str(tmp_path / "cache")
        assert environ[variable_for("reference")] == sys.executable
    finally:
        first.close()
        second.close()


def test_a_killed_forked_worker_is_reported_with_its_signal(tmp_path):
    worker = started("reference", tmp_path / "killed.log")
    try:
        os.kill(worker.process.pid, signal.SIGKILL)
        with pytest.raises(EngineFailure) as failure:
            worker.request("unsupported", format="fp8-block")
        assert failure.value.kind == "crash"
        assert worker.process.wait(timeout=10) == -signal.SIGKILL
    finally:
        worker.close()


def test_a_zygote_refuses_to_serve_when_preloading_starts_a_thread(tmp_path):
    (tmp_path / "starts_a_thread.py").write_text(
        textwrap.dedent("""\
            import threading, time
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        """)
    )
    probe = "import harness.engines.zygote as z; z.PRELOAD = ('numpy', 'starts_a_thread'); print(z._preload())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    greeting = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert "'ready': False" in greeting.stdout and "Python thread" in greeting.stdout


def interpreters() -> list[str]:
    """This environment's interpreter, and vLLM's where built."""
    from harness.engines.vllm.engine import find_vllm_python

    return [sys.executable, *filter(None, [find_vllm_python()])]


@pytest.mark.parametrize("python", interpreters(), ids=lambda path: Path(path).parts[-3])
def test_each_environments_own_zygote_is_ready_to_serve(python):
    """The real preload in each environment the suite runs: a package that starts a thread pool at
    import (scipy's OpenBLAS, which transformers imports wherever scipy is installed) would leave
    the zygote refusing to serve, and every worker then starts afresh (4 s each: the whole suite
    several times slower, and no test fails)."""
    probe = "import harness.engines.zygote as z; print(repr(z._preload()))"
    greeting = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert "'ready': True" in greeting.stdout.splitlines()[-1], greeting.stdout.splitlines()[-1]


PARENT_OF_A_WORKER = """
import sys
from pathlib import Path
from harness.engines.process import EngineProcess, Limits
worker = EngineProcess("reference", None, Path(sys.argv[1]), Limits(timeout_s=300))
worker.start()
print(Path(f"/proc/{worker.process.pid}/stat").read_text().rpartition(")")[2].split()[1])
worker.close()
"""


def test_commands_share_the_zygotes_of_a_shared_directory_until_it_goes(tmp_path):
    shared = tmp_path / "zygotes"
    env = {**os.environ, "HARNESS_ZYGOTES": str(shared)}
    parents = [
        subprocess.run(
            [sys.executable, "-c", PARENT_OF_A_WORKER, str(tmp_path / f"{n}.log")],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for n in range(2)
    ]
    assert parents[0] == parents[1]  # the second command's worker forked from the first's zygote
    assert running(int(parents[0])) and [p.suffix for p in shared.iterdir() if p.suffix != ".log"] == [".sock"]
    shutil.rmtree(shared)
    deadline = time.monotonic() + 30
    while running(int(parents[0])):
        assert time.monotonic() < deadline, "the zygote outlived its directory"
        time.sleep(0.2)


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaps has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_an_interpreter_that_cannot_run_a_zygote_is_told_at_once(tmp_path):
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho 'no harness here' >&2\nexit 3\n")
    failing.chmod(0o755)
    zygote = Zygote(str(failing), dict(os.environ), tmp_path / "z.sock", 0.0, timeout_s=600)
    assert zygote.why.startswith("the zygote exited with status 3 before listening"), zygote.why
    assert "no harness here" in (tmp_path / "z.log").read_text()


def test_a_forked_worker_holds_the_environment_a_fresh_one_would_after_the_same_imports(tmp_path, monkeypatch):
    """Importing the preloaded modules writes variables (torch's inductor cache directory, cv2's
    LD_LIBRARY_PATH, vLLM's own): a forked worker must hold them as a fresh worker would, and
    vLLM, imported before the fork, must still read a setting its worker makes after it, and the
    caches the zygote warmed must hold what the worker would have found itself. Run in
    vLLM's interpreter where there is one (it preloads the most), else in this one."""
    from harness.engines.vllm.engine import find_vllm_python

    python = find_vllm_python() or sys.executable
    for name in ("HARNESS_FORK_WORKERS", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # the suite's own zygotes serve
        monkeypatch.delenv(name, raising=False)
    seen = {}
    for mode in ("forked", "fresh"):
        if mode == "fresh":
            monkeypatch.setenv("HARNESS_FORK_WORKERS", "0")
        spec = "tests.engines.environment_probe:EnvironmentProbe"
        worker = EngineProcess(spec, python, tmp_path / f"{mode}.log", Limits(timeout_s=300))
        worker.start()
        try:
            assert isinstance(worker.process, ForkedWorker) == (mode == "forked")
            seen[mode] = json.loads(worker.info["version"])
        finally:
            worker.close()
    forked, fresh = seen["forked"], seen["fresh"]
    volatile = {"PYTEST_CURRENT_TEST", "HARNESS_FORK_WORKERS"}
    assert {k: v for k, v in forked["environ"].items() if k not in volatile} == {
        k: v for k, v in fresh["environ"].items() if k not in volatile
    }
    assert forked["signals"] == fresh["signals"]  # the zygote's SIGCHLD wake-up stays in the zygote
    has_vllm = forked["vllm_multiprocessing"] is not None
    assert forked["vllm_preloaded"] == has_vllm and not fresh["vllm_preloaded"]
    if has_vllm:  # read lazily: the worker's setting after the fork counts
        assert forked["vllm_multiprocessing"] is False is fresh["vllm_multiprocessing"]
        # the zygote's warm caches (WARM_WITH_VLLM): inherited, and what a fresh worker finds itself
        assert forked["isas_inherited"] and not fresh["isas_inherited"]
        assert forked["isas"] == fresh["isas"]


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_a_worker_asked_to_quit_runs_its_exit_hooks_and_exits_0(checkpoint, tmp_path, monkeypatch, forked):
    """exit_worker skips the interpreter's teardown (a second per worker), not what libraries
    registered to run at exit."""
    monkeypatch.setenv("HARNESS_TEST_EXIT_HOOKS", str(tmp_path))
    monkeypatch.setenv("HARNESS_FORK_WORKERS", "1" if forked else "0")
    worker = started("tests.doubles.exit_hooks:ExitHooksEngine", tmp_path / "worker.log")
    assert isinstance(worker.process, ForkedWorker) == forked
    worker.load(checkpoint)
    worker.close()
    assert worker.process.returncode == 0
    assert (tmp_path / "finalizer").read_text() == "ran"
    assert (tmp_path / "atexit").read_text() == "collected 0"  # a collection before the exit frees nothing
    assert not (tmp_path / "teardown").exists()
