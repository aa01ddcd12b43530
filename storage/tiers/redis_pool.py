"""The Redis tier's pool of raw connections (``redis_wire.RawConnection``): each command runs on a
worker thread of the tier under a deadline.

Who owns what: the pool (event loop side) owns its idle connections and hands one to one worker
thread per command; the executor is the tier's, which shuts it down.
Design: docs/internals.md#redis-tier-redispy-redis_wirepy-redis_poolpy
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvtier.runtime.handoff import wait_done
from kvtier.storage.signing import Signer
from kvtier.storage.tiers.redis_wire import RawConnection, RawEndpoint, ServerReplyError

T = TypeVar("T")


class RawPool:
    """Up to ``size`` raw connections, each command run by a worker thread under a deadline."""

    def __init__(
        self,
        endpoint: RawEndpoint,
        size: int,
        timeout: float,
        executor: ThreadPoolExecutor,
        signer: Signer | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.signer = signer
        self.executor = executor  # borrowed from the tier, which shuts it down
        self._slots = asyncio.Semaphore(size)
        self._idle: list[RawConnection] = []

    async def run(self, op: Callable[[RawConnection, float], T]) -> T:
        """Run op(connection, deadline) in a thread; on timeout or cancel, abort it and wait for it."""
        async with self._slots:  # waiting for a connection is not part of the call's timeout
            conn = self._idle.pop() if self._idle else RawConnection(self.endpoint, self.timeout, self.signer)
            deadline = time.monotonic() + self.timeout
            work = self.executor.submit(self._call, conn, op, deadline)
            try:
                async with asyncio.timeout(self.timeout):
                    result = await asyncio.wrap_future(work)
            except BaseException as exc:
                if not work.done():
                    conn.abort()  # the thread may be writing into the caller's buffer: stop it
                    await wait_done(work)
                if not isinstance(exc, ServerReplyError):
                    self.drop_idle()  # the server likely went away: its other sockets are dead too
                self._put_back(conn)
                raise
            self._put_back(conn)
            return result

    @staticmethod
    def _call(conn: RawConnection, op: Callable[[RawConnection, float], T], deadline: float) -> T:
        try:
            if conn.connected and conn.stale():
                conn.close()
            if not conn.connected:
                conn.connect(deadline)
            return op(conn, deadline)
        except ServerReplyError:
            raise  # the reply was read whole: the connection is still in sync
        except BaseException:
            conn.broken = True
            raise

    def _put_back(self, conn: RawConnection) -> None:
        if conn.broken or not conn.connected:
            conn.close()
        else:
            self._idle.append(conn)

    def drop_idle(self) -> None:
        """Close every idle connection (no thread holds an idle one)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        """Close idle connections (a running command's connection closes when it ends)."""
        self.drop_idle()
