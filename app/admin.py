"""Admin HTTP: probes, ``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /stats`` (JSON).

A deliberately small HTTP/1.1 server on asyncio streams: one GET per connection, bounded request
size and read time, ``Connection: close``. It reads the service's state on the service's own loop,
so it needs no locks, and exposes no settings (no secrets can leak through it).

The two probes mean different things. ``/livez`` answers 200 whenever the process and its event loop
answer at all (a blocked loop answers nothing, and the probe times out); it stays 200 while the
service drains, so a graceful stop is never cut short. ``/readyz`` answers 200 only while the
service can serve: its listener accepts connections, no shutdown has begun and the store is
open (the server runs only while the store is: ``run_service`` closes it before the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.app.metrics import build_registry
from kvtier.app.service import Service

log = logging.getLogger("kvtier.admin")

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    503: "Service Unavailable",
}


PATHS = ("/livez", "/readyz", "/health", "/metrics", "/stats")


class AdminServer:
    """Serves /livez, /readyz, /health, /metrics and /stats of one service on host:port (0 = any).

    ``accepting`` says whether the service's listener accepts connections now; leave it out only when
    the admin server starts after the listener does (as ``run_service`` starts it).
    """

    def __init__(
        self,
        service: Service,
        host: str,
        port: int,
        *,
        accepting: Callable[[], bool] | None = None,
    ) -> None:
        self._service = service
        self._host = host
        self._port = port
        self._accepting = accepting
        self._accepted = False  # the listener accepted once: later refusals mean stopping, not starting
        self._server: asyncio.Server | None = None
        self._registry = build_registry(service.store.stats, service.metrics)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was asked)."""
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind and start serving."""
        self._server = await asyncio.start_server(
            self._handle, self._host, self._port, limit=MAX_REQUEST_BYTES
        )

    def readiness(self) -> tuple[bool, str]:
        """(ready to serve, why): the reason is "ready", "starting", "stopping", "draining" or
        "store unavailable"."""
        if self._service.draining:
            return False, "draining"
        if self._accepting is not None:
            if not self._accepting():
                return False, "stopping" if self._accepted else "starting"
            self._accepted = True
        serving, _tiers = self._service.health()
        if not serving:
            return False, "store unavailable"
        return True, "ready"

    async def close(self) -> None:
        """Stop serving and end open requests."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            status, ctype, body = await self._respond(reader)
            head = (
                f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            if task is not None:
                self._tasks.discard(task)

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except (asyncio.LimitOverrunError, ValueError):
            return _json(400, {"error": "request too large"})
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _json(400, {"error": "bad request line"})
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method != "GET":
            return _json(405, {"error": "only GET"})
        if target == "/livez":
            return _json(200, {"status": "alive", "instance_id": self._service.instance_id})
        if target == "/readyz":
            ready, reason = self.readiness()
            body = {"ready": ready, "reason": reason, "instance_id": self._service.instance_id}
            return _json(200 if ready else 503, body)
        if target == "/health":
            serving, tiers = self._service.health()
            body = {
                "status": "ok" if serving else "unavailable",
                "serving": serving,
                "instance_id": self._service.instance_id,
                "draining": self._service.draining,
                "tiers": {name: "up" if up else "down" for name, up in tiers.items()},
            }
            return _json(200 if serving else 503, body)
        if target == "/metrics":
            try:
                return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
            except Exception:
                log.exception("collecting metrics failed")
                return _json(503, {"error": "metrics unavailable"})
        if target == "/stats":
            return _json(200, self._service.stats())
        return _json(404, {"error": f"no such path {target}", "paths": list(PATHS)})


def _json(status: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(body, sort_keys=True).encode()
