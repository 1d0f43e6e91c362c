"""`python -m harness ...` as a user runs it: offline, the caller's environment plus whatever
variables a test adds, its own process, stdout, stderr and exit status.

Each call is a fresh process forked from a server that has already imported the CLI (and so
torch): importing them costs a new interpreter several seconds, and the suite makes dozens of
calls. The child takes the call's environment and working directory, writes to its own stdout and
stderr files (so its engine workers' output lands there as well) and exits with `main`'s status,
as `harness/__main__.py` does (a module the server could not import is imported, and fails, in the
child, with its traceback and status 1, as in a new interpreter). `fresh=True` runs a new interpreter instead (`python -m harness`), for what import
time decides.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: what a command imports before its work starts (torch among them), imported once by the server
PRELOADED = [
    "harness.commands.cli",
    *(
        f"harness.commands.{name}"
        for name in ("audit", "bisect", "check", "gate", "merge_reports", "run", "tp_shards", "upstream")
    ),
    "harness.differential.runner",
    "harness.checkpoints.writer",
]
_context = None


def run_cli(
    *args, timeout: float = 900, fresh: bool = False, cwd: str | Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """`python -m harness ARGS` in directory `cwd` (this one by default), with variables `env` set
    over this process's environment; TimeoutExpired past `timeout` (the call is killed)."""
    argv = [*map(str, args)]
    command = ["python", "-m", "harness", *argv]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    cwd = str(cwd or os.getcwd())
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "harness", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environment,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
        )
    with tempfile.TemporaryDirectory(prefix="harness-cli-") as scratch:
        out, err, status = Path(scratch) / "stdout", Path(scratch) / "stderr", Path(scratch) / "status"
        child = _forkserver().Process(target=_main, args=(argv, environment, cwd, str(out), str(err), str(status)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(
            command, _exit_status(child.exitcode, status), out.read_text(), err.read_text()
        )


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
    return _context


def _exit_status(exitcode: int, status: Path) -> int:
    """The child's exit status. multiprocessing's forkserver answers 255 when it could not read the
    status back (popen_forkserver.poll: the forkserver's report lost, seen once on a loaded 2-core
    machine with the right one-line error printed): there the status the child recorded on leaving
    `main` is its status. A child that died without recording one keeps multiprocessing's answer."""
    if exitcode == 255 and status.is_file() and status.read_text().strip():
        return int(status.read_text())
    return exitcode


def _main(argv: list[str], environment: dict[str, str], cwd: str, out: str, err: str, status: str) -> None:
    """In the forked child: the call's environment, directory and output files, then the CLI."""
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  (fd 1 itself; closed with the process)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.stdin = open(os.devnull)  # noqa: SIM115
    from harness.commands.cli import main

    try:
        sys.exit(main(argv))  # multiprocessing turns SystemExit (argparse's too) into the exit status
    except SystemExit as leaving:
        code = leaving.code
        Path(status).write_text(str(code if isinstance(code, int) else 0 if code is None else 1))
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
