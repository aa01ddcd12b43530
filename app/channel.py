"""One connection of a ServiceClient: a non-blocking socket written from any thread, read by one
thread at a time; and the futures of its calls.

Who owns what: the client's lock guards ``write`` and ``close``; the client's loop thread flushes
what a write left behind and watches the socket for replies (``watch``/``park``). Replies are read by
whoever holds ``reading``: the loop thread, or a caller blocked on a reply of its own, which then
reads the socket itself instead of waiting for the loop thread to wake it (one thread hand-off less
per call). While a caller reads, the loop thread stops watching the socket (``park``), so a reply
wakes one thread, not two. ``close`` never closes the socket under a reader's feet: it shuts it down,
which wakes the reader, and the reader closes it when it lets go of ``reading``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import _base as futures_base
from typing import Any, Protocol

from app import protocol as p

RECV_BYTES = 1 << 18
FINISHED = futures_base.FINISHED
DONE = frozenset({futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED, FINISHED})


class Reader(Protocol):
    """What reads replies for a thread waiting on a Call (the ServiceClient)."""

    def await_reply(self, call: Call, timeout: float | None) -> float | None:
        """Read replies in this thread until call is done; returns what is left of timeout."""


class Call(Future[Any]):
    """One call and its future; a thread that waits on it reads the replies itself (through its
    reader) instead of waiting for the loop thread to complete it."""

    def __init__(
        self,
        reader: Reader | None,
        call_id: int,
        frame: bytes,
        reply_type: type,
        convert: Callable[[Any], Any],
        deadline: float = math.inf,
    ) -> None:
        super().__init__()
        self.reader = reader  # None: never reads (the handshake's calls, awaited on the loop thread)
        self.id = call_id
        self.frame = frame
        self.reply_type = reply_type
        self.convert = convert
        self.deadline = deadline  # the sweep fails the call then: no reason to read beyond it

    def result(self, timeout: float | None = None) -> Any:
        """The call's result, reading replies in this thread while it waits."""
        if self.reader is not None and self._state not in DONE:  # type: ignore[attr-defined]
            timeout = self.reader.await_reply(self, timeout)
            if self._state is FINISHED and self._exception is None:  # type: ignore[attr-defined]
                return self._result  # type: ignore[attr-defined]  # read it here: no lock needed
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, reading replies in this thread while it waits."""
        if self.reader is not None and not self.finished():
            timeout = self.reader.await_reply(self, timeout)
        return super().exception(timeout)

    def done(self) -> bool:
        """True once answered (a poll: it has the loop thread read replies, reads none itself)."""
        if self.reader is not None and not self.finished():
            self.reader.await_reply(self, 0.0)
        return self.finished()

    def finished(self) -> bool:
        """done() without reading."""
        # The lock-free read of the state that concurrent.futures.wait() does too: done() takes
        # the future's lock, and the wait loop asks after every reply it reads.
        return self._state in DONE  # type: ignore[attr-defined]


def fail(future: Future[Any], exc: BaseException) -> None:
    """Fail future unless it is done already (timed out meanwhile)."""
    try:
        future.set_exception(exc)
    except InvalidStateError:
        pass


def fail_calls(calls: list[Call], exc: BaseException) -> None:
    """Fail every call."""
    for call in calls:
        fail(call, exc)


def resolve(future: Future[Any], value: object) -> None:
    """Complete future unless it is done already."""
    try:  # not contextlib.suppress: building one per reply costs more than the rest of this
        future.set_result(value)
    except InvalidStateError:
        pass


def failed(exc: BaseException) -> Future[Any]:
    """A future failed with exc already."""
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


class Channel:
    """One connected non-blocking socket: written by any thread under the client's lock, read by
    the thread holding ``reading``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        on_writable: Callable[[], None],
        on_readable: Callable[[Channel], None],
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.on_writable = on_writable
        self.on_readable = on_readable
        self.fd = sock.fileno()
        self.decoder = p.reply_decoder()
        # recv_into one preallocated buffer: a fresh 256 KiB bytes per recv() costs an mmap.
        self.inbuf = bytearray(RECV_BYTES)
        self.inview = memoryview(self.inbuf)
        self.pending_out = bytearray()  # bytes the socket did not take yet
        self.writer_armed = False
        self.closed = False
        self.reading = threading.Lock()  # held by the one thread reading replies
        self.watched = False  # the loop thread watches for replies (loop thread only)
        self.watch_asked = False  # watch() is scheduled on the loop thread already
        self._poller = select.poll()  # used by the holder of reading only
        self._poller.register(self.fd, select.POLLIN)

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

    def wait_readable(self, timeout: float | None) -> bool:
        """Block (GIL released) until a reply may be read or timeout seconds passed (holder only)."""
        if timeout is None or timeout == math.inf:  # a call made with timeout=math.inf
            return bool(self._poller.poll(None))
        return bool(self._poller.poll(timeout * 1000.0))

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
