"""Helpers shared by the tests of app/: a service run in a thread, raw protocol connections."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.app import protocol as p
from kvtier.app.server import ServeOptions, run_service
from kvtier.app.service import Service
from kvtier.app.settings import KVTierSettings, load_settings
from kvtier.runtime.event_loop import new_event_loop
from kvtier.storage.base import NamespaceSpec

ROOT = Path(__file__).resolve().parents[2]
SPEC = NamespaceSpec("test-model", "bfloat16", "NHD", 16, 64, 2, 256)  # 2 KiB chunks


def settings_for(tmp: Path, **env: str) -> KVTierSettings:
    """Settings with a small arena in tmp, plus KVTIER_<KEY> overrides given as key=value."""
    base = {"KVTIER_SHM_DIR": str(tmp), "KVTIER_CPU_SIZE": "4MiB", "KVTIER_LOG_LEVEL": "WARNING"}
    base.update({f"KVTIER_{k.upper()}": v for k, v in env.items()})
    return load_settings(env=base)


def hashes(n: int, salt: str = "") -> list[bytes]:
    """n distinct 32-byte prefix hashes."""
    return [f"{salt}-{i}".encode().ljust(32, b".") for i in range(n)]


@dataclass
class ThreadService:
    """A service running on its own event loop in a thread of the test process."""

    url: str
    settings: KVTierSettings
    service: Service | None = None
    loop: asyncio.AbstractEventLoop | None = None
    error: BaseException | None = None
    _stop: asyncio.Event | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> ThreadService:
        """Start and wait until it listens."""
        self._thread = threading.Thread(target=self._run, name="test-service", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self.error is not None:
            raise RuntimeError(f"service did not start: {self.error!r}")
        return self

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(service: Service) -> None:
                self.service = service
                self._ready.set()

            await run_service(
                self.settings, ServeOptions(url=self.url, grace=1.0), stop=self._stop, ready=ready
            )

        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(main())
        except BaseException as exc:
            self.error = exc
            self._ready.set()

    def call(self, fn: Any, timeout: float = 5.0) -> Any:
        """Run fn() (sync, or returning an awaitable) on the service's loop and return its result."""
        assert self.loop is not None

        async def run() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop as SIGTERM would and wait for the shutdown to finish."""
        if self._thread is None:
            return
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        self._thread = None

    def wait_for(self, predicate: Any, timeout: float = 5.0) -> Any:
        """Poll predicate() on the service loop until truthy; returns the last value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.call(predicate)
            if value:
                return value
            time.sleep(0.02)
        return value


@contextlib.contextmanager
def thread_service(tmp: Path, url: str | None = None, **env: str) -> Iterator[ThreadService]:
    """A started ThreadService, stopped on exit."""
    svc = ThreadService(url or f"unix://{tmp}/svc.sock", settings_for(tmp, **env)).start()
    try:
        yield svc
    finally:
        svc.stop()


class RawConn:
    """A blocking protocol connection for tests that need to misbehave or look at single frames."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        if url.startswith("unix://"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = url.removeprefix("unix://")
        else:
            host, port = url.removeprefix("tcp://").rsplit(":", 1)
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = (host, int(port))
        self.sock.settimeout(timeout)
        self.sock.connect(target)
        self.enc = p.FrameEncoder()
        self.dec = p.reply_decoder()
        self.pending: list[Any] = []
        self.ids = iter(range(1, 1 << 30))

    def send(self, msg: Any) -> None:
        """Send one message."""
        self.sock.sendall(self.enc.encode(msg))

    def recv(self) -> Any:
        """The next reply; raises ConnectionError when the service closed the connection."""
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by the service")
            self.pending.extend(self.dec.feed(data))
        return self.pending.pop(0)

    def call(self, msg: Any) -> Any:
        """Send and wait for the reply."""
        self.send(msg)
        return self.recv()

    def hello(self, token: str = "", spec: NamespaceSpec | None = None) -> Any:
        """Handshake (and register spec)."""
        return self.call(p.Hello(id=next(self.ids), version=p.PROTOCOL_VERSION, token=token, spec=spec))

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True once the service has closed this connection (EOF or reset)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
                self.pending.extend(self.dec.feed(data))
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a child python process that imports this repository."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)
    env.update(extra)
    return env


def run_python(code: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
    """Run python -c code with this repository importable."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=python_env(**env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll predicate() until truthy or timeout; returns the last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def kvtier_cmd(*args: str) -> list[str]:
    """The kvtier CLI as a command line (the console script may not be installed)."""
    return [sys.executable, "-m", "kvtier.app.cli", *args]
