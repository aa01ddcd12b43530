"""Write-behind queue from the CPU tier to the lower tiers (disk, Redis, object storage).

Who owns what: the store's event loop owns the queue and its worker tasks, and each accepted item
until ``on_done`` runs for it: once, after every tier's put ended, or at once for an item that never
started (given up for a reserve, cancelled, abandoned at close). ``offer`` never waits (a full queue
drops and counts); ``give_up`` hands queued items' slots back to a save that needs room.
Design: docs/internals.md#write-behind-writebackpy
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.storage.base import ChunkKey, LowerTier, SlotRef

log = logging.getLogger(__name__)

ViewFn = Callable[[SlotRef], memoryview]
# (key, slot, written): written is False when the item's write was given up, cancelled or abandoned.
DoneFn = Callable[[ChunkKey, SlotRef, bool], None]
FreesFn = Callable[[SlotRef], int]  # the arena bytes that ending this item's pin frees (0: none)


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
        self._max_queue = max_queue
        self._queued: OrderedDict[ChunkKey, _Item] = OrderedDict()  # not started, oldest first
        self._pending: dict[ChunkKey, _Item] = {}  # queued or being written
        self._ready = asyncio.Event()  # set while _queued holds items
        self._idle = asyncio.Event()  # set while _pending is empty
        self._idle.set()
        self._n_workers = workers
        self._workers: list[asyncio.Task[None]] = []
        self._closed = False
        self.dropped = 0  # refused (queue full, closed) or abandoned at close
        self.yielded = 0  # queued items given up so that a save found a slot
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
        if len(self._queued) >= self._max_queue:
            self.dropped += 1
            return False
        item = _Item(key, slot, covered)
        self._queued[key] = item
        self._pending[key] = item
        self._ready.set()
        self._idle.clear()
        self._start_workers()
        return True

    def cancel(self, key: ChunkKey) -> bool:
        """Key was deleted: skip its write, or delete it again from the tiers once written."""
        item = self._pending.get(key)
        if item is None:
            return False
        item.cancelled = True
        return True

    def give_up(self, need_bytes: int, frees: FreesFn) -> int:
        """Give up the oldest queued writes (never one already started) whose pins free arena bytes
        (frees() says how many), until they free need_bytes; returns the bytes they free.

        Each one's on_done runs now, and it is counted in yielded: a save that needs a slot comes
        before a write-behind that has not started.
        """
        chosen: list[_Item] = []
        got = 0
        for item in self._queued.values():
            if freed := frees(item.slot):
                chosen.append(item)
                got += freed
                if got >= need_bytes:
                    break
        for item in chosen:
            del self._queued[item.key]
            self.yielded += not item.cancelled  # a cancelled one was not to be written anyway
            self._finish(item, written=False)
        return got

    async def drain(self, timeout: float) -> bool:  # noqa: ASYNC109 (a shutdown budget)
        """Wait until every accepted write finished; False when timeout passed first."""
        if not self._pending:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
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
        while self._queued:
            self._finish(self._queued.popitem(last=False)[1], written=False)
            self.dropped += 1
        return drained

    def _start_workers(self) -> None:
        while len(self._workers) < self._n_workers:
            self._workers.append(asyncio.create_task(self._run(), name="kvtier-writeback"))

    async def _run(self) -> None:
        while True:
            while not self._queued:
                self._ready.clear()
                await self._ready.wait()
            item = self._queued.popitem(last=False)[1]  # started: give_up no longer sees it
            written = False
            try:
                await self._write(item)
                written = not item.cancelled
            except asyncio.CancelledError:
                self.dropped += 1
                raise
            except Exception:  # a tier broke its never-raise contract: log, keep the worker alive
                log.exception("write of %s failed", item.key)
                self.failed += 1
            finally:
                self._finish(item, written=written)

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

    def _finish(self, item: _Item, *, written: bool) -> None:
        if self._pending.get(item.key) is item:
            del self._pending[item.key]
            if not self._pending:
                self._idle.set()
        try:
            self._on_done(item.key, item.slot, written)
        except Exception:
            log.exception("releasing the slot of %s failed", item.key)
