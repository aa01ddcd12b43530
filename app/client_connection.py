"""One connection of a ServiceClient: a non-blocking socket written from any thread, read by one
thread at a time.

Who owns what: the client's lock guards ``write`` and ``close``; the loop thread flushes and watches
the socket; replies are read by whoever holds ``reading`` (the loop thread or a blocked caller).
Design: docs/internals.md#service-client-clientpy-client_looppy-client_connectionpy-client_callpy
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
from collections.abc import Callable

from kvtier.app import protocol as p

RECV_BYTES = 1 << 18


class ClientConnection:
    """One connected non-blocking socket: written by any thread under the client's lock, read by
    the thread holding ``reading``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        on_writable: Callable[[], None],
        on_readable: Callable[[ClientConnection], None],
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.on_writable = on_writable
        self.on_readable = on_readable
        self.fd = sock.fileno()
        self.loop_thread = threading.get_ident()  # made on the loop thread (ClientLoop._open)
        self.decoder = p.reply_decoder()
        # recv_into one preallocated buffer: a fresh 256 KiB bytes per recv() costs an mmap.
        self.inbuf = bytearray(RECV_BYTES)
        self.inview = memoryview(self.inbuf)
        self.pending_out = bytearray()  # bytes the socket did not take yet
        self.held = bytearray()  # frames waiting for the next write (see hold)
        self.writer_armed = False
        self.closed = False
        self.reading = threading.Lock()  # held by the one thread reading replies
        self.watched = False  # the loop thread watches for replies (loop thread only)
        self.watch_asked = False  # watch() is scheduled on the loop thread already
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        # poll(ms) says when a reply may be read (holder of reading only; None: no timeout).
        self.poll = poller.poll

    def hold(self, frame: bytes) -> None:
        """Keep a frame that gets no reply, or a call that can wait, for the next write, so that
        both go out in one send and reach the service in one read (caller holds the lock; see
        flush_held)."""
        self.held += frame

    def flush_held(self) -> None:
        """Send what hold() kept, if no write took it along meanwhile (caller holds the lock)."""
        if self.held:
            self.write(b"")

    def write(self, frame: bytes | bytearray) -> bool:
        """Send or buffer frame (caller holds the lock); False when the connection is broken."""
        if self.held or self.pending_out or self.closed:  # one test for the three rare cases
            if self.closed:
                return False
            if self.held:  # frames kept by hold() go first, in the same send
                frame, self.held = self.held + frame, bytearray()
            if self.pending_out:
                self.pending_out += frame
                return True
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return False  # the reader sees the same failure and reconnects
        if sent < len(frame):
            self._keep(frame[sent:])
        return True

    def _keep(self, rest: bytes | bytearray) -> None:
        """Buffer what the socket did not take, for the loop thread to flush when it can."""
        self.pending_out += rest
        if not self.writer_armed:
            self.writer_armed = True
            if threading.get_ident() == self.loop_thread:
                self.arm()
            else:
                self.loop.call_soon_threadsafe(self.arm)

    def arm(self) -> None:
        """Start watching for writability (loop thread)."""
        if not self.closed:
            self.loop.add_writer(self.fd, self.on_writable)

    def watch(self) -> None:
        """Start (again) watching for replies (loop thread)."""
        self.watch_asked = False
        if not self.closed and not self.watched:
            self.watched = True
            self.loop.add_reader(self.fd, self.on_readable, self)

    def park(self) -> None:
        """Stop watching for replies while a caller reads them (loop thread)."""
        if self.watched:
            self.watched = False
            self.loop.remove_reader(self.fd)

    def close(self) -> None:
        """Stop watching the socket and close it (loop thread, under the lock)."""
        if self.closed:
            return
        self.closed = True
        self.park()
        if self.writer_armed:
            self.loop.remove_writer(self.fd)
        if self.reading.acquire(blocking=False):
            self.sock.close()
            self.reading.release()
        else:  # a caller is reading: wake it; it closes the socket when it lets go (see leave)
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def leave(self) -> None:
        """Let go of reading (its holder); closes the socket if close() came meanwhile."""
        self.reading.release()
        if self.closed:  # checked after the release: see close()
            self.sock.close()

    def receive(self) -> list:
        """Read what arrived and decode the complete replies (holder of reading).

        Raises BlockingIOError when nothing is there, OSError or EOFError when the connection is
        gone, ProtocolError for a bad frame.
        """
        if self.closed:
            raise EOFError("connection closed by the client")
        n = self.sock.recv_into(self.inbuf)
        if not n:
            raise EOFError("connection closed by the service")
        return self.decoder.feed(self.inview[:n])
