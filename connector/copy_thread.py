"""A second thread for CPU block copies, so a step's copies use two cores instead of one.

Who owns what: the ``BlockCopier`` that creates a ``CopyThread`` owns it and is its only caller; the
thread only runs the copies handed to it, and ``wait()`` is the fence.
Design: docs/internals.md#cpu-copies-copypy-copy_threadpy
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvtier.runtime.affinity import deprioritize, run_on
from kvtier.runtime.handoff import Lane


class CopyError(RuntimeError):
    """A copy run by the copy thread failed."""


class CopyThread:
    """One daemon thread running submitted copies in order; wait() fences them."""

    def __init__(
        self,
        cpus: frozenset[int] | None = None,
        name: str = "kvtier-copy",
        background: bool = False,
        on_start: Callable[[], object] | None = None,
    ) -> None:
        self._cond = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._closed = False
        self._lane = Lane(name)
        if cpus:
            # A thread inherits its creator's binding, which may be the core vLLM runs its model on.
            self._lane.put(run_on, cpus)
        if background:
            self._lane.put(deprioritize)
        if on_start is not None:
            self._lane.put(on_start)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the thread; its outcome is seen at the next wait()."""
        with self._cond:
            if self._closed:
                raise CopyError("the copy thread is closed")
            self._pending += 1
        self._lane.put(self._run, fn, args)

    def wait(self) -> None:
        """Block until every submitted copy has ended; raise CopyError if one of them failed."""
        with self._cond:
            while self._pending:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise CopyError(f"a block copy failed: {error}") from error

    def close(self) -> None:
        """Finish the submitted copies and stop the thread; safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._lane.close()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # reported to the owner at wait(), never lost
            with self._cond:
                if self._error is None:
                    self._error = exc
        finally:
            with self._cond:
                self._pending -= 1
                if not self._pending:
                    self._cond.notify_all()
