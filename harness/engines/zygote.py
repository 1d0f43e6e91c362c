"""A preloaded parent for engine workers (a zygote): it imports torch and transformers once and
forks a worker per request, so a worker starts in a fraction of a second instead of importing
them again (about 10 s per worker on a slow 2-core host, most of a short check's time).

`python -m harness.engines.zygote SOCKET LINGER_S` is started by `Zygote` (below) in the
interpreter, the environment and the directory its workers would get, and listens at the Unix
socket SOCKET; each client process connects once. A request carries the worker's spec, its
environment and three file descriptors (SCM_RIGHTS): the worker's stdin, stdout and stderr. The zygote forks; the child starts a session of its own, takes the three descriptors and
runs `harness.engines.worker.serve(spec)` exactly as `python -m harness.engines.worker` would.
The zygote answers each request with the child's pid and reports each child's exit status.

Forking is safe only where no thread pool the child would use has started: the zygote computes
nothing (no OpenMP region, no CUDA), and it refuses to serve when preloading started more native
threads than importing numpy (and, with vLLM, cv2) alone does: their OpenBLAS pools, which shut
down at a fork and re-create themselves after it. Once no client is connected and no worker it
forked runs, it waits LINGER_S seconds for another client (0 for a process's own zygotes, LINGER_S
below for a shared directory) or until its socket file goes, then exits: it never leaves a worker
for an init that reaps nothing.

What a forked worker shares with the zygote and a fresh one would not: the preloaded modules
(PRELOAD, and vLLM's in its own environment), already imported (the warnings they print at import
appear once, in no worker's log), the hash seed, and its initial environment block
(/proc/PID/environ) for the VOLATILE variables (its os.environ is exactly what a fresh worker's
would be). Python's `random` is reseeded in each child. `ps` shows a forked worker under the
zygote's command line.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: imported once by the zygote: what every CPU engine worker imports before it can answer
PRELOAD = (
    "numpy",
    "torch",
    "safetensors.torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "compressed_tensors",
    "harness.engines.worker",
    "harness.engines.base",
)
#: imported too where the interpreter has vLLM (its own environment): a forked vLLM worker would
#: otherwise import these after the fork, 4-6 s a worker on a 2-core host. vLLM reads its variables
#: lazily (vllm.envs.__getattr__, cached only once an engine core starts, which the zygote never
#: does), so a worker's own settings made after the fork still count; what importing them writes
#: into os.environ is replayed in each worker (ENVIRONMENT_WRITES)
PRELOAD_WITH_VLLM = (
    "cv2",  # vLLM's dependency; its bundled OpenBLAS starts a pool like numpy's (BLAS_POOLS)
    "vllm",
    "vllm.config",
    "vllm.entrypoints.llm",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
)
#: per-process caches vLLM's first forward fills, computed once by the zygote where vLLM is installed
#: (module, function of no arguments, cached by it): its sampler ranks prompt logprobs with a
#: torch.compile'd function, and even on a warm compile cache inductor first probes which vector ISAs
#: build and load here (a compiler and a python subprocess per ISA) and hashes triton's sources:
#: 1.2 of a forked vLLM worker's 1.8 s first forward on a 2-core host. Subprocesses and file reads
#: only: no kernel runs, no thread pool starts (the greeting still counts threads after them)
WARM_WITH_VLLM = (
    ("torch._inductor.cpu_vec_isa", "valid_vec_isa_list"),
    ("torch._inductor.codecache", "triton_key"),
)
#: modules whose OpenBLAS starts a thread pool at import that shuts down at a fork and re-creates
#: itself after it (OpenBLAS's pthread_atfork handlers): their threads are allowed, no other.
#: scipy bundles an OpenBLAS of its own, and transformers imports it wherever it is installed (its
#: loss functions, `scipy.optimize`): amd-quark brings it into the ci environment
BLAS_POOLS = ("numpy", "scipy.linalg", "cv2")
#: preloaded first where installed: a pool the preloaded modules would start anyway
PRELOAD_WHERE_INSTALLED = ("scipy.linalg",)
#: what importing PRELOAD wrote into os.environ (name -> value, None where it removed one): a
#: forked worker's environment is replaced by its request's, then these writes are made again,
#: as the same imports would have made them in a fresh worker
ENVIRONMENT_WRITES: dict[str, str | None] = {}
#: the most file descriptors a request carries
CARRIED = 3
#: variables that change from call to call and that no preloaded module reads: a zygote is keyed
#: by the environment without them, and each worker still gets their values (pytest sets its own
#: PYTEST_CURRENT_TEST for every test: keyed by it, every test would start a zygote). The harness's
#: capability cache directory and the interpreter chosen per engine ($HARNESS_<ENGINE>_PYTHON,
#: harness.engines.environments) are read when called, never at import: a user's or a test's choice of
#: them would otherwise cost a zygote each (5-7 s in vLLM's environment on a 2-core host)
VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "HARNESS_CACHE_DIR"})


def volatile(name: str) -> bool:
    """Whether `name` is left out of a zygote's key (VOLATILE, or an engine's interpreter)."""
    return name in VOLATILE or (name.startswith("HARNESS_") and name.endswith("_PYTHON"))


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def preloaded_modules() -> tuple[str, ...]:
    """What this interpreter's zygote imports: PRELOAD, PRELOAD_WITH_VLLM where vLLM is installed, and
    first the thread pools of PRELOAD_WHERE_INSTALLED that they would start anyway."""
    from importlib.util import find_spec

    installed = tuple(name for name in PRELOAD_WHERE_INSTALLED if find_spec(name.partition(".")[0]) is not None)
    return installed + PRELOAD + (PRELOAD_WITH_VLLM if find_spec("vllm") is not None else ())


def _preload() -> dict:
    """Import the preloaded modules; the greeting: whether forking is safe here, and why not."""
    failed, native = {}, None
    modules = preloaded_modules()
    before = dict(os.environ)
    for module in sorted(modules, key=lambda name: name not in BLAS_POOLS):  # pools first: counted
        try:
            __import__(module)
        except Exception as error:  # an engine that needs it will say so in its worker
            failed[module] = f"{type(error).__name__}: {error}"
        if module in BLAS_POOLS:
            native = _thread_count()
    if "vllm" in modules and "vllm" not in failed:
        _warm(WARM_WITH_VLLM, failed)
    after = dict(os.environ)
    ENVIRONMENT_WRITES.update(
        {name: after.get(name) for name in before.keys() | after.keys() if before.get(name) != after.get(name)}
    )
    threads = _thread_count()
    why = ""
    if threading.active_count() > 1:
        why = f"preloading started {threading.active_count() - 1} Python thread(s)"
    elif native is not None and threads > native:
        why = f"preloading started {threads - native} native thread(s) beyond those of {', '.join(BLAS_POOLS)}"
    return {"ready": not why, "why": why, "pid": os.getpid(), "threads": threads, "failed": failed}


def _warm(caches: tuple[tuple[str, str], ...], failed: dict[str, str]) -> None:
    """Fill each process-level cache once, so that every forked worker inherits it; one that moved
    or fails is left to each worker to fill, said in the zygote's log and the greeting's `failed`."""
    from importlib import import_module

    for module, function in caches:
        try:
            getattr(import_module(module), function)()
        except Exception as error:
            failed[f"{module}.{function}"] = f"{type(error).__name__}: {error}"
            print(
                f"zygote: {module}.{function} not warmed, each worker fills it: {failed[f'{module}.{function}']}",
                file=sys.stderr,
            )


def _send(channel: socket.socket, **message) -> None:
    try:
        channel.send(json.dumps(message).encode())
    except OSError:  # the harness has gone: the next receive says so
        pass


def serve(path: str, linger_s: float) -> tuple[dict, list[int]] | None:
    """Listen at `path`; fork a worker per request of any client until no client and no worker
    has been left for `linger_s` seconds (or `path` is gone and nothing runs): returns None. In a
    forked child, returns the request and its descriptors for the child to become that worker."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)
    except OSError:  # another zygote already serves this path: its starter's race, lost
        return None
    mine = os.stat(path).st_ino
    listener.listen(16)
    greeting = _preload()
    wakeup = _wake_on_child_exit()
    clients: list[socket.socket] = []
    owners: dict[int, socket.socket] = {}  # worker pid -> the connection that asked for it
    idle_since = time.monotonic()
    while True:
        readable, _, _ = select.select([listener, wakeup, *clients], [], [], 1.0)
        _reap(owners)
        for channel in readable:
            if channel is wakeup:
                with contextlib.suppress(BlockingIOError):
                    os.read(wakeup, 4096)
                continue
            if channel is listener:
                client, _ = listener.accept()
                _send(client, **greeting)
                if greeting["ready"]:
                    clients.append(client)
                else:
                    client.close()
                continue
            try:
                message, fds, _, _ = socket.recv_fds(channel, 65536, CARRIED)
            except ConnectionError:
                message, fds = b"", []
            if not message:
                clients.remove(channel)
                channel.close()
                continue
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _leave_the_loop([listener, *clients], wakeup)
                return request, fds
            for fd in fds:
                os.close(fd)
            owners[pid] = channel
            _send(channel, started=request["id"], pid=pid)
        if clients or owners:
            idle_since = time.monotonic()
        elif not greeting["ready"] or time.monotonic() - idle_since >= linger_s or not _still_mine(path, mine):
            if _still_mine(path, mine):
                os.unlink(path)
            return None


