"""A pytest fixture that fails a test which leaves a kvtier process, socket, lock or arena file behind.

Register it for the whole suite from the root conftest::

    from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

(``no_kvtier_leaks`` is the autouse wrapper; import only ``leak_check`` to opt in per test.)

What counts as a leak, compared with a snapshot taken when the test started:
- a live (not zombie) process whose command line runs the service (``kvtier.app.server``, ``kvtier serve``)
  that is a descendant of the test process, or that carries this session's marker in its environment
  (a service re-parented to init after its spawner exited still carries it);
- any file in kvtier's runtime directories (``$XDG_RUNTIME_DIR/kvtier``, ``/tmp/kvtier-<uid>``):
  embedded services' sockets, state files and lock files (``e-*.lock``, removed by whoever releases
  one), unless a live process from outside this session holds its lock;
- a ``*.sock`` file in the test's ``tmp_path``;
- a ``kvtier-*.arena`` file in /dev/shm, in ``$KVTIER_SHM_DIR``, or in the test's ``tmp_path``,
  unless a live process from outside this session holds its lock (another test run on the machine).
Graceful shutdowns take a moment, so leaks must persist for ``LEAK_GRACE_S`` before they count. A
leaked process is killed and leaked files are removed, so one leak does not fail the tests after it.

The session fixture also points ``XDG_RUNTIME_DIR`` at a private directory, so default sockets and
embedded services of this session never mix with those of another session on the same machine, and
``VLLM_RPC_BASE_PATH`` at a directory inside it: vLLM's engines bind ZeroMQ sockets there and leave
the socket files behind when they exit (35 per run of the suite, in /tmp by default), so the session
removes them with the directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtier.bench.environ import environment

MARK_ENV = "KVT_LEAK_SESSION"  # not KVTIER_*: unknown KVTIER_ variables are configuration errors
LEAK_GRACE_S = 10.0  # a shutdown may drain disk/Redis writes (5 s) after a 2 s call grace
_SERVICE_MARKERS = ("kvtier.app.server", "app/server.py")


@dataclass
class Snapshot:
    """kvtier processes and files present at one moment."""

    pids: set[int] = field(default_factory=set)
    files: set[str] = field(default_factory=set)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _is_service_cmdline(argv: list[str]) -> bool:
    joined = " ".join(argv)
    if any(m in joined for m in _SERVICE_MARKERS):
        return True
    return any(Path(a).name == "kvtier" for a in argv[:3]) and "serve" in argv


def _processes() -> dict[int, tuple[int, str, list[str]]]:
    """pid -> (ppid, state, argv) of every process we can read."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _read(f"/proc/{entry.name}/stat").decode(errors="replace")
        if not stat:
            continue
        rest = stat.rsplit(")", 1)[-1].split()
        argv = [a.decode(errors="replace") for a in _read(f"/proc/{entry.name}/cmdline").split(b"\0")]
        out[int(entry.name)] = (int(rest[1]), rest[0], [a for a in argv if a])
    return out


