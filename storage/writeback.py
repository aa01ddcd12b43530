"""Write-behind queue from the CPU tier to the lower tiers (disk, Redis, object storage).

Who owns what: the store's event loop owns the queue and its worker tasks. ``offer`` never waits (a
full queue drops and counts); ``on_done`` runs once per accepted item, after every tier's put ended.
Design: docs/internals.md#write-behind-writebackpy
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.storage.base import ChunkKey, LowerTier, SlotRef

log = logging.getLogger(__name__)

ViewFn = Callable[[SlotRef], memoryview]
DoneFn = Callable[[ChunkKey, SlotRef], None]


@dataclass(slots=True, eq=False)
class _Item:
    key: ChunkKey
    slot: SlotRef
    covered: Sequence[bytes] = ()  # the chunk's block hashes, for the tiers' listener and trailers
    cancelled: bool = False  # deleted while queued: skip it, or undo it once written


class WriteBack:
    """Bounded queue of chunks to write to every lower tier, drained by a few worker tasks."""

    def __init__(
        self,
        tiers: Sequence[LowerTier],
        view: ViewFn,
        on_done: DoneFn,
        max_queue: int,
        workers: int = 2,
    ) -> None:
        if max_queue <= 0 or workers <= 0:
            raise ValueError("max_queue and workers must be positive")
        self._tiers = list(tiers)
        self._view = view
        self._on_done = on_done
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(max_queue)
        self._pending: dict[ChunkKey, _Item] = {}  # queued or being written
        self._n_workers = workers
        self._workers: list[asyncio.Task[None]] = []
        self._closed = False
        self.dropped = 0
        self.written = 0
        self.failed = 0

    @property
    def depth(self) -> int:
        """Items queued or being written."""
        return len(self._pending)

    def pending(self, key: ChunkKey) -> bool:
        """True while key is queued or being written."""
        return key in self._pending

    def offer(self, key: ChunkKey, slot: SlotRef, covered: Sequence[bytes] = ()) -> bool:
        """Queue key's slot (and the block hashes it covers) for writing without waiting; False (and
        counted) when full or closed."""
        if key in self._pending:
            return False
        if self._closed:
            self.dropped += 1
            return False
        item = _Item(key, slot, covered)
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        self._pending[key] = item
        self._start_workers()
        return True

    def cancel(self, key: ChunkKey) -> bool:
        """Key was deleted: skip its write, or delete it again from the tiers once written."""
        item = self._pending.get(key)
        if item is None:
            return False
        item.cancelled = True
        return True

    async def drain(self, timeout: float) -> bool:  # noqa: ASYNC109 (a shutdown budget)
        """Wait until every accepted write finished; False when timeout passed first."""
        if not self._pending:
            return True
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout: float) -> bool:  # noqa: ASYNC109 (a shutdown budget)
        """Drain within timeout, then stop; abandoned items are counted as dropped and released."""
        self._closed = True
        drained = await self.drain(timeout)
        workers, self._workers = self._workers, []
        for task in workers:
            task.cancel()
        for task in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while not self._queue.empty():
            self._finish(self._queue.get_nowait())
            self.dropped += 1
        return drained

    def _start_workers(self) -> None:
        while len(self._workers) < self._n_workers:
            self._workers.append(asyncio.create_task(self._run(), name="kvtier-writeback"))

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                await self._write(item)
            except asyncio.CancelledError:
                self.dropped += 1
                raise
            except Exception:  # a tier broke its never-raise contract: log, keep the worker alive
                log.exception("write of %s failed", item.key)
                self.failed += 1
            finally:
                self._queue.task_done()
                self._finish(item)

    async def _write(self, item: _Item) -> None:
        if item.cancelled:
            return
        view = self._view(item.slot)
        try:
            # Hashes only when known: a tier of the old two-argument form still takes the rest.
            puts = [
                tier.put(item.key, view, item.covered) if item.covered else tier.put(item.key, view)
                for tier in self._tiers
            ]
            results = await asyncio.gather(*puts, return_exceptions=True)
        finally:
            with contextlib.suppress(BufferError):  # a tier kept an export past its call
                view.release()
        for tier, result in zip(self._tiers, results, strict=True):
            if result is True:
                self.written += 1
            else:
                self.failed += 1
                if isinstance(result, BaseException):
                    log.error("tier %s raised on put of %s: %r", tier.tier.label, item.key, result)
        if item.cancelled:  # deleted while the write was running: do not leave it behind
            await asyncio.gather(*(tier.delete(item.key) for tier in self._tiers), return_exceptions=True)

    def _finish(self, item: _Item) -> None:
        if self._pending.get(item.key) is item:
            del self._pending[item.key]
        try:
            self._on_done(item.key, item.slot)
        except Exception:
            log.exception("releasing the slot of %s failed", item.key)
