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

from kvtier.app import protocol as p

RECV_BYTES = 1 << 18
PENDING = futures_base.PENDING
FINISHED = futures_base.FINISHED
DONE = frozenset({futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED, FINISHED})
_CONDITIONS = threading.Lock()  # makes each Call's condition once (see Call)


class Reader(Protocol):
    """What reads replies for a thread waiting on a Call (the ServiceClient)."""

    def await_reply(self, call: Call, timeout: float | None) -> float | None:
        """Read replies in this thread until call is done; returns what is left of timeout."""


class Call(Future[Any]):
    """One call and its future; a thread that waits on it reads the replies itself (through its
    reader) instead of waiting for the loop thread to complete it.

    Future.__init__ is not run: its ``threading.Condition`` costs more than the rest of a call's
    client-side bookkeeping, and a caller that reads its own reply never needs it. The condition
    and Future's lists of waiters and callbacks are made on first use instead (see
    ``_condition``); until then nobody can be waiting on the call or have added a callback, so
    ``set_result`` and ``set_exception`` just record the outcome. (Properties, not __getattr__: a
    class with __getattr__ makes every attribute read of its instances about 3x slower.)
    """

    # Future's fields start as class attributes: an instance stores them once they change.
    _state = PENDING
    _result: Any = None
    _exception: BaseException | None = None
    _cond: threading.Condition | None = None  # see _condition
    _waiter_list: list[Any]
    _callback_list: list[Callable[[Future[Any]], object]]

    def __init__(
        self,
        reader: Reader | None,
        call_id: int,
        frame: bytes,
        expect: tuple[type, Callable[[Any], Any]],
        deadline: float = math.inf,
    ) -> None:
        self.reader = reader  # None: never reads (the handshake's calls, awaited on the loop thread)
        self.id = call_id
        self.frame = frame
        self.expect = expect  # the reply type that answers it, and what turns that into the result
        self.deadline = deadline  # the sweep fails the call then: no reason to read beyond it

    # Read-only properties over Future's attributes: Future's own code only ever reads them.
    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        """Future's condition, made with its lists the first time anyone asks for it."""
        if self._cond is None:
            with _CONDITIONS:  # every thread that asks must get the same one
                if self._cond is None:
                    self._waiter_list = []
                    self._callback_list = []
                    self._cond = threading.Condition()  # last: who sees it sees the lists
        return self._cond

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]
        """Future's list of waiters (concurrent.futures.wait), made with the condition."""
        _ = self._condition
        return self._waiter_list

    @property
    def _done_callbacks(self) -> list[Callable[[Future[Any]], object]]:
        """Future's list of callbacks, made with the condition."""
        _ = self._condition
        return self._callback_list

    def set_result(self, result: Any) -> None:
        """Complete the call (InvalidStateError when it is done already)."""
        with _CONDITIONS:
            if self._cond is None:  # nobody waits on it, nor can start to meanwhile
                # Without the condition it was never cancelled (cancel() takes it): PENDING or FINISHED.
                if self._state is FINISHED:
                    raise InvalidStateError(f"{self._state}: {self!r}")
                self._result = result
                self._state = FINISHED  # last: a lock-free reader that sees it sees the result too
                return
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        """Fail the call (InvalidStateError when it is done already)."""
        with _CONDITIONS:
            if self._cond is None:
                if self._state is FINISHED:
                    raise InvalidStateError(f"{self._state}: {self!r}")
                self._exception = exception
                self._state = FINISHED
                return
        super().set_exception(exception)

    def result(self, timeout: float | None = None) -> Any:
        """The call's result, reading replies in this thread while it waits."""
        if self._state is PENDING and self.reader is not None:
            timeout = self.reader.await_reply(self, timeout)
        if self._state is FINISHED and self._exception is None:
            return self._result  # read here: no condition needed once it is finished
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
        return self._state in DONE


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
        self.loop_thread = threading.get_ident()  # made on the loop thread (ServiceClient._open)
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
