"""One connection of a ServiceClient: a non-blocking socket written from any thread.

Who owns what: the client's lock guards every method except ``arm`` (which only registers the
writer callback on the loop thread); the client's loop thread reads the socket and flushes what a
write left behind.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from app import protocol as p

RECV_BYTES = 1 << 18


class Channel:
    """One connected non-blocking socket: written by any thread under the client's lock, read by
    the loop thread."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, on_writable: Callable[[], None]
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.on_writable = on_writable
        self.fd = sock.fileno()
        self.decoder = p.reply_decoder()
        # recv_into one preallocated buffer: a fresh 256 KiB bytes per recv() costs an mmap.
        self.inbuf = bytearray(RECV_BYTES)
        self.inview = memoryview(self.inbuf)
        self.pending_out = bytearray()  # bytes the socket did not take yet
        self.writer_armed = False
        self.closed = False

    def write(self, frame: bytes, on_loop: bool) -> bool:
        """Send or buffer frame (caller holds the lock); False when the connection is broken."""
        if self.closed:
            return False
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
            self.pending_out += frame[sent:]
            if not self.writer_armed:
                self.writer_armed = True
                if on_loop:
                    self.arm()
                else:
                    self.loop.call_soon_threadsafe(self.arm)
        return True

    def arm(self) -> None:
        """Start watching for writability (loop thread)."""
        if not self.closed:
            self.loop.add_writer(self.fd, self.on_writable)

    def close(self) -> None:
        """Stop watching the socket and close it (loop thread, under the lock)."""
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self.writer_armed:
            self.loop.remove_writer(self.fd)
        self.sock.close()

    def receive(self) -> list:
        """Read what arrived and decode the complete replies (loop thread).

        Raises BlockingIOError when nothing is there, OSError or EOFError when the connection is
        gone, ProtocolError for a bad frame.
        """
        n = self.sock.recv_into(self.inbuf)
        if not n:
            raise EOFError("connection closed by the service")
        return self.decoder.feed(self.inview[:n])