def _wake_on_child_exit() -> int:
    """A descriptor that becomes readable when a child exits (SIGCHLD, through signal's wakeup fd):
    a worker's exit status reaches its client at once rather than at the loop's next poll, which
    had cost every close of a forked worker up to 0.1 s."""
    readable, writable = os.pipe()
    for fd in (readable, writable):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(writable)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return readable


def _leave_the_loop(channels: list[socket.socket], wakeup: int) -> None:
    """In a forked child: close the zygote's sockets and its wakeup pipe, and give SIGCHLD back its
    default disposition, as in a fresh interpreter."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wakeup, signal.set_wakeup_fd(-1)):
        os.close(fd)
    for channel in channels:
        channel.close()


def _reap(owners: dict[int, socket.socket]) -> None:
    while owners:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        _send(owners.pop(pid), exited=pid, status=os.waitstatus_to_exitcode(status))


def _still_mine(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def become_worker(request: dict, fds: list[int]) -> int:
    """In a forked child: what `python -m harness.engines.worker SPEC` would be, on these descriptors."""
    import random

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    sys.argv = [sys.argv[0], request["spec"]]
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in ENVIRONMENT_WRITES.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    random.seed()
    from harness.engines.worker import serve as serve_engine

    return serve_engine(request["spec"])


class ForkedWorker:
    """A worker forked by a zygote, with the part of subprocess.Popen's interface EngineProcess uses."""

    def __init__(self, zygote: Zygote, pid: int, stdin, stdout):
        self.zygote, self.pid, self.stdin, self.stdout = zygote, pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


