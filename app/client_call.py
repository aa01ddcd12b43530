"""One call of a ServiceClient: the future its caller holds, which reads its own reply.

A thread that blocks on a call (``result()`` or ``exception()``, with no timeout or a positive one)
reads the socket itself through the call's reader, so the reply wakes it directly instead of waking
the client's loop thread, which would then wake it: one thread hand-off less per call. A poll
(``done()``, ``result(0)``) reads nothing itself (see kvtier.app.client_loop's await_reply).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol


class Reader(Protocol):
    """What reads replies for a thread waiting on a Call (the ServiceClient)."""

    def await_reply(self, call: Call, timeout: float | None) -> float | None:
        """Read replies in this thread until call is done; returns what is left of timeout."""


class Call(Future[Any]):
    """A call's future (a full concurrent.futures.Future), with what the client needs to send it,
    match its reply and time it out. Waiting on it reads replies in the waiting thread."""

    # True once set_result or set_exception has returned: the hot path reads this attribute instead
    # of taking the future's lock (done() does) several times per call. A cancelled call stays False.
    answered = False

    def __init__(
        self,
        reader: Reader | None,
        call_id: int,
        frame: bytes,
        expect: tuple[type, Callable[[Any], Any]],
        deadline: float = math.inf,
    ) -> None:
        super().__init__()
        self.reader = reader  # None: never reads (the handshake's calls, awaited on the loop thread)
        self.id = call_id
        self.frame = frame
        self.expect = expect  # the reply type that answers it, and what turns that into the result
        self.deadline = deadline  # the sweep fails the call then: no reason to read beyond it

    def set_result(self, result: Any) -> None:
        """Complete the call (InvalidStateError when it is done already)."""
        super().set_result(result)
        self.answered = True

    def set_exception(self, exception: BaseException | None) -> None:
        """Fail the call (InvalidStateError when it is done already)."""
        super().set_exception(exception)
        self.answered = True

    def result(self, timeout: float | None = None) -> Any:
        """The call's result, reading replies in this thread while it waits."""
        if not self.answered and self.reader is not None:
            timeout = self.reader.await_reply(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, reading replies in this thread while it waits."""
        if not self.answered and self.reader is not None:
            timeout = self.reader.await_reply(self, timeout)
        return super().exception(timeout)

    def done(self) -> bool:
        """True once answered or cancelled (a poll: it has the loop thread read replies, reads none
        itself)."""
        if not self.finished() and self.reader is not None:
            self.reader.await_reply(self, 0.0)
        return self.finished()

    def finished(self) -> bool:
        """done() without reading."""
        return self.answered or super().done()


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