def _descendants(procs: dict[int, tuple[int, str, list[str]]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def descendants(root: int) -> set[int]:
    """Every live (not zombie) descendant of root."""
    procs = _processes()
    return {pid for pid in _descendants(procs, root) if procs[pid][1] != "Z"}


def _has_mark(pid: int, mark: str) -> bool:
    return f"{MARK_ENV}={mark}".encode() in _read(f"/proc/{pid}/environ").split(b"\0")


def service_pids(mark: str) -> set[int]:
    """Live service processes of this test process's tree or of this session."""
    procs = _processes()
    mine = _descendants(procs, os.getpid())
    found = set()
    for pid, (_, state, argv) in procs.items():
        if state == "Z" or not _is_service_cmdline(argv):
            continue
        if pid in mine or (mark and _has_mark(pid, mark)):
            found.add(pid)
    return found


def runtime_dirs() -> list[Path]:
    """kvtier's runtime directories (app/address.py's runtime_dir): every file in them is kvtier's."""
    dirs = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime:
        dirs.append(Path(runtime) / "kvtier")
    dirs.append(Path(f"/tmp/kvtier-{os.getuid()}"))
    return dirs


def _file_dirs(extra: list[Path]) -> list[tuple[Path, bool]]:
    """(directory, recursive) to scan for sockets and arenas."""
    dirs: list[tuple[Path, bool]] = [(Path("/dev/shm"), False)]
    shm = os.environ.get("KVTIER_SHM_DIR", "")
    if shm:
        dirs.append((Path(shm), False))
    dirs.extend((p, True) for p in extra)
    return dirs


def kvtier_files(extra: list[Path]) -> set[str]:
    """Every file in kvtier's runtime directories, and sockets and arena files where kvtier puts them."""
    found: set[str] = set()
    for directory in runtime_dirs():
        with contextlib.suppress(OSError):
            found.update(str(path) for path in directory.iterdir() if not path.is_dir())
    for directory, recursive in _file_dirs(extra):
        if not directory.is_dir():
            continue
        entries = directory.rglob("*") if recursive else directory.iterdir()
        with contextlib.suppress(OSError):
            for path in entries:
                name = path.name
                is_arena = name.startswith("kvtier-") and name.endswith(".arena")
                is_sock = name.endswith(".sock") and directory != Path("/dev/shm")
                if is_arena or is_sock:
                    found.add(str(path))
    return found


def _lock_holders() -> dict[int, int]:
    """inode -> pid holding an flock on it (from /proc/locks)."""
    holders = {}
    for line in _read("/proc/locks").decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK":
            with contextlib.suppress(ValueError, IndexError):
                holders[int(parts[5].rsplit(":", 1)[-1])] = int(parts[4])
    return holders


def _foreign(path: str, mark: str, mine: set[int]) -> bool:
    """True for an arena or lock file whose lock a live process outside this session holds, and for
    an embedded service's socket or state file whose lock file is such a one."""
    if path.endswith((".sock", ".json")) and os.path.basename(path).startswith("e-"):
        lock = os.path.splitext(path)[0] + ".lock"
        return os.path.exists(lock) and _foreign(lock, mark, mine)
    if not path.endswith((".arena", ".lock")):
        return False
    try:
        inode = os.stat(path).st_ino
    except OSError:
        return True  # gone meanwhile
    pid = _lock_holders().get(inode)
    if pid is None or pid in mine:
        return False
    return not _has_mark(pid, mark)


def snapshot(mark: str, extra: list[Path]) -> Snapshot:
    """Current kvtier processes and files."""
    return Snapshot(service_pids(mark), kvtier_files(extra))


def find_leaks(before: Snapshot, mark: str, extra: list[Path]) -> tuple[set[int], set[str]]:
    """Processes and files present now that were not there before."""
    now = snapshot(mark, extra)
    pids = now.pids - before.pids
    mine = _descendants(_processes(), os.getpid())
    files = {f for f in now.files - before.files if not _foreign(f, mark, mine)}
    return pids, files


def _alive(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return bool(stat) and stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _describe(pid: int) -> str:
    argv = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    return f"pid {pid}: {argv}"


def _clean(pids: set[int], files: set[str]) -> None:
    # SIGTERM first: a service then removes its own socket, arena and state file.
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for path in files:
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.fixture(scope="session")
def kvtier_leak_session() -> Iterator[str]:
    """This session's marker (inherited by every process the tests start), private runtime dir and
    vLLM IPC socket dir."""
    mark = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="kvt-rt-") as runtime:
        os.chmod(runtime, 0o700)
        vllm_ipc = Path(runtime) / "vllm"
        vllm_ipc.mkdir()
        env = {MARK_ENV: mark, "XDG_RUNTIME_DIR": runtime, "VLLM_RPC_BASE_PATH": str(vllm_ipc)}
        with environment(env):
            yield mark


@pytest.fixture
def leak_check(request: pytest.FixtureRequest, kvtier_leak_session: str) -> Iterator[None]:
    """Fail the test if it leaves a kvtier process, socket or arena file behind."""
    extra: list[Path] = []
    if "tmp_path" in request.fixturenames:
        extra.append(request.getfixturevalue("tmp_path"))
    before = snapshot(kvtier_leak_session, extra)
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        pids, files = find_leaks(before, kvtier_leak_session, extra)
        if not pids and not files:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    described = [_describe(pid) for pid in sorted(pids)]
    _clean(pids, files)
    pytest.fail(
        "test left kvtier resources behind: "
        + "; ".join([*described, *(f"file {f}" for f in sorted(files))]),
        pytrace=False,
    )


@pytest.fixture(autouse=True)
def no_kvtier_leaks(leak_check: None) -> None:
    """Autouse form of leak_check, for a conftest that imports it."""
