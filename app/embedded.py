"""Embedded mode: one private kvtier service per vLLM engine, started by whoever needs it first.

Who owns what: the spawned service owns its socket, arena and state file and removes them when it
stops; the spawner keeps only a reaper thread for the short-lived process it started.
Design: docs/internals.md#embedded-mode-embeddedpy-daemonpy
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.app import protocol as p
from kvtier.app.address import MAX_UNIX_PATH, runtime_dir
from kvtier.app.client import ServiceClient
from kvtier.app.logs import LogStream
from kvtier.app.settings import ENV_PREFIX, KVTierSettings
from kvtier.runtime.affinity import call_on, engine_cpus, format_cpus, unbound_environ

log = logging.getLogger("kvtier.embedded")

STARTUP_TIMEOUT_S = 30.0
RESPAWN_TIMEOUT_S = 10.0  # a respawn starts warm (no first import of kvtier from a cold disk)
PROBE_TIMEOUT_S = 0.5
STALE_WAIT_S = 3.0
STUCK_AFTER_S = 20.0  # a live service silent this long is stuck, not busy: it is replaced
RESPAWN_BACKOFF_S = (0.5, 8.0)  # the wait before a respawn attempt: doubles per failure, capped


class EmbeddedError(Exception):
    """The embedded service could not be found or started."""


def engine_key(engine_id: str) -> str:
    """A short, filename-safe digest of vLLM's engine id (keeps socket paths below 108 bytes)."""
    return hashlib.sha256(engine_id.encode()).hexdigest()[:16]


def paths_for(engine_id: str, base: Path | None = None) -> tuple[Path, Path, Path]:
    """(socket, lock, state file) of the engine's service."""
    directory = base or runtime_dir()
    stem = directory / f"e-{engine_key(engine_id)}"
    sock = Path(f"{stem}.sock")
    if len(os.fsencode(str(sock))) > MAX_UNIX_PATH:
        raise EmbeddedError(f"socket path {sock} is longer than {MAX_UNIX_PATH} bytes")
    return sock, Path(f"{stem}.lock"), Path(f"{stem}.json")


