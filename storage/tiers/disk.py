"""Disk tier: one self-describing blob file per chunk under ``disk_path``, CLOCK within ``disk_size``.

Who owns what: the event loop owns the index, the pins, the byte accounting and the stats; the tier's
I/O threads (``IOThreads``) only run file I/O on the paths and buffers handed to them.
Design: docs/internals.md#disk-tier-diskpy-disk_filespy-disk_indexpy
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice
from typing import Any, TypeVar

from kvtier.runtime.handoff import IOThreads, Job
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier, TierListener, TierStats
from kvtier.storage.config import DiskConfig
from kvtier.storage.tiers.disk_files import BlobFiles, DiskIO, ScanReport, error_kind
from kvtier.storage.tiers.disk_index import DiskIndex, IndexLoad, ScanBatch, order_by_mtime
from kvtier.storage.tiers.pins import PinBook

log = logging.getLogger("kvtier.disk")
T = TypeVar("T")
_IO_THREADS = 4
# Scan jobs in flight: on a cold disk each header read waits on the device, and more reads in flight
# end sooner; on a warm one they take turns with the GIL. The threads end with the load.
_SCAN_THREADS = 8
_SLACK_SHIFT = 10  # eviction frees disk_size >> this beyond its need
_CLEAR_STEP = 8192  # keys a clear unindexes between two turns of the loop


class DiskTier:
    """LowerTier over a directory of blob files; every failure is a counted miss, never an exception."""

    tier = Tier.DISK

    def __init__(
        self, config: DiskConfig, io: DiskIO | None = None, listener: TierListener | None = None
    ) -> None:
        if not config.path:
            raise ValueError("DiskTier needs a directory (setting disk_path, KVTIER_DISK_PATH)")
        self.root = os.path.abspath(config.path)
        self.capacity = config.capacity
        self.files = BlobFiles(self.root, io or DiskIO(), config.fsync)
        self.last_scan = ScanReport()
        self.listener = listener  # told of every chunk indexed or unindexed (KV events)
        self._index = DiskIndex()
        self._ids = self._index.ids
        self._load: IndexLoad | None = None  # the books of the index's load, while it runs
        self._load_task: asyncio.Task[None] | None = None
        self._complete = asyncio.Event()
        self._slack = self.capacity >> _SLACK_SHIFT
        self._reserved = 0  # bytes of writes in flight, so concurrent puts cannot overshoot capacity
        self._book = PinBook()
        self._writing: dict[ChunkKey, Job[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._stats = TierStats(capacity=self.capacity)
        self._threads = IOThreads(_IO_THREADS, "kvtier-disk")
        # Writes are write-behind, nobody waits for them: they take only cores nothing else wants,
        # while reads (a hit's load) keep their priority (runtime/affinity.py).
        self._writers = IOThreads(_IO_THREADS, "kvtier-disk-write", idle=True)
        # The scan has threads of its own, so a hit's read never queues behind a directory.
        self._scanners = IOThreads(_SCAN_THREADS, "kvtier-disk-scan")

    # ------------------------------------------------------------------------------------------ helpers
    def path_of(self, key: ChunkKey) -> str:
        """Absolute file path of key."""
        return self.files.path_of(key)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._threads.run(fn, *args)

    def _drop(self, key: ChunkKey) -> bool:
        """Unindex key (a load in progress remembers it, so the scan cannot bring it back)."""
        self._book.forget(key)
        if self._load is not None:
            self._load.dropped.add(self._ids.compact(key))
        compact = self._index.find(key)
        if compact is None or self._index.pop(compact) is None:
            return False
        if self.listener is not None:
            self.listener.removed(Tier.DISK, [key])
        return True

    def _touch(self, compact: bytes) -> None:
        if self._index.touch(compact) and self._load is not None:
            self._load.stored(compact)

    # ------------------------------------------------------------------------------------------ start
    @property
    def index_complete(self) -> bool:
        """Whether the index holds every file under disk_path (the background load has ended)."""
        return self._complete.is_set()

    async def wait_loaded(self) -> None:
        """Wait until the index is complete (it never is if start() was not called)."""
        await self._complete.wait()

    async def start(self) -> None:
        """Create disk_path if missing and start loading the index in the background (see above)."""
        try:
            await self._run(self.files.io.makedirs, self.root)
        except Exception as exc:  # the root cannot be created
            self._stats.count_error(error_kind(exc))
            self._stats.healthy = False
            self._complete.set()  # nothing more will be found
            log.warning("disk tier %s unusable: %s", self.root, exc)
            return
        self._stats.healthy = True
        self._load = IndexLoad()
        self._load_task = asyncio.get_running_loop().create_task(self._load_index(self._load))

    async def _load_index(self, load: IndexLoad) -> None:
        """Scan disk_path a fan-out directory per job, merging each into the index as it comes; then
        put the files' order in place and fit the index in disk_size."""
        report = ScanReport()
        try:
            prefix = self._ids.prefix
            units, batch, part = await self._scanners.run(self.files.scan_plan, prefix)
            await self._merge(load, batch, part, report)
            pending = iter(units)
            scan = partial(self._scanners.submit, self.files.scan_unit)
            jobs = deque(scan(unit, prefix) for unit in islice(pending, _SCAN_THREADS))
            while jobs:  # the loop merges one directory while the threads scan the next ones
                batch, part = await jobs.popleft().result()
                jobs.extend(scan(unit, prefix) for unit in islice(pending, 1))
                await self._merge(load, batch, part, report)
            load.settle(self._index, await self._scanners.run(order_by_mtime, *load.records()))
        except Exception as exc:  # the index keeps what was found, in the order it was found
            self._stats.count_error("scan_failed")
            log.warning(
                "disk tier %s: the index's load failed after %d files: %r", self.root, load.found, exc
            )
        self._load = None
        await self._loaded(report)
        await asyncio.get_running_loop().run_in_executor(None, self._scanners.close)

    async def _merge(self, load: IndexLoad, batch: ScanBatch, part: ScanReport, report: ScanReport) -> None:
        """Merge one scan job's findings into the index, and remove the files it says to."""
        report.add(part)
        writing = {self._ids.compact(k) for k in self._writing}
        indexed: list[int] | None = None if self.listener is None else []
        remove = load.merge(self._index, batch, writing, indexed)
        if self.listener is not None and indexed:
            key_of = self._ids.key_of
            keys = [key_of(batch.keys[i]) for i in indexed]
            self.listener.stored(Tier.DISK, keys, [batch.covered[i] for i in indexed])
        if remove:
            await self._remove([self._ids.key_of(c) for c in remove], self._scanners)

    async def _loaded(self, report: ScanReport) -> None:
        """The index is complete: count what the scan found, fit the index in disk_size."""
        self.last_scan = report
        for kind, n in (
            ("scan_temp", report.temp_removed),
            ("scan_foreign", report.foreign_skipped),
            ("scan_unreadable", report.unreadable_skipped),
            ("scan_outdated", report.outdated_removed),
            ("corrupt", report.corrupt_removed),
        ):
            if n:
                self._stats.errors[kind] = self._stats.errors.get(kind, 0) + n
        victims = self._pick_victims(0) or []
        if victims:
            await self._remove(victims)
        self._complete.set()
        log.info(
            "disk tier %s: index complete, %d chunks (%d bytes) kept, %d evicted to fit %d bytes; "
            "removed %d temp, %d corrupt and %d older-format files; skipped %d foreign and %d "
            "unreadable files",
            self.root, len(self._index), self._index.used, len(victims), self.capacity,
            report.temp_removed, report.corrupt_removed, report.outdated_removed,
            report.foreign_skipped, report.unreadable_skipped,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ LowerTier
    async def contains_many(self, keys: list[ChunkKey]) -> list[bool]:
        """Index lookups only; no I/O (every read verifies the file anyway)."""
        find, doomed = self._index.find, self._book.is_doomed
        return [find(key) is not None and not doomed(key) for key in keys]

    async def put(self, key: ChunkKey, payload: memoryview, covered: Sequence[bytes] = ()) -> bool:
        """Write header, payload and covered block hashes (the trailer) to a temp file, rename it in;
        False on any failure or no room."""
        compact = self._index.find(key)
        if compact is not None and not self._book.is_doomed(key):
            self._touch(compact)
            return True
        job = self._writing.get(key) or self._start_write(key, payload, covered)
        if job is None:
            return False
        try:
            # A cancelled put returns only when the write has ended: it still reads the caller's buffer.
            await job.result()
        except Exception:  # already counted by _wrote
            return False
        return True

    def _start_write(self, key: ChunkKey, payload: memoryview, covered: Sequence[bytes]) -> Job[None] | None:
        """Reserve room and queue the write; None (counted) when it cannot fit."""
        view = memoryview(payload).cast("B")
        try:
            trailer = codec.encode_trailer(covered)
        except ValueError:  # hashes no trailer can hold: the chunk is stored without them
            self._stats.count_error("trailer")
            trailer, covered = b"", ()
        size = codec.header_size(key) + view.nbytes + len(trailer)
        if size > self.capacity:
            self._stats.count_error("too_large")
            return None
        victims = self._pick_victims(size)
        if victims is None:
            self._stats.count_error("full")
            return None
        evict = [self.path_of(k) for k in victims]
        hook = partial(self._wrote, key, size, view.nbytes, covered)
        try:
            job = self._writers.submit(self.files.write, key, view, evict, trailer, hook=hook)
        except RuntimeError as exc:  # the tier was closed meanwhile
            self._stats.count_error(error_kind(exc))
            return None
        # The hook runs on this loop, so nothing can settle the job before these two lines.
        # One job per key, so concurrent puts of one key share it and the index sees every file.
        self._reserved += size
        self._writing[key] = job
        return job

    def _wrote(
        self,
        key: ChunkKey,
        size: int,
        nbytes: int,
        covered: Sequence[bytes],
        _value: None,
        error: BaseException | None,
    ) -> None:
        """Settle a write's bookkeeping on the loop, before any putter wakes."""
        self._reserved -= size
        del self._writing[key]
        if error is not None:  # every I/O failure is a counted miss, never raised to the store
            self._stats.count_error(error_kind(error))
            return
        self._book.forget(key)
        compact = self._ids.compact(key)
        self._index.put(compact, size)  # replaces any entry of the key: its file was replaced
        if self._load is not None:
            self._load.stored(compact)
        self._stats.stores += 1
        self._stats.bytes_written += nbytes
        if self.listener is not None:
            self.listener.stored(Tier.DISK, [key], [covered])

    def _pick_victims(self, need: int) -> list[ChunkKey] | None:
        """Unindex unpinned keys the clock picks until need more bytes fit, and the slack too where
        they can; None if impossible, or while the index loads (the files' order is not known yet)."""
        index = self._index
        excess = index.used + self._reserved + need - self.capacity
        if excess <= 0:
            return []
        if self._load is not None:
            return None
        key_of, pinned = self._ids.key_of, self._book.pinned

        def held(compact: bytes) -> bool:
            return pinned(key_of(compact))

        picked = index.victims(excess, held, self._slack)
        if not picked:
            return None
        keys = [key_of(compact) for compact in picked]
        for compact, key in zip(picked, keys, strict=True):
            index.pop(compact)
            self._book.forget(key)
        self._stats.evictions += len(keys)
        if self.listener is not None:
            self.listener.removed(Tier.DISK, keys)
        return keys

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """Read key's payload straight into dest and verify it; False on miss, error or corruption."""
        compact = self._index.find(key)
        if compact is None:
            self._stats.misses += 1
            return False
        dest = memoryview(dest).cast("B")
        try:
            await self._run(self.files.read, key, dest)
        except Exception as exc:  # a bad or vanished file is a counted miss
            if self._failed_read(key, error_kind(exc)):
                await self._remove([key])
            return False
        self._touch(compact)
        self._stats.hits += 1
        self._stats.bytes_read += dest.nbytes
        return True

    async def read_elsewhere(self, good: list[ChunkKey], nbytes: int, corrupt: list[ChunkKey]) -> None:
        """Count chunks a client read from their files itself as get_into() would: the good ones
        are hits, marked used; the corrupt ones are counted and their files removed."""
        for key in good:
            compact = self._index.find(key)
            if compact is not None:
                self._touch(compact)
        self._stats.hits += len(good)
        self._stats.bytes_read += nbytes
        for key in corrupt:
            self._failed_read(key, "corrupt")
        if corrupt:
            await self._remove(corrupt)

    def _failed_read(self, key: ChunkKey, kind: str) -> bool:
        """Count a read of key that failed with kind (a miss); a corrupt or vanished file leaves the
        index. True when its file must go too (corrupt)."""
        self._stats.count_error(kind)
        self._stats.misses += 1
        if kind in ("corrupt", "missing"):
            self._drop(key)
        return kind == "corrupt"

    async def delete(self, key: ChunkKey) -> None:
        """Remove key; a pinned key disappears from lookups now and from disk at its last unpin.
        While the index loads, a key it does not hold yet may still have a file: that goes too."""
        pending = self._writing.get(key)
        if pending is not None:
            await pending.ended()
        if self._index.find(key) is None and self._load is None:
            return
        if self._book.pinned(key):
            self._book.doom(key)
            if self.listener is not None and self._index.find(key) is not None:
                self.listener.removed(Tier.DISK, [key])  # hidden from lookups from now on
            return
        self._drop(key)
        await self._remove([key])

    async def _remove(self, keys: list[ChunkKey], threads: IOThreads | None = None) -> None:
        """Unlink the files of keys already dropped from the index; a failure is counted only."""
        try:
            paths = [self.path_of(k) for k in keys]
            await (threads or self._threads).run(self.files.unlink_quiet, paths)
        except Exception as exc:  # e.g. the tier was closed meanwhile
            self._stats.count_error(error_kind(exc))

    async def clear(self) -> int:
        """Remove every unpinned chunk (ClearableTier); returns how many were indexed. While the
        index loads, the files the scan finds from then on are removed as it finds them."""
        if self._load is not None:
            self._load.cleared = True
        keys = self._index.key_list()
        removed = 0
        for start in range(0, len(keys), _CLEAR_STEP):  # the loop serves between steps
            victims = [self._ids.key_of(c) for c in keys[start : start + _CLEAR_STEP] if c in self._index]
            victims = [k for k in victims if not self._book.pinned(k)]
            for key in victims:
                self._drop(key)
            if victims:
                await self._remove(victims)
            removed += len(victims)
        return removed

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
        return self._stats.snapshot(
            chunks=len(self._index),
            bytes=self._index.used,
            capacity=self.capacity,
            loading=not self.index_complete,
        )

    async def close(self) -> None:
        """Stop the index's load, wait for writes and background removals, then stop the threads."""
        if self._load_task is not None:
            self._load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._load_task
        pending: list[Any] = [job.ended() for job in self._writing.values()]
        pending += self._background
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._scanners.close)
        await loop.run_in_executor(None, self._writers.close)
        await loop.run_in_executor(None, self._threads.close)