class Zygote:
    """The harness's side of one zygote: reach it (starting it if nobody has), ask it for workers,
    learn how they ended."""

    def __init__(self, python: str, env: dict[str, str], path: Path, linger_s: float, timeout_s: float):
        self.statuses: dict[int, int] = {}
        self.started: dict[int, int] = {}
        self.forked: set[int] = set()
        self.requests = 0
        #: why this zygote cannot serve ("" while it can)
        self.why = ""
        self.channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if not self._connect(path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a socket nobody listens at: its zygote died
            with path.with_suffix(".log").open("ab") as log:  # what the zygote itself says, e.g. a crash
                process = subprocess.Popen(
                    [python, "-m", "harness.engines.zygote", str(path), str(linger_s)],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            deadline = time.monotonic() + min(timeout_s, 60.0)
            while not self._connect(path):
                if process.poll() is not None:  # and nobody else listens there either
                    self.why = f"the zygote exited with status {process.returncode} before listening (log: {log.name})"
                    return
                if time.monotonic() > deadline:
                    self.why = f"the zygote at {path} did not listen within 60 s"
                    return
                time.sleep(0.05)
        greeting = self._next(timeout_s) or {"why": self.why or f"no greeting within {timeout_s:.0f} s"}
        if not greeting.get("ready"):
            self.why = self.why or greeting.get("why", "it stopped before greeting")
            self.channel.close()

    def _connect(self, path: Path) -> bool:
        try:
            self.channel.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        return True

    def _next(self, timeout: float | None) -> dict | None:
        """The zygote's next message within `timeout` (None: wait), or None; records what it says."""
        ready, _, _ = select.select([self.channel], [], [], timeout)
        if not ready:
            return None
        try:
            message = self.channel.recv(65536)
        except OSError:
            message = b""
        if not message:
            self.why = self.why or "the zygote exited"
            return None
        message = json.loads(message)
        if "exited" in message:
            self.statuses[message["exited"]] = message["status"]
        if "started" in message:
            self.started[message["started"]] = message["pid"]
        return message

    def spawn(self, spec: str, env: dict[str, str], stderr: int, timeout_s: float = 60.0) -> ForkedWorker | None:
        """A forked worker serving `spec` with `env` as its os.environ (the zygote's but for its
        volatile variables), its stderr on descriptor `stderr`; None if the zygote fails."""
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        self.requests += 1
        request = self.requests
        try:
            socket.send_fds(
                self.channel,
                [json.dumps({"id": request, "spec": spec, "env": env}).encode()],
                [stdin_read, stdout_write, stderr],
            )
        except OSError as error:
            self.why = f"the zygote cannot be asked: {error}"
        finally:
            os.close(stdin_read)
            os.close(stdout_write)
        while not self.why and request not in self.started:
            if self._next(timeout_s) is None and request not in self.started:
                self.why = self.why or f"the zygote forked nothing within {timeout_s:.0f} s"
        if self.why:
            os.close(stdin_write)
            os.close(stdout_read)
            return None
        pid = self.started.pop(request)
        self.forked.add(pid)
        return ForkedWorker(self, pid, open(stdin_write, "w", buffering=1), open(stdout_read))

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        """`pid`'s exit status once the zygote has reaped it, waiting up to `timeout` (None: as long
        as it takes); None if it still runs. Where the zygote is gone, nobody learns the status: a
        worker that no longer exists (or is a zombie nobody reaps) then ended with status -1."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.statuses:
            if deadline is not None and time.monotonic() >= deadline and timeout != 0:
                return None
            if self.why:
                if not _alive(pid):
                    self.forked.discard(pid)
                    return -1
                if timeout == 0:
                    return None
                time.sleep(0.1)
            else:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._next(left) is None and timeout == 0 and pid not in self.statuses:
                    return None
        self.forked.discard(pid)
        return self.statuses.pop(pid)

    def alive(self) -> bool:
        while not self.why and self._next(0) is not None:  # an exited zygote says so here
            pass
        return not self.why

    def busy(self) -> bool:
        """Whether a worker it forked may still run (its exit status is learnt only from the zygote)."""
        return self.alive() and any(pid not in self.statuses and _alive(pid) for pid in self.forked)

    def close(self) -> None:
        """Hang up (statuses already sent stay known); the zygote goes once idle for its linger."""
        self.alive()
        self.why = self.why or "closed"
        self.channel.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


#: at most this many zygotes are kept connected by a process (each holds about 0.5 GB of imported
#: modules); the one used least recently hangs up first, once no worker it forked runs
KEPT = 2
#: seconds a zygote in a shared directory ($HARNESS_ZYGOTES) waits, idle, for the next command's
#: workers; a process's own zygotes (no such directory) go as soon as it hangs up
LINGER_S = 120.0
_zygotes: dict[tuple, Zygote] = {}
_private: list[Path] = []


def forked_worker(python: str, env: dict[str, str], spec: str, stderr: int, timeout_s: float) -> ForkedWorker | None:
    """A worker for `spec` forked from the zygote of (`python`, `env`, this directory), reached or
    started on first use, in any interpreter (vLLM's with vLLM preloaded); None where workers are
    not forked: $HARNESS_FORK_WORKERS=0, or a zygote that cannot serve (its reason is kept, and it is not retried by this process)."""
    if os.environ.get("HARNESS_FORK_WORKERS", "1") == "0":
        return None
    key = (python, os.getcwd(), tuple(sorted((k, v) for k, v in env.items() if not volatile(k))))
    zygote = _zygotes.pop(key, None)
    if zygote is None:
        directory, linger_s = _directory()
        path = directory / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:20]}.sock"
        zygote = Zygote(python, env, path, linger_s, timeout_s)
    _zygotes[key] = zygote
    for idle in [k for k, z in _zygotes.items() if k != key and not z.busy()][: max(0, len(_zygotes) - KEPT)]:
        _zygotes.pop(idle).close()
    return zygote.spawn(spec, env, stderr) if zygote.alive() else None


def _directory() -> tuple[Path, float]:
    """Where this process's zygotes listen, and how long they outlive their last client: the
    shared $HARNESS_ZYGOTES (created, private to this user), else a directory of its own."""
    shared = os.environ.get("HARNESS_ZYGOTES")
    if shared:
        Path(shared).mkdir(mode=0o700, parents=True, exist_ok=True)
        return Path(shared), LINGER_S
    if not _private:
        _private.append(Path(tempfile.mkdtemp(prefix="harness-zygotes-")))
        atexit.register(shutil.rmtree, _private[0], True)
    return _private[0], 0.0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    child = serve(sys.argv[1], float(sys.argv[2]))
    if child is None:
        sys.exit(0)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    from harness.engines.worker import exit_worker

    exit_worker(become_worker(*child))
