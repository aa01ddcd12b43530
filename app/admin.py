"""Admin HTTP: probes, ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /stats`` (JSON) and
``POST /lookup`` (for routers: how many leading blocks of a prompt each tier holds).

Who owns what: no state of its own; it reads the service's state on the service's loop (so no locks)
and exposes no settings.
Design: docs/internals.md#admin-http-adminpy
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
MAX_LOOKUP_BYTES = 1 << 20  # a /lookup body: about 15,000 block hashes of sha256 in hex
READ_TIMEOUT_S = 5.0
REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    411: "Length Required",
    413: "Content Too Large",
    503: "Service Unavailable",
}


PATHS = ("/livez", "/readyz", "/health", "/metrics", "/stats")  # GET; and POST /lookup


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
        if target == "/lookup":
            return await self._lookup(method, reader, head)
        if method != "GET":
            return _json(405, {"error": "only GET (and POST /lookup)"})
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
        return _json(404, {"error": f"no such path {target}", "paths": list(PATHS), "post": ["/lookup"]})

    async def _lookup(self, method: str, reader: asyncio.StreamReader, head: bytes) -> tuple[int, str, bytes]:
        """POST /lookup (see lookup())."""
        if method != "POST":
            return _json(405, {"error": "/lookup takes POST with a JSON body"})
        request, problem = await _read_body(reader, head)
        if problem is not None:
            return problem
        return await lookup(self._service, request)


def _json(status: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(body, sort_keys=True).encode()


async def _read_body(
    reader: asyncio.StreamReader, head: bytes
) -> tuple[bytes, tuple[int, str, bytes] | None]:
    """The request's body by its Content-Length, or the 4xx answer that refuses it."""
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                return b"", _json(400, {"error": f"bad Content-Length {value.strip().decode('latin-1')!r}"})
        elif name.strip().lower() == b"transfer-encoding":
            return b"", _json(411, {"error": "send the body with a Content-Length, not chunked"})
    if length is None:
        return b"", _json(411, {"error": "POST /lookup needs a Content-Length"})
    if not 0 <= length <= MAX_LOOKUP_BYTES:
        return b"", _json(413, {"error": f"a body of {length} bytes: at most {MAX_LOOKUP_BYTES} allowed"})
    return await asyncio.wait_for(reader.readexactly(length), READ_TIMEOUT_S), None


async def lookup(service: Service, body: bytes) -> tuple[int, str, bytes]:
    """POST /lookup: ``{"namespace": hex, "block_hashes": [hex, ...]}`` (vLLM's block hashes of a
    prompt, in order; ``blocks_per_chunk`` too when the namespace is not registered with this
    service) answered with the leading blocks each tier holds and held in some tier, counted at
    chunk granularity. Takes no lease and changes no recency."""
    try:
        request = json.loads(body)
    except ValueError as exc:
        return _json(400, {"error": f"the body is not JSON: {exc}"})
    parsed = _lookup_request(request, service)
    if isinstance(parsed, str):
        return _json(400 if not parsed.startswith("unknown namespace") else 404, {"error": parsed})
    namespace, hashes, per_chunk = parsed
    chunk_hashes = hashes[per_chunk - 1 :: per_chunk]
    try:
        held = await service.store.held(namespace, chunk_hashes)
    except Exception as exc:  # a closed store: the service is stopping
        return _json(503, {"error": f"the store cannot answer: {exc}"})
    tiers = {tier.label: _leading(found) * per_chunk for tier, found in held.items()}
    anywhere = [any(column) for column in zip(*held.values(), strict=True)] if held else []
    answer = {
        "namespace": namespace,
        "blocks_per_chunk": per_chunk,
        "blocks": len(hashes),
        "tiers": tiers,
        "held": _leading(anywhere) * per_chunk,
    }
    return _json(200, answer)


def _leading(found: list[bool]) -> int:
    return found.index(False) if False in found else len(found)


# vLLM's block hashes are 16 (xxhash) or 32 (sha256) bytes; its event ints are 8.
MIN_HASH_BYTES = 16


def _lookup_request(request: Any, service: Service) -> tuple[str, list[bytes], int] | str:
    """(namespace, block hashes, blocks per chunk) of a /lookup body, or what is wrong with it."""
    if not isinstance(request, dict):
        return "the body must be a JSON object with namespace and block_hashes"
    unknown = set(request) - {"namespace", "block_hashes", "blocks_per_chunk"}
    if unknown:
        return f"unknown field(s) {sorted(unknown)}: allowed are namespace, block_hashes, blocks_per_chunk"
    namespace, raw = request.get("namespace"), request.get("block_hashes")
    if not isinstance(namespace, str) or not namespace:
        return "namespace must be a non-empty string (a namespace id from GET /stats namespace_specs)"
    if not isinstance(raw, list) or not all(isinstance(h, str) for h in raw):
        return "block_hashes must be a list of hex strings (vLLM's block hashes, in order)"
    try:
        hashes = [bytes.fromhex(h) for h in raw]
    except ValueError:
        return "block_hashes must be a list of hex strings (vLLM's block hashes, in order)"
    if any(len(h) < MIN_HASH_BYTES or len(h) != len(hashes[0]) for h in hashes):
        return (
            f"block_hashes must be vLLM's whole block hashes, all of one length and at least "
            f"{MIN_HASH_BYTES} bytes (events_hash_format=bytes gives them), not the 8-byte ints"
        )
    spec = service.specs.get(namespace)
    per_chunk = request.get("blocks_per_chunk")
    if per_chunk is None and spec is None:
        return (
            f"unknown namespace {namespace!r}: no engine registered it with this service "
            f"(registered: {sorted(service.specs)}); name blocks_per_chunk to ask anyway"
        )
    if per_chunk is None:
        per_chunk = spec.blocks_per_chunk if spec is not None else 0
    if not isinstance(per_chunk, int) or isinstance(per_chunk, bool) or per_chunk <= 0:
        return "blocks_per_chunk must be a positive integer"
    if spec is not None and per_chunk != spec.blocks_per_chunk:
        return f"blocks_per_chunk {per_chunk} is not the namespace's {spec.blocks_per_chunk}"
    return namespace, hashes, per_chunk
