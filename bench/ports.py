"""Free loopback TCP ports for the servers the benchmarks and tests start (Redis, SeaweedFS, the
OpenAI server, kvtier's admin and events sockets)."""

from __future__ import annotations

import socket
import threading

# Ports handed out by this process: the kernel may hand a just-released port out again, and two
# servers started together must not both be given it.
_GIVEN: set[int] = set()
_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback TCP port that is free now and that this process has not handed out before."""
    return distinct_free_ports(1)[0]


def distinct_free_ports(count: int) -> list[int]:
    """count loopback TCP ports free now, all different and none handed out before by this process
    (each socket is held until all are chosen, so the kernel cannot give one port twice)."""
    socks: list[socket.socket] = []
    chosen: list[int] = []
    try:
        with _LOCK:
            for _ in range(count + 1000):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
                if port not in _GIVEN:
                    chosen.append(port)
                if len(chosen) == count:
                    _GIVEN.update(chosen)
                    return chosen
    finally:
        for sock in socks:
            sock.close()
    raise RuntimeError(f"no {count} unused loopback ports found")
