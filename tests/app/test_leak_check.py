"""The leak checker itself: it sees a leaked service process, socket and arena file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from kvtier.app.address import runtime_dir
from tests.app import wait_until
from tests.support import leak_check as lc
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401


def test_finds_a_leaked_process_socket_and_arena(tmp_path: Path) -> None:
    mark = os.environ[lc.MARK_ENV]  # set by the session fixture the autouse check depends on
    before = lc.snapshot(mark, [tmp_path])
    # A stand-in whose command line looks like the service's.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "kvtier.app.server"])
    arena = tmp_path / "kvtier-0123456789abcdef.arena"
    arena.write_bytes(b"x")
    sock_path = tmp_path / "svc.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        assert wait_until(lambda: proc.pid in lc.service_pids(mark), 5)
        pids, files = lc.find_leaks(before, mark, [tmp_path])
        assert proc.pid in pids
        assert {str(arena), str(sock_path)} <= files
    finally:
        proc.kill()
        proc.wait()
        sock.close()
        sock_path.unlink()
        arena.unlink()
    assert lc.find_leaks(before, mark, [tmp_path]) == (set(), set())


HOLDER = """
import fcntl, os, sys, time
if os.fork():
    os._exit(0)  # the grandchild is re-parented: outside the test's process tree
f = open(sys.argv[1])
fcntl.flock(f, fcntl.LOCK_EX)
print(os.getpid(), flush=True)
time.sleep(60)
"""


def test_arena_locked_by_another_session_is_not_ours(tmp_path: Path) -> None:
    mark = os.environ[lc.MARK_ENV]
    before = lc.snapshot(mark, [tmp_path])
    arena = tmp_path / "kvtier-fedcba9876543210.arena"
    arena.write_bytes(b"x")
    env = {k: v for k, v in os.environ.items() if k != lc.MARK_ENV}  # another session's process
    starter = subprocess.Popen([sys.executable, "-c", HOLDER, str(arena)], env=env,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert starter.stdout is not None
    holder = int(starter.stdout.readline())
    starter.wait()
    try:
        assert str(arena) not in lc.find_leaks(before, mark, [tmp_path])[1]
    finally:
        os.kill(holder, signal.SIGKILL)
    # Once nobody holds it, it is a leak like any other.
    assert wait_until(lambda: str(arena) in lc.find_leaks(before, mark, [tmp_path])[1], 5)
    arena.unlink()


def test_files_left_in_the_runtime_directory_are_leaks(tmp_path: Path) -> None:
    mark = os.environ[lc.MARK_ENV]
    directory = runtime_dir()
    assert directory in lc.runtime_dirs()  # the session's private one
    before = lc.snapshot(mark, [tmp_path])
    left = [directory / "e-0123456789abcdef.lock", directory / "e-0123456789abcdef.json", directory / "other"]
    for path in left:
        path.write_bytes(b"")
    try:
        assert lc.find_leaks(before, mark, [tmp_path]) == (set(), {str(p) for p in left})
    finally:
        for path in left:
            path.unlink()
    assert lc.find_leaks(before, mark, [tmp_path]) == (set(), set())


def test_a_lock_file_held_by_another_session_is_not_ours(tmp_path: Path) -> None:
    mark = os.environ[lc.MARK_ENV]
    before = lc.snapshot(mark, [tmp_path])
    lock = runtime_dir() / "e-fedcba9876543210.lock"
    lock.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k != lc.MARK_ENV}
    starter = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], env=env,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert starter.stdout is not None
    holder = int(starter.stdout.readline())
    starter.wait()
    try:
        assert str(lock) not in lc.find_leaks(before, mark, [tmp_path])[1]
    finally:
        os.kill(holder, signal.SIGKILL)
    assert wait_until(lambda: str(lock) in lc.find_leaks(before, mark, [tmp_path])[1], 5)
    lock.unlink()
