"""When a ServiceClient tries to connect again: backoff policies and the retry schedule that uses them.

Policies are objects passed to the client, so tests inject a short constant wait. The schedule runs as
one task on the client's loop thread (see kvtier.app.client_loop), which owns the connection.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("kvtier.client")


class Backoff(Protocol):
    """Reconnect schedule: seconds to wait before reconnect attempt number ``attempt`` (0-based)."""

    def delay(self, attempt: int) -> float:
        """Seconds before this attempt."""


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """initial * factor**attempt, capped, with +-jitter so many clients do not reconnect in step."""

    initial: float = 0.05
    factor: float = 2.0
    maximum: float = 2.0
    jitter: float = 0.2

    def delay(self, attempt: int) -> float:
        """Seconds before this attempt."""
        base = min(self.maximum, self.initial * self.factor ** min(attempt, 32))
        return max(0.0, base * (1.0 + random.uniform(-self.jitter, self.jitter)))


@dataclass(frozen=True, slots=True)
class ConstantBackoff:
    """The same short wait before every attempt (tests)."""

    seconds: float = 0.01

    def delay(self, attempt: int) -> float:
        """Seconds before this attempt."""
        return self.seconds


class Reconnector:
    """Runs connect attempts until one succeeds: after each failure, the on_unavailable hook (which may
    bring the service back: embedded mode respawns it) and one more attempt, then the backoff's delay.

    Loop thread only. connect_once makes one attempt and says whether the client is ready; failed is
    told of each failed attempt; closed says whether to give up.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        connect_once: Callable[[], Awaitable[bool]],
        failed: Callable[[], None],
        closed: Callable[[], bool],
        backoff: Backoff,
        on_unavailable: Callable[[], object] | None,
    ) -> None:
        self._loop = loop
        self._connect_once = connect_once
        self._failed = failed
        self._closed = closed
        self._backoff = backoff
        self._on_unavailable = on_unavailable
        self._task: asyncio.Task[None] | None = None

    def start(self, first_delay: float) -> None:
        """Start reconnecting after first_delay, unless closed or under way already."""
        if self._closed() or (self._task is not None and not self._task.done()):
            return
        self._task = self._loop.create_task(self._run(first_delay))

    def cancel(self) -> None:
        """Stop reconnecting (the client closes)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self, delay: float) -> None:
        attempt = 0
        while not self._closed():
            if delay > 0:
                await asyncio.sleep(delay)
            if await self._connect_once():
                return
            self._failed()
            if self._on_unavailable is not None and not self._closed():
                await self._run_hook()
                if await self._connect_once():
                    return
            delay = self._backoff.delay(attempt)
            attempt += 1

    async def _run_hook(self) -> None:
        assert self._on_unavailable is not None
        try:
            # The hook may block (embedded mode spawns and waits for a service): not on this loop.
            await self._loop.run_in_executor(None, self._on_unavailable)
        except Exception as exc:
            log.warning("on_unavailable hook failed: %s", exc)
