"""A second thread for CPU block copies, so a step's copies use two cores instead of one.

Who owns what: the ``BlockCopier`` that creates a ``CopyThread`` owns it and is its only caller. The
thread only runs the copy functions handed to it; numpy drops the GIL inside each large copy, so it
and the caller's thread copy at the same time. ``wait()`` is the fence: after it returns, every copy
submitted before has ended, and the first error among them is raised there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class CopyError(RuntimeError):
    """A copy run by the copy thread failed."""


class CopyThread:
    """One daemon thread running submitted copies in order; wait() fences them."""

    def __init__(self, cpus: frozenset[int] | None = None, name: str = "kvtier-copy") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._cond = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(cpus,), name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the thread; its outcome is seen at the next wait()."""
        with self._cond:
            if self._closed:
                raise CopyError("the copy thread is closed")
            self._pending += 1
        self._jobs.put((fn, args))

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
        self._jobs.put(None)
        self._thread.join()

    def _run(self, cpus: frozenset[int] | None) -> None:
        if cpus:
            # A thread inherits its creator's binding, which may be the core vLLM runs its model on.
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setaffinity(0, cpus)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
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
