"""One call of a ServiceClient: the future its caller holds, which reads its own reply.

A thread that blocks on a call reads the socket itself, so the reply wakes it directly; a poll reads
nothing. It is the part of ``concurrent.futures.Future`` callers use, with no per-call Condition.
Design: docs/internals.md#service-client-clientpy-client_looppy-client_connectionpy-client_callpy
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, InvalidStateError
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

_PENDING, _FINISHED, _CANCELLED = 0, 1, 2
# Guards every call's state changes and waiter lists: held for a few bytecodes, never while waiting.
_guard = threading.Lock()


class Reader(Protocol):
    """What reads replies for a thread waiting on a Call (the ServiceClient)."""

    def await_reply(self, call: Call[Any], timeout: float | None) -> float | None:
        """Read replies in this thread until call is done; returns what is left of timeout."""


class Call(Generic[T]):
    """A call's future, with what the client needs to send it, match its reply and time it out.
    Waiting on it reads replies in the waiting thread."""

    __slots__ = (
        "_callbacks",
        "_exception",
        "_result",
        "_state",
        "_waiters",
        "answered",
        "deadline",
        "expect",
        "frame",
        "id",
        "reader",
    )

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
        # True once answered (result or exception): the hot path reads this without the guard.
        self.answered = False
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[threading.Lock] | None = None
        self._callbacks: list[Callable[[Call[T]], object]] | None = None

    # ------------------------------------------------------------------------------- completing
    def set_result(self, result: T) -> None:
        """Complete the call (InvalidStateError when it is done already)."""
        self._finish(_FINISHED, result, None)

    def set_exception(self, exception: BaseException) -> None:
        """Fail the call (InvalidStateError when it is done already)."""
        self._finish(_FINISHED, None, exception)

    def cancel(self) -> bool:
        """Cancel the call unless it is answered; True if it is cancelled now."""
        try:
            self._finish(_CANCELLED, None, None)
        except InvalidStateError:
            return self._state == _CANCELLED
        return True

    def _finish(self, state: int, result: Any, exception: BaseException | None) -> None:
        with _guard:
            if self._state != _PENDING:
                raise InvalidStateError(f"call {self.id} is done already")
            self._result = result
            self._exception = exception
            self._state = state
            self.answered = state == _FINISHED
            waiters, self._waiters = self._waiters, None
            callbacks, self._callbacks = self._callbacks, None
        if waiters:
            for waiter in waiters:
                waiter.release()
        if callbacks:
            for callback in callbacks:
                self._run(callback)

    def _run(self, callback: Callable[[Call[T]], object]) -> None:
        try:
            callback(self)
        except Exception:  # as concurrent.futures does: one callback's error stops no other
            log.exception("a callback of call %d raised", self.id)

    # --------------------------------------------------------------------------------- reading
    def add_done_callback(self, fn: Callable[[Call[T]], object]) -> None:
        """Call fn(self) once the call is done (at once if it is)."""
        with _guard:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        self._run(fn)

    def result(self, timeout: float | None = None) -> T:
        """The call's result, reading replies in this thread while it waits."""
        self._await(timeout)
        if self._exception is not None:
            raise self._exception
        return self._result  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, reading replies in this thread while it waits."""
        self._await(timeout)
        return self._exception

    def _await(self, timeout: float | None) -> None:
        """Return once finished; TimeoutError if timeout passes first, CancelledError if cancelled."""
        if not self.answered:
            if self.reader is not None:
                timeout = self.reader.await_reply(self, timeout)
            if self._state == _PENDING:
                self._block(timeout)
            if self._state == _CANCELLED:
                raise CancelledError()
            if self._state == _PENDING:
                raise TimeoutError()

    def _block(self, timeout: float | None) -> None:
        """Wait for another thread to finish the call, at most timeout seconds."""
        if timeout is not None and timeout <= 0.0:
            return
        waiter = threading.Lock()
        waiter.acquire()
        with _guard:
            if self._state != _PENDING:
                return
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
        if not waiter.acquire(timeout=-1 if timeout is None else timeout):
            with _guard:
                if self._waiters is not None and waiter in self._waiters:
                    self._waiters.remove(waiter)

    def done(self) -> bool:
        """True once answered or cancelled (a poll: it has the loop thread read replies, reads none
        itself)."""
        if self._state == _PENDING and self.reader is not None:
            self.reader.await_reply(self, 0.0)
        return self._state != _PENDING

    def finished(self) -> bool:
        """done() without reading."""
        return self._state != _PENDING

    def cancelled(self) -> bool:
        """True if the call was cancelled."""
        return self._state == _CANCELLED

    def to_asyncio(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[T]:
        """An asyncio future of loop that completes with this call."""
        target: asyncio.Future[T] = loop.create_future()

        def copy(call: Call[T]) -> None:
            if target.done():
                return
            if call.cancelled():
                target.cancel()
            elif call._exception is not None:
                target.set_exception(call._exception)
            else:
                target.set_result(call._result)

        self.add_done_callback(lambda call: loop.call_soon_threadsafe(copy, call))
        return target


def fail(call: Call[Any], exc: BaseException) -> None:
    """Fail call unless it is done already (timed out meanwhile)."""
    try:
        call.set_exception(exc)
    except InvalidStateError:
        pass


def fail_calls(calls: list[Call[Any]], exc: BaseException) -> None:
    """Fail every call."""
    for call in calls:
        fail(call, exc)


def failed(exc: BaseException) -> Call[Any]:
    """A call failed with exc already (never sent)."""
    call: Call[Any] = Call(None, 0, b"", (type(None), lambda reply: reply))
    call.set_exception(exc)
    return call
