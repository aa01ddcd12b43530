"""Python processes started as forks of one that has imported vLLM already.

Tests start a few dozen engine processes (engine scripts, OpenAI servers), and importing vLLM costs
each of them seconds of CPU (docs/performance.md, "Cheaper engine tests"). ``WarmStarter`` keeps one
process that has imported the modules once, and forks it for each ``python -m MODULE ARGS`` asked of
it: the fork runs the module as ``__main__`` with its own argument list, environment, working
directory, standard streams and session, and exits through the interpreter's normal shutdown.
``WarmProcess`` answers like ``subprocess.Popen``.

Not for a process whose point is a fresh interpreter: what the preloaded modules read from the
environment at import (vLLM's logging configuration, malloc and OpenMP settings) is the starter's,
and so are the modules it preloaded (a job's folder cannot shadow them). Those run through
``subprocess``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What the tests' own processes import: the engine, its OpenAI server and kvtier's connector.
PRELOAD = ("vllm", "vllm.entrypoints.openai.api_server", "kvtier.connector", "kvtier.bench.harness")
START_TIMEOUT_S = 120.0  # the preload itself: a few seconds, more on a busy machine
_MAX_MSG = 1 << 20


class WarmProcess:
    """A process forked by the starter; the subset of subprocess.Popen the tests use."""

    def __init__(self, pid: int, conn: socket.socket, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._conn = conn  # the starter writes the exit status here when the process ends

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; subprocess.TimeoutExpired past timeout."""
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def _read_status(self) -> None:
        data = self._conn.recv(64)
        self._conn.close()
        # A starter that died takes its children's statuses with it: report a killed process.
        self.returncode = int(data) if data else -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        """Send sig to the process (nothing once it has exited)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """One preloaded Python process and the forks asked of it."""

    def __init__(self, preload: Sequence[str] = PRELOAD, sys_path: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._owner = os.getpid()  # a fork of this process must not stop the owner's starter
        self._path = f"\0warm-start-{os.getpid()}-{id(self):x}"  # abstract: no file to clean up
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*sys_path, *filter(None, [env.get("PYTHONPATH", "")])])
        argv = [sys.executable, "-m", "tests.support.warm", self._path[1:], json.dumps(list(preload))]
        # Its stdin is how it learns that this process is gone; its stdout says when it listens.
        self._proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        self._ready = False

    @property
    def pid(self) -> int:
        """The starter's process id."""
        return self._proc.pid

    def wait_ready(self) -> None:
        """Wait until the starter has preloaded and listens (start() does it first)."""
        assert self._proc.stdout is not None
        if not select.select([self._proc.stdout], [], [], START_TIMEOUT_S)[0]:
            self.close()
            raise RuntimeError(f"the warm starter did not listen within {START_TIMEOUT_S:.0f} s")
        if self._proc.stdout.readline() != b"listening\n":
            self.close()
            raise RuntimeError(f"the warm starter exited with {self._proc.wait(10)}")
        self._ready = True

    def start(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        stdout: int,
        stderr: int,
        stdin: int | None = None,
        new_session: bool = False,
    ) -> WarmProcess:
        """Fork `python -m module args` with this environment, folder and stream descriptors (stdin:
        /dev/null unless given)."""
        job = {"module": module, "argv": list(args), "env": dict(env), "cwd": os.fspath(cwd)}
        job["new_session"] = new_session
        with self._lock:
            if not self._ready:
                self.wait_ready()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._path)
            fds = [stdout, stderr] if stdin is None else [stdout, stderr, stdin]
            socket.send_fds(conn, [json.dumps(job).encode()], fds)
            reply = conn.recv(64)
            if not reply:
                raise RuntimeError(f"the warm starter could not start {module}")
        except BaseException:
            conn.close()
            raise
        return WarmProcess(int(reply), conn, [module, *args])

    def close(self) -> None:
        """Stop the starter (processes it forked run on, as a fresh process's children would)."""
        if os.getpid() != self._owner:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()


REPO = Path(__file__).resolve().parents[2]
_shared: WarmStarter | None = None
_shared_lock = threading.Lock()


def starter() -> WarmStarter:
    """The session's starter, with the checkout on its path (for ``tests.*`` modules), started on
    first use and stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WarmStarter(sys_path=[str(REPO)])
            atexit.register(_shared.close)
        return _shared


@dataclass(frozen=True)
class Finished:
    """A job's exit status and what it wrote."""

    returncode: int
    stdout: str
    stderr: str

    def result(self) -> dict[str, Any]:
        """The JSON object on the job's last line of stdout; fails the test, with the end of its
        stderr, when the job failed."""
        assert self.returncode == 0, self.stderr[-4000:]
        return dict(json.loads(self.stdout.strip().splitlines()[-1]))


def run_module(module: str, args: Sequence[str], env: Mapping[str, str], timeout: float) -> Finished:
    """`python -m module args` in the checkout, to its end (killed past timeout, which then raises)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = starter().start(module, args, env=env, cwd=REPO, stdout=out.fileno(), stderr=err.fileno())
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
        out.seek(0)
        err.seek(0)
        return Finished(proc.wait(), out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def start_server(module: str, args: Sequence[str], env: Mapping[str, str], log: int) -> WarmProcess:
    """Start `python -m module args` in its own session (so its process group can be signalled),
    both streams to the descriptor log."""
    return starter().start(module, args, env=env, cwd=REPO, stdout=log, stderr=log, new_session=True)


# ------------------------------------------------------------------------------ the starter itself
def _serve(name: str, preload: list[str]) -> dict[str, Any] | None:
    """Preload, then fork one child per connection; returns the job in a child, None at the end."""
    for module in preload:
        __import__(module)
    import gc

    gc.collect()
    gc.freeze()  # what the preload built is never garbage: no child's collections walk it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0{name}")
    listener.listen(16)
    sys.stdout.write("listening\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready = select.select([listener, wake_r, sys.stdin], [], [])[0]
        if sys.stdin in ready:  # the client's end of stdin closed: it is gone
            return None
        if wake_r in ready:
            os.read(wake_r, 512)
            _reap(children)
        if listener in ready:
            job = _fork_one(listener, children, [wake_r, wake_w])
            if job is not None:
                return job


def _reap(children: dict[int, socket.socket]) -> None:
    """Report each ended child's exit status to its connection."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
            conn.close()


def _fork_one(listener: socket.socket, children: dict[int, socket.socket], pipe: list[int]) -> dict | None:
    """Accept one job and fork it; in the child, set it up and return the job."""
    conn, _ = listener.accept()
    msg, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MSG, 3)
    job = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        listener.close()
        conn.close()
        for c in children.values():
            c.close()
        for fd in pipe:
            os.close(fd)
        if job["new_session"]:
            os.setsid()
        if len(fds) < 3:
            fds.append(os.open(os.devnull, os.O_RDONLY))
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.dup2(fds[2], 0)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        return dict(job)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.sendall(str(pid).encode())
    return None


def main() -> None:
    """`python -m tests.support.warm NAME PRELOAD_JSON`: serve forks on the abstract socket NAME; a
    fork runs its job."""
    job = _serve(sys.argv[1], json.loads(sys.argv[2]))
    if job is None:
        return
    sys.argv = [job["module"], *job["argv"]]
    sys.path[0] = job["cwd"]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