def service_env(settings: KVTierSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the parent's without KVTIER_*, plus every resolved setting.

    Settings may have come from kv_connector_extra_config, which the child cannot see, so each one
    is passed explicitly; secrets travel in the environment, never on the command line.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    for key in [k for k in env if k.upper().startswith(ENV_PREFIX)]:
        del env[key]
    for name in KVTierSettings.model_fields:
        if name in ("service_url", "config_file"):
            continue
        value = getattr(settings, name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(int(value)) if isinstance(value, int) else str(value)
        env[f"{ENV_PREFIX}{name.upper()}"] = text
    return env


def probe(path: Path | str, token: str = "", timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when a live service answers a hello on the unix socket at path.

    A bare connect() is not enough: a service being killed still completes connects on its
    listening socket until its last file is closed.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        sock.sendall(p.FrameEncoder().encode(p.Hello(id=1, version=p.PROTOCOL_VERSION, token=token)))
        decoder = p.reply_decoder()
        while True:
            data = sock.recv(4096)
            if not data:
                return False
            if decoder.feed(data):
                return True  # any reply, even a refusal, comes from a live service
    except (OSError, p.ProtocolError):
        return False
    finally:
        sock.close()


def _names(path: Path, fd: int) -> bool:
    """True when path (not followed if a link) still names the open file fd."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (info.st_dev, info.st_ino) == (own.st_dev, own.st_ino)


def _flock_by(fd: int, path: Path, deadline: float) -> None:
    """Take the exclusive flock of fd, waiting until deadline."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise EmbeddedError(f"timed out waiting for {path}") from None
            time.sleep(0.02)


def _acquire(path: Path, deadline: float) -> int:
    """An fd holding the flock of the file that path names now.

    Only a holder removes the file, so a lock taken on a file that path no longer names (removed, or
    replaced by a new one, while we waited) protects nothing: try again on what path names now.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            _flock_by(fd, path, deadline)
            if _names(path, fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    """Hold the lock file at path; removed when released, so none is left behind."""
    fd = _acquire(path, time.monotonic() + timeout)
    try:
        yield
    finally:
        try:
            if _names(path, fd):  # always true: only a holder removes or replaces it
                path.unlink()
        finally:
            os.close(fd)  # closing drops the lock; a waiter finds the file gone and tries again


def sweep_locks(directory: Path) -> int:
    """Remove the lock files of embedded services that nobody holds; returns how many.

    A process killed while it held a lock leaves the file. Only a file whose lock this call takes,
    and which its path still names, is removed (see ``_acquire``), so a lock in use is never lost.
    """
    removed = 0
    for path in directory.glob("e-*.lock"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # removed meanwhile, or not a regular file of ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _names(path, fd):
                path.unlink()
                removed += 1
        except OSError:
            continue  # held: in use
        finally:
            os.close(fd)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _remove_unlocked_arena(path: str) -> None:
    """Unlink a dead service's arena unless a live process still holds its lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        log.info("removed the arena of a dead kvtier service", extra={"arena": path})
    finally:
        os.close(fd)


def _maybe_service(pid: int) -> bool:
    """False only when pid is provably another program (its pid was reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True
    # A process that is exiting (kill -9 in progress) has an empty cmdline but still holds its locks.
    return not cmdline or b"kvtier.app.server" in cmdline


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _recorded(state: Path) -> tuple[int, str] | None:
    """The pid (0 for none) and arena path ('' for none) a service wrote to its state file; None
    when the file cannot be read or parsed."""
    try:
        data = json.loads(state.read_text())
        return int(data.get("pid", 0) or 0), str(data.get("arena", "") or "")
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def clean_stale(sock: Path, state: Path, token: str = "", patience: float = STUCK_AFTER_S) -> bool:
    """Remove what a dead service left: its socket, its arena (if unlocked) and its state file.

    A recorded service that is still alive is asked again and again for up to `patience` seconds: a
    busy machine can keep a live service from answering for seconds, and one that is starting
    writes its state before it listens. Only one that exits meanwhile (kill -9 takes a moment to
    release its files) or stays silent throughout (stuck) loses its files; a stuck one gets SIGTERM,
    then SIGKILL. Returns True (and touches nothing) when the recorded service answers.
    """
    pid, arena = _recorded(state) or (0, "")
    if pid and _pid_alive(pid) and _maybe_service(pid):
        if _answers(sock, token, pid, patience):
            return True
        if _pid_alive(pid) and _maybe_service(pid):
            log.warning("terminating a kvtier service silent for %.0fs", patience, extra={"pid": pid})
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
                if _wait_gone(pid, STALE_WAIT_S):
                    break
    if arena:
        _remove_unlocked_arena(arena)
    sock.unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    return False


def _answers(sock: Path, token: str, pid: int, patience: float) -> bool:
    """True once the service at sock answers a hello; False when pid exits first or patience ends."""
    deadline = time.monotonic() + patience
    while _pid_alive(pid):
        if probe(sock, token, timeout=min(1.0, max(0.05, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return False


def sweep_dead(directory: Path) -> int:
    """Remove the files of every dead embedded service in directory (other engines' included).

    Engine ids are new for every engine, so a service that died hard leaves files nobody would
    ever reuse; each start of a service clears them. Returns how many services were swept.
    """
    swept = 0
    for state in directory.glob("e-*.json"):
        recorded = _recorded(state)
        if recorded is None:
            continue
        pid, arena = recorded
        if pid and _pid_alive(pid) and _maybe_service(pid):
            continue  # alive, or starting (it writes its state before it listens)
        if arena:
            _remove_unlocked_arena(arena)
        state.with_suffix(".sock").unlink(missing_ok=True)
        state.unlink(missing_ok=True)
        swept += 1
    return swept


def _spawn(
    settings: KVTierSettings, sock: Path, state: Path, log_stream: LogStream
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "kvtier.app.server",
        "--url",
        f"unix://{sock}",
        "--parent-pid",
        str(os.getpid()),
        "--state-file",
        str(state),
        "--detach",  # out of vLLM's process tree, which vLLM SIGKILLs at shutdown (app/daemon.py)
        "--log-stream",
        log_stream,  # its lines go where the engine's own log lines go
    ]
    cpus = engine_cpus()
    if cpus:
        cmd += ["--cpus", format_cpus(cpus)]
    # The child finds kvtier as this process did (installed, or PYTHONPATH); nothing in its
    # environment may bind it to the core vLLM runs its model on (runtime/affinity.py).
    env = unbound_environ(service_env(settings))

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True
        )

    # Started from a thread on the engine's CPUs: the spawning thread may be bound to the model's core.
    proc = call_on(cpus, popen) if cpus else popen()
    # Reap the child whenever it exits so it never lingers as a zombie of the engine process.
    threading.Thread(target=proc.wait, name="kvtier-service-reaper", daemon=True).start()
    return proc


def _wait_ready(proc: subprocess.Popen[bytes], sock: Path, state: Path, token: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe(sock, token):
            _wait_detached(proc, state, deadline)
            return
        if proc.poll():  # 0: the detached service serves (the probe sees it next time round)
            raise EmbeddedError(
                f"the kvtier service exited with status {proc.returncode} while starting "
                "(its log is on this process's stderr)"
            )
        if proc.returncode == 0 and died_detached(proc.pid, state):
            raise EmbeddedError(
                "the kvtier service died right after it detached, before it answered "
                "(its log is on this process's stderr)"
            )
        time.sleep(0.02)
    # Its process group: the process spawned and the service it may have forked (app/daemon.py).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STALE_WAIT_S)
    raise EmbeddedError(f"the kvtier service did not serve on {sock} within {timeout:.0f}s; killed it")


def died_detached(spawned: int, state: Path) -> bool:
    """Whether the service that the process spawned (pid spawned) forked away, and recorded in its
    state file before it listened, is dead: a start that can no longer serve, known at once."""
    recorded = _recorded(state)
    return recorded is not None and recorded[0] not in (0, spawned) and not _pid_alive(recorded[0])


def _wait_detached(proc: subprocess.Popen[bytes], state: Path, deadline: float) -> None:
    """Once the service serves, wait (until deadline) for the process spawned to exit when it forked
    the service away (app/daemon.py): it exits right after the service listens, and until then the
    service is still in the engine's process tree, which vLLM SIGKILLs at shutdown."""
    recorded = _recorded(state)
    if recorded is None or recorded[0] == proc.pid:  # not detached (no pidfd): proc is the service
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(0.0, deadline - time.monotonic()))


def ensure_service(
    settings: KVTierSettings,
    engine_id: str,
    *,
    startup_timeout: float = STARTUP_TIMEOUT_S,
    log_stream: LogStream = "stderr",
) -> str:
    """The URL of the service: service_url when set, else the engine's embedded one (started here
    if no process of the engine has started it yet, or if it died), logging to log_stream."""
    if settings.service_url:
        return settings.service_url
    return _ensure_embedded(settings, engine_id, startup_timeout, log_stream)[0]


def _ensure_embedded(
    settings: KVTierSettings, engine_id: str, startup_timeout: float, log_stream: LogStream
) -> tuple[str, bool]:
    """(url, whether this call started the service) of the engine's embedded service."""
    sock, lock, state = paths_for(engine_id)
    url = f"unix://{sock}"
    token = settings.auth_token
    if probe(sock, token):
        return url, False
    # Another process may hold the lock while its own start runs for up to the longest timeout.
    with _locked(lock, max(startup_timeout, STARTUP_TIMEOUT_S) + STUCK_AFTER_S + 2 * STALE_WAIT_S + 5.0):
        if probe(sock, token):  # another process of the engine started it while we waited
            return url, False
        if clean_stale(sock, state, token):
            return url, False
        sweep_dead(sock.parent)
        sweep_locks(sock.parent)
        log.info("starting the embedded kvtier service", extra={"url": url})
        proc = _spawn(settings, sock, state, log_stream)
        _wait_ready(proc, sock, state, token, startup_timeout)
    return url, True


@dataclass
class RespawnCounts:
    """What one process's respawns of its embedded service came to (read by the connector's stats)."""

    started: int = 0  # respawns that brought a serving service up
    failed: int = 0  # respawns that did not serve within their timeout (killed) or could not start


class Respawner:
    """An ``on_unavailable`` hook for ServiceClient that restarts the embedded service when it died.

    A respawn that does not serve within ``timeout`` is killed (``ensure_service``) and tried again
    at the client's next failed connect, after a wait that doubles with each failure in a row
    (``RESPAWN_BACKOFF_S``), so a service that cannot start is not spawned in a tight loop and one
    that can is never given up on while the engine runs.
    """

    def __init__(
        self,
        settings: KVTierSettings,
        engine_id: str,
        log_stream: LogStream = "stderr",
        counts: RespawnCounts | None = None,
        *,
        timeout: float = RESPAWN_TIMEOUT_S,
        backoff: tuple[float, float] = RESPAWN_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._settings = settings
        self._engine_id = engine_id
        self._log_stream = log_stream
        self.counts = counts if counts is not None else RespawnCounts()
        self.timeout = timeout  # how long one respawn may take to serve before it is killed
        self._first_wait, self._max_wait = backoff
        self._clock, self._sleep = clock, sleep
        self._failures = 0  # in a row
        self._last = -math.inf
        self._guard = threading.Lock()

    def next_wait(self) -> float:
        """Seconds between the last attempt and the next one."""
        return float(min(self._max_wait, self._first_wait * 2**self._failures))

    def __call__(self) -> None:
        """Restart the service if it is gone (runs on the client's executor thread; may block)."""
        with self._guard:
            remaining = self._last + self.next_wait() - self._clock()
            if remaining > 0:
                self._sleep(remaining)
            self._last = self._clock()
            try:
                url, started = _ensure_embedded(
                    self._settings, self._engine_id, self.timeout, self._log_stream
                )
            except (EmbeddedError, OSError) as exc:
                self._failures += 1
                self.counts.failed += 1
                log.warning(
                    "restarting the embedded kvtier service failed (%d in a row; next try in %.1fs): %s",
                    self._failures,
                    self.next_wait(),
                    exc,
                )
                return
            self._failures = 0
            if started:
                self.counts.started += 1
                log.info(
                    "restarted the embedded kvtier service",
                    extra={"url": url, "respawns": self.counts.started},
                )


def connect(
    settings: KVTierSettings,
    engine_id: str,
    *,
    log_stream: LogStream = "stderr",
    respawns: RespawnCounts | None = None,
    **client_kwargs: Any,
) -> ServiceClient:
    """A ServiceClient for the engine's service (configured or embedded; embedded ones respawn,
    counted in respawns, and log to log_stream, the stream of the engine's own log)."""
    url = ensure_service(settings, engine_id, log_stream=log_stream)
    hook = None if settings.service_url else Respawner(settings, engine_id, log_stream, respawns)
    return ServiceClient(url, settings.auth_token, on_unavailable=hook, **client_kwargs)
