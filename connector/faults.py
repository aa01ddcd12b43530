"""Errors the connector's degraded mode caught: expected failures of a tier or the service become
misses; anything else is a kvtier bug that vLLM never sees, so it is also recorded here, where the
tests (and ``unexpected_errors``) can see it."""

from __future__ import annotations

import logging
import threading

from kvtier.app.client import ServiceError
from kvtier.connector.copy_thread import CopyError
from kvtier.connector.layout import LayoutError

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

# What a miss is made of: the service or a tier failed, timed out or went away, or a KV layout the
# copies cannot serve. Anything else (TypeError, AttributeError, ...) is a fault of kvtier's code.
EXPECTED: tuple[type[BaseException], ...] = (ServiceError, TimeoutError, OSError, LayoutError)
_KEPT = 100  # the first ones: enough to name a bug, bounded however often it repeats

_lock = threading.Lock()
_unexpected: list[str] = []


def caught(exc: BaseException, where: str) -> None:
    """Record an exception the degraded mode caught at where, if it is not an expected failure."""
    if isinstance(exc, CopyError):  # the copy thread's wrapper: judge what failed in the copy
        if exc.__cause__ is None:
            return  # the copy thread is closed: the engine is shutting down
        exc = exc.__cause__
    if isinstance(exc, EXPECTED):
        return
    log.error("kvtier caught an unexpected error in %s (handled as a miss)", where, exc_info=exc)
    with _lock:
        if len(_unexpected) < _KEPT:
            _unexpected.append(f"{where}: {type(exc).__name__}: {exc}")


def unexpected_errors() -> list[str]:
    """The unexpected errors caught in this process so far, oldest first."""
    with _lock:
        return list(_unexpected)


def forget() -> None:
    """Start a new record (a test's own)."""
    with _lock:
        _unexpected.clear()
