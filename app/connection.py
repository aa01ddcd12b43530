"""One client connection of the kvtier service: frames in, replies out, and what it owns.

Who owns what: the service's event loop owns every Connection. A connection owns its transport,
its frame decoder, the replies held while one read's calls are served, the Tasks of its calls in
flight, the offsets of the reserved slots it owns and the last Report its connector sent. What a
call does, and what a dropped connection gives back, is the service's (``kvtier.app.service``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, cast

from kvtier.app import protocol as p
from kvtier.app.metrics import ServiceMetrics

log = logging.getLogger("kvtier.service")

CLOSE_GRACE_S = 2.0  # a closed connection's unread replies may take this long before it is cut


class Host(Protocol):
    """What a connection needs of the service that accepted it."""

    max_frame: int
    metrics: ServiceMetrics

    def attach(self, conn: Connection) -> None:
        """A new connection."""

    def detach(self, conn: Connection) -> None:
        """The connection dropped."""

    def dispatch(self, conn: Connection, msg: p.Request) -> None:
        """Serve one call."""


class Connection(asyncio.Protocol):
    """One client connection: frames in, replies out, and the reserved slots it owns."""

    def __init__(self, service: Host) -> None:
        self.service = service
        self.transport: asyncio.Transport | None = None
        self.decoder = p.request_decoder(service.max_frame)
        self.peer = "?"
        self.authed = False
        self.closed = False
        self.slots: set[int] = set()  # offsets of the reserved slots it owns
        self.inflight: set[asyncio.Task[None]] = set()
        self.held: list[bytes] | None = None  # replies held while one read's calls are served
        self.report: p.Report | None = None  # the connector's state, as it last reported it

    # --------------------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Register with the service."""
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer) if peer else "unix"
        self.service.attach(self)

    def data_received(self, data: bytes) -> None:
        """Decode every complete frame and dispatch it."""
        try:
            messages = self.decoder.feed(data)
        except p.ProtocolError as exc:
            kind = "oversized" if isinstance(exc, p.FrameTooLarge) else "malformed"
            self.abort_protocol(kind, str(exc))
            return
        if len(messages) > 1:
            # Several calls in one read (a burst of lookups as requests arrive): their immediate
            # replies go out in one write, which wakes the client once instead of once per reply.
            self.held = []
        try:
            for msg in messages:
                if self.closed or (self.transport is not None and self.transport.is_closing()):
                    return  # refused or shut: the rest of the batch is not served
                self.service.dispatch(self, msg)
        finally:
            if self.held is not None:
                self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        """Hand what the connection owns back once its in-flight calls are done."""
        self.closed = True
        self.service.detach(self)

    def pause_writing(self) -> None:
        """The client is not reading its replies: stop reading its requests."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """The client caught up."""
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # --------------------------------------------------------------------------- helpers
    def send(self, frame: bytes) -> None:
        """Write one encoded frame unless the connection is gone (held for flush() while a read's
        calls are served)."""
        if self.held is not None:
            self.held.append(frame)
        elif not self.closed and self.transport is not None:
            self.transport.write(frame)

    def flush(self) -> None:
        """Write the replies send() held, in one write, and stop holding them."""
        held, self.held = self.held, None
        if held and not self.closed and self.transport is not None:
            self.transport.write(b"".join(held))

    def abort_protocol(self, kind: str, reason: str) -> None:
        """Close this connection for a protocol violation, logging why; other clients go on."""
        log.warning("closing connection: %s", reason, extra={"peer": self.peer, "kind": kind})
        self.service.metrics.count_protocol_error(kind)
        self.close()

    def close(self) -> None:
        """Close after flushing what was written; abort if the peer does not read it in time."""
        self.flush()  # a refusal's reply goes out before the connection closes
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._force_close)

    def _force_close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.abort()
