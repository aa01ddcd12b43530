"""The Redis tier's floor: the same bytes moved once over a plain loopback TCP socket.

A server process (``python -m kvtier.bench.loopback``, started off the model's core as redis-server
is) answers a request of value sizes with that many bytes back to back; ``LoopbackFloor.move`` times
one request until the last byte is in a preallocated buffer (``recv_into``). For comparison,
``redis_benchmark_get`` runs ``redis-benchmark``'s GET of a value size against a redis-server.
"""

from __future__ import annotations

import argparse
import csv
import io
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np

HOST = "127.0.0.1"
IDLE_TIMEOUT_S = 600.0  # the server waits this long for the next request (engine samples run between)


def pattern(nbytes: int) -> np.ndarray:
    """The bytes the server sends: byte i is i % 251, so a misplaced byte shows."""
    return (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)


def _recv_exact(conn: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        part = conn.recv(nbytes - len(data))
        if not part:
            raise ConnectionError(f"the peer closed the connection after {len(data)} of {nbytes} bytes")
        data += part
    return bytes(data)


def serve(listener: socket.socket, max_bytes: int) -> None:
    """Answer one connection's requests (a u32 count, then count u64 sizes) until a count of 0."""
    payload = pattern(max_bytes).data
    listener.settimeout(IDLE_TIMEOUT_S)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(IDLE_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while count := struct.unpack("<I", _recv_exact(conn, 4))[0]:
            sizes = struct.unpack(f"<{count}Q", _recv_exact(conn, 8 * count))
            for size in sizes:
                if size > max_bytes:
                    raise ValueError(f"asked for {size} bytes; this server sends at most {max_bytes}")
                conn.sendall(payload[:size])


class LoopbackFloor:
    """A loopback server process and one connection to it; ``move(sizes)`` times one request.
    Use it as a context manager: the server is stopped and reaped on every path."""

    def __init__(
        self, max_bytes: int, preexec_fn: Callable[[], None] | None = None, timeout: float = 30.0
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._buffer = np.full(max_bytes, 1, dtype=np.uint8)  # touched, as an arena slot is
        self._view = self._buffer.data
        self._got = 0
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.bench.loopback", "--max-bytes", str(max_bytes)],
            stdout=subprocess.PIPE,
            preexec_fn=preexec_fn,
        )
        self._sock: socket.socket | None = None
        try:
            port = self._read_port(timeout)
            self._sock = socket.create_connection((HOST, port), timeout=timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.close()
            raise

    def _read_port(self, timeout: float) -> int:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            raise RuntimeError(f"the loopback server did not say its port within {timeout:.0f} s: {line!r}")
        return int(line)

    @property
    def received(self) -> memoryview:
        """The bytes the last move received."""
        return self._view[: self._got]

    def move(self, sizes: Sequence[int]) -> float:
        """Seconds from sending one request for these values until their last byte is received."""
        total = sum(sizes)
        if not sizes or total > self.max_bytes or min(sizes) < 0:
            raise ValueError(
                f"sizes must be 1 or more counts >= 0 summing to at most {self.max_bytes}: {sizes}"
            )
        if self._sock is None:
            raise RuntimeError("the loopback floor is closed")
        request = struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)
        start = time.perf_counter()
        self._sock.sendall(request)
        got = 0
        while got < total:
            n = self._sock.recv_into(self._view[got:total])
            if n == 0:
                raise ConnectionError(f"the loopback server closed after {got} of {total} bytes")
            got += n
        took = time.perf_counter() - start
        self._got = got
        return took

    def close(self) -> None:
        """Stop the server: a count of 0 ends it; one that does not end is killed."""
        if self._sock is not None:
            try:
                self._sock.sendall(struct.pack("<I", 0))
            except OSError:
                pass  # the server is gone already; it is reaped below
            self._sock.close()
            self._sock = None
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> LoopbackFloor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def parse_redis_benchmark_csv(text: str) -> dict[str, dict[str, float]]:
    """redis-benchmark's --csv output as {test: {column: value}} (e.g. "GET": {"rps": ...})."""
    rows = csv.DictReader(io.StringIO(text))
    parsed = {row["test"]: {k: float(v) for k, v in row.items() if k != "test" and v} for row in rows}
    if not parsed:
        raise ValueError(f"no rows in redis-benchmark's output: {text!r}")
    return parsed


def redis_benchmark_get(
    port: int, value_bytes: int, requests: int = 200, preexec_fn: Callable[[], None] | None = None
) -> dict[str, Any] | None:
    """redis-benchmark's GET of value_bytes on one connection (its SET writes the value first)
    against the redis-server on port; None where redis-benchmark is not installed."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    args = ["-h", HOST, "-p", str(port), "-t", "set,get", "-d", str(value_bytes)]
    done = subprocess.run(
        [binary, *args, "-n", str(requests), "-c", "1", "--csv"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        preexec_fn=preexec_fn,
    )
    get = parse_redis_benchmark_csv(done.stdout)["GET"]
    return {
        "command": f"redis-benchmark {' '.join(args)} -n {requests} -c 1",
        "value_bytes": value_bytes,
        "get_rps": get["rps"],
        "get_ms_per_value": round(1000 / get["rps"], 3),
        "get_p50_ms": get.get("p50_latency_ms"),
        "get_gbps": round(value_bytes * get["rps"] / 1e9, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """The server: print the port it listens on, then serve one connection."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.loopback", description=__doc__)
    parser.add_argument("--max-bytes", type=int, required=True, help="the largest value it sends")
    args = parser.parse_args(argv)
    with socket.create_server((HOST, 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        serve(listener, args.max_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
