"""Disk tier: one self-describing blob file per chunk under ``disk_path``, LRU within ``disk_size``.

Files live at ``disk_path/keys.disk_relpath(key)``; how they are written, read and verified is
``storage.tiers.disk_files``. Who owns what: the event loop owns the index (key -> file size, in LRU
order), the pins, the byte accounting and the stats. File I/O runs in this tier's own few threads
(``IOThreads``), one hand-off each way per chunk: a put writes, checksums and renames in one call; a
get reads and verifies in one call; a put's bookkeeping runs in the hook that settles its job. The
threads only run file I/O on paths and buffers handed to them; they never touch the index.

Pins and deletes: pinned keys are never evicted. ``delete`` of a pinned key hides it from
``contains_many`` at once but keeps serving ``get_into`` to the lease that pinned it; the file goes when
the last pin is released. Recency after a restart comes from file modification times (a hit does not
touch the file, to keep reads free of metadata writes).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from kvtier.runtime.handoff import IOThreads, Job
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier, TierStats
from kvtier.storage.config import DiskConfig
from kvtier.storage.tiers.disk_files import BlobFiles, DiskIO, ScanReport, error_kind
from kvtier.storage.tiers.pins import PinBook

log = logging.getLogger("kvtier.disk")
T = TypeVar("T")
_IO_THREADS = 4


class DiskTier:
    """LowerTier over a directory of blob files; every failure is a counted miss, never an exception."""

    tier = Tier.DISK

    def __init__(self, config: DiskConfig, io: DiskIO | None = None) -> None:
        if not config.path:
            raise ValueError("DiskTier needs a directory (setting disk_path, KVTIER_DISK_PATH)")
        self.root = os.path.abspath(config.path)
        self.capacity = config.capacity
        self.files = BlobFiles(self.root, io or DiskIO(), config.fsync)
        self.last_scan = ScanReport()
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()
        self._used = 0
        self._reserved = 0  # bytes of writes in flight, so concurrent puts cannot overshoot capacity
        self._book = PinBook()
        self._writing: dict[ChunkKey, Job[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._stats = TierStats(capacity=self.capacity)
        self._threads = IOThreads(_IO_THREADS, "kvtier-disk")
        # Writes are write-behind, nobody waits for them: they take only cores nothing else wants,
        # while reads (a hit's load) keep their priority (runtime/affinity.py).
        self._writers = IOThreads(_IO_THREADS, "kvtier-disk-write", idle=True)

    # ------------------------------------------------------------------------------------------ helpers
    def path_of(self, key: ChunkKey) -> str:
        """Absolute file path of key."""
        return self.files.path_of(key)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._threads.run(fn, *args)

    def _drop(self, key: ChunkKey) -> bool:
        size = self._index.pop(key, None)
        self._book.forget(key)
        if size is None:
            return False
        self._used -= size
        return True

    def _insert(self, key: ChunkKey, size: int) -> None:
        self._drop(key)
        self._index[key] = size
        self._used += size

    # ------------------------------------------------------------------------------------------ start
    async def start(self) -> None:
        """Rebuild the index from the files under disk_path (in a thread), then fit it in disk_size."""
        try:
            found, report = await self._run(self.files.scan)
        except Exception as exc:  # the root cannot be created or listed
            self._stats.count_error(error_kind(exc))
            self._stats.healthy = False
            log.warning("disk tier %s unusable: %s", self.root, exc)
            return
        self.last_scan = report
        self._index.clear()
        self._used = 0
        for key, size, _mtime in sorted(found, key=lambda item: item[2]):
            self._insert(key, size)
        for kind, n in (
            ("scan_temp", report.temp_removed),
            ("scan_foreign", report.foreign_skipped),
            ("scan_unreadable", report.unreadable_skipped),
            ("scan_outdated", report.outdated_removed),
            ("corrupt", report.corrupt_removed),
        ):
            if n:
                self._stats.errors[kind] = self._stats.errors.get(kind, 0) + n
        victims = self._pick_victims(0)
        if victims:
            await self._remove(victims)
        self._stats.healthy = True
        log.info(
            "disk tier %s: %d chunks (%d bytes) kept, %d evicted to fit %d bytes; removed %d temp, "
            "%d corrupt and %d older-format files; skipped %d foreign and %d unreadable files",
            self.root, len(self._index), self._used, len(victims or []), self.capacity,
            report.temp_removed, report.corrupt_removed, report.outdated_removed,
            report.foreign_skipped, report.unreadable_skipped,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ LowerTier
    async def contains_many(self, keys: list[ChunkKey]) -> list[bool]:
        """Index lookups only; no I/O (every read verifies the file anyway)."""
        return [key in self._index and not self._book.is_doomed(key) for key in keys]

    async def put(self, key: ChunkKey, payload: memoryview) -> bool:
        """Write header and payload to a temp file, rename it in; False on any failure or no room."""
        if key in self._index and not self._book.is_doomed(key):
            self._index.move_to_end(key)
            return True
        job = self._writing.get(key) or self._start_write(key, payload)
        if job is None:
            return False
        try:
            # A cancelled put returns only when the write has ended: it still reads the caller's buffer.
            await job.result()
        except Exception:  # already counted by _wrote
            return False
        return True

    def _start_write(self, key: ChunkKey, payload: memoryview) -> Job[None] | None:
        """Reserve room and queue the write; None (counted) when it cannot fit."""
        view = memoryview(payload).cast("B")
        size = codec.header_size(key) + view.nbytes
        if size > self.capacity:
            self._stats.count_error("too_large")
            return None
        victims = self._pick_victims(size)
        if victims is None:
            self._stats.count_error("full")
            return None
        evict = [self.path_of(k) for k in victims]
        hook = partial(self._wrote, key, size, view.nbytes)
        try:
            job = self._writers.submit(self.files.write, key, view, evict, hook=hook)
        except RuntimeError as exc:  # the tier was closed meanwhile
            self._stats.count_error(error_kind(exc))
            return None
        # The hook runs on this loop, so nothing can settle the job before these two lines.
        # One job per key, so concurrent puts of one key share it and the index sees every file.
        self._reserved += size
        self._writing[key] = job
        return job

    def _wrote(
        self, key: ChunkKey, size: int, nbytes: int, _value: None, error: BaseException | None
    ) -> None:
        """Settle a write's bookkeeping on the loop, before any putter wakes."""
        self._reserved -= size
        del self._writing[key]
        if error is not None:  # every I/O failure is a counted miss, never raised to the store
            self._stats.count_error(error_kind(error))
            return
        self._insert(key, size)
        self._stats.stores += 1
        self._stats.bytes_written += nbytes

    def _pick_victims(self, need: int) -> list[ChunkKey] | None:
        """Unindex least recently used unpinned keys until need more bytes fit; None if impossible."""
        excess = self._used + self._reserved + need - self.capacity
        if excess <= 0:
            return []
        victims: list[ChunkKey] = []
        for key, size in self._index.items():
            if excess <= 0:
                break
            if self._book.pinned(key):
                continue
            victims.append(key)
            excess -= size
        if excess > 0:
            return None
        for key in victims:
            self._drop(key)
        self._stats.evictions += len(victims)
        return victims

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """Read key's payload straight into dest and verify it; False on miss, error or corruption."""
        if key not in self._index:
            self._stats.misses += 1
            return False
        dest = memoryview(dest).cast("B")
        try:
            await self._run(self.files.read, key, dest)
        except Exception as exc:  # a bad or vanished file is a counted miss
            kind = error_kind(exc)
            self._stats.count_error(kind)
            self._stats.misses += 1
            if kind in ("corrupt", "missing"):
                self._drop(key)
                if kind == "corrupt":
                    await self._remove([key])
            return False
        if key in self._index:
            self._index.move_to_end(key)
        self._stats.hits += 1
        self._stats.bytes_read += dest.nbytes
        return True

    async def delete(self, key: ChunkKey) -> None:
        """Remove key; a pinned key disappears from lookups now and from disk at its last unpin."""
        pending = self._writing.get(key)
        if pending is not None:
            await pending.ended()
        if key not in self._index:
            return
        if self._book.pinned(key):
            self._book.doom(key)
            return
        self._drop(key)
        await self._remove([key])

    async def _remove(self, keys: list[ChunkKey]) -> None:
        """Unlink the files of keys already dropped from the index; a failure is counted only."""
        try:
            await self._run(self.files.unlink_quiet, [self.path_of(k) for k in keys])
        except Exception as exc:  # e.g. the tier was closed meanwhile
            self._stats.count_error(error_kind(exc))

    async def clear(self) -> int:
        """Remove every unpinned chunk (ClearableTier); returns how many were removed."""
        victims = [k for k in self._index if not self._book.pinned(k)]
        for key in victims:
            self._drop(key)
        if victims:
            await self._remove(victims)
        return len(victims)

    def pin(self, keys: list[ChunkKey]) -> None:
        """Keep keys from eviction until unpinned (one unpin per pin)."""
        self._book.pin(keys)

    def unpin(self, keys: list[ChunkKey]) -> None:
        """Release one pin of each key; a key deleted while pinned goes at its last unpin."""
        for key in self._book.unpin(keys):
            self._drop(key)
            self._spawn_remove(key)

    def _spawn_remove(self, key: ChunkKey) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.files.unlink_quiet([self.path_of(key)])  # no loop (a synchronous caller): one syscall
            return
        task = loop.create_task(self._remove([key]))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        return self._stats.snapshot(chunks=len(self._index), bytes=self._used, capacity=self.capacity)

    async def close(self) -> None:
        """Wait for writes and background removals, then stop the I/O threads."""
        pending: list[Any] = [job.ended() for job in self._writing.values()]
        pending += self._background
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._writers.close)
        await loop.run_in_executor(None, self._threads.close)
