"""A small circuit breaker, so a dead backend costs one timeout per period instead of one per call.

Who owns what: one breaker per backend, used from one event loop (or under the caller's own lock); it
does no I/O and never sleeps. The clock is injected so tests step time by hand.
Design: docs/internals.md#circuit-breaker-breakerpy
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    """Where the breaker stands."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Refuses calls for ``period`` seconds after ``failure_threshold`` consecutive failures."""

    def __init__(
        self,
        period: float,
        *,
        failure_threshold: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if period <= 0:
            raise ValueError(f"breaker period must be positive, got {period}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {failure_threshold}")
        self.period = period
        self.failure_threshold = failure_threshold
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_started = 0.0
        self.opens = 0  # times the breaker went from closed or half-open to open

    @property
    def closed(self) -> bool:
        """True while calls flow normally."""
        return self._state is BreakerState.CLOSED

    def allow(self) -> bool:
        """Whether a call may go to the backend now; a True in half-open makes the caller the probe."""
        now = self._clock()
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            if now - self._opened_at >= self.period:
                self._state = BreakerState.HALF_OPEN
                self._probe_started = now
                return True
            return False
        # Half-open: one probe at a time, but a probe lost for a whole period gives way to a new one.
        if now - self._probe_started >= self.period:
            self._probe_started = now
            return True
        return False

    def record_success(self) -> None:
        """The backend answered (a miss is an answer): close the breaker."""
        self._state = BreakerState.CLOSED
        self._failures = 0

    def record_failure(self) -> None:
        """The backend failed (timeout, connection refused or reset): count towards opening."""
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            if self._state is not BreakerState.OPEN:
                self.opens += 1
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
