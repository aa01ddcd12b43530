"""A loopback TCP proxy for fault tests: adds latency to every response, can pause or kill traffic.

``LatencyProxy(target_port, delay=0.2)`` listens on 127.0.0.1 and forwards each connection to the
target. Requests go upstream at once; bytes coming back are held until ``delay`` seconds after they
arrived, in order, so every response is late by ``delay`` while throughput stays what the target
gives (pipelined replies are not serialised behind each other's delay). ``pause()`` holds all bytes
in both directions until ``resume()`` (a hung backend); ``kill()`` resets every open connection and
stops accepting (a dead backend). Threads only; nothing here needs a third-party package.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a crashed peer would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _close(sock)


def _close(sock: socket.socket) -> None:
    """Shut down (which wakes a thread blocked in recv on it) and close."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class LatencyProxy:
    """Forwards 127.0.0.1:port to target with `delay` seconds added to every response."""

    def __init__(self, target_port: int, delay: float = 0.2, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay = delay
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        # Counters (read them from the test thread; each is only ever increased).
        self.connections = 0
        self.requests_forwarded = 0  # chunks of bytes sent upstream
        self.responses_delayed = 0  # chunks of bytes held for `delay` and then sent back
        self._accept = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        self._accept.start()

    @property
    def url(self) -> str:
        """redis:// URL of the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    # ----------------------------------------------------------------------------------- control
    def pause(self) -> None:
        """Hold every byte in both directions (connections stay open) until resume()."""
        self._running.clear()

    def resume(self) -> None:
        """Let held bytes flow again."""
        self._running.set()

    def kill(self) -> None:
        """Reset every connection and stop accepting new ones (the backend is gone)."""
        self._closed.set()
        self._running.set()
        _reset(self._listener)
        with self._lock:
            socks, self._socks = set(self._socks), set()
        for sock in socks:
            _reset(sock)

    close = kill

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    # ----------------------------------------------------------------------------------- plumbing
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed.is_set():
                    _reset(client)
                    _reset(upstream)
                    return
                self._socks.update((client, upstream))
                self.connections += 1
            held: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
            for target, name, args in (
                (self._upstream_pump, "up", (client, upstream)),
                (self._downstream_reader, "down-read", (upstream, held)),
                (self._downstream_writer, "down-write", (held, client, upstream)),
            ):
                threading.Thread(target=target, args=args, name=f"proxy-{name}", daemon=True).start()

    def _gate(self) -> bool:
        """Wait while paused; False once the proxy is killed."""
        while not self._running.wait(0.05):
            if self._closed.is_set():
                return False
        return not self._closed.is_set()

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            for sock in socks:
                self._socks.discard(sock)
        for sock in socks:
            _close(sock)

    def _upstream_pump(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while True:
                data = client.recv(65536)
                if not data or not self._gate():
                    break
                upstream.sendall(data)
                self.requests_forwarded += 1
        except OSError:
            pass
        self._drop(client, upstream)

    def _downstream_reader(
        self, upstream: socket.socket, held: queue.Queue[tuple[float, bytes] | None]
    ) -> None:
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                held.put((time.monotonic() + self.delay, data))
        except OSError:
            pass
        held.put(None)

    def _downstream_writer(
        self,
        held: queue.Queue[tuple[float, bytes] | None],
        client: socket.socket,
        upstream: socket.socket,
    ) -> None:
        try:
            while True:
                item = held.get()
                if item is None:
                    break
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not self._gate():
                    break
                client.sendall(data)
                self.responses_delayed += 1
        except OSError:
            pass
        self._drop(client, upstream)
