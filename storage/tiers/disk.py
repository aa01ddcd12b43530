"""Disk tier: one self-describing blob file per chunk under ``disk_path``, LRU within ``disk_size``.

Files live at ``disk_path/keys.disk_relpath(key)``. A write goes to a temp file opened exclusively in
the target directory, is checked for short writes, optionally fsynced, and is renamed into place, so a
reader or a restart never sees half a chunk. A read fills the caller's buffer straight from the file
(``os.preadv``) and verifies the checksum there; nothing is copied through Python bytes.

Who owns what: the event loop owns the index (key -> file size, in LRU order), the pins, the byte
accounting and the stats. Worker threads only run file I/O on paths and buffers handed to them and
report back by return value or exception; they never touch the index. File I/O runs in this tier's own
few threads (``IOThreads``), one hand-off each way per chunk: a put writes, checksums and renames in
one call; a get reads and verifies in one call; a put's bookkeeping runs in the hook that settles its
job. A page-cache read or write is a memory copy, about as fast as the checksum, so each call splits
its work with its I/O thread's companion (``Handoff``): a put writes a blank header and the payload
while the companion checksums the payload, then writes the real header over the blank (the file is
still a temp file nobody reads); a get reads the payload's checksum segments (``codec.SEGMENT``) from
both ends at once, the worker from the front (with the header) and the companion from the back, each
hashing a segment as soon as it lands, while it is in that core's cache. A companion is offered only
for chunks big enough to pay for it and while a core is spare (``companion``), and one that is late
leaves the worker to do everything itself.

Pins and deletes: pinned keys are never evicted. ``delete`` of a pinned key hides it from
``contains_many`` at once but keeps serving ``get_into`` to the lease that pinned it; the file goes when
the last pin is released. Recency after a restart comes from file modification times (a hit does not
touch the file, to keep reads free of metadata writes).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from kvtier.runtime.handoff import Handoff, IOThreads, Job, TwoEnds, companion
from kvtier.storage import codec
from kvtier.storage.base import BlobError, BlobFormatError, ChunkKey, Tier, TierStats
from kvtier.storage.config import DiskConfig
from kvtier.storage.keys import disk_relpath, parse_disk_relpath
from kvtier.storage.tiers.pins import PinBook

log = logging.getLogger("kvtier.disk")
T = TypeVar("T")
TEMP_PREFIX = ".tmp-"
_IO_THREADS = 4


def _find_fallocate() -> Callable[[int, int, int, int], int] | None:
    """fallocate(2) itself, or None: glibc's posix_fallocate would emulate it by writing every block."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):  # not Linux, or no such symbol
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_FALLOCATE = _find_fallocate()
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class DiskIO:
    """The system calls of the disk tier, one method each, so tests can inject failures (ENOSPC...)."""

    def makedirs(self, path: str) -> None:
        """Create path and its parents if missing."""
        os.makedirs(path, exist_ok=True)

    def open_excl(self, path: str) -> int:
        """Create path exclusively for writing (fails if it exists)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def open_read(self, path: str) -> int:
        """Open path for reading."""
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def preallocate(self, fd: int, size: int) -> bool:
        """Allocate size bytes of disk to fd at once; False where the filesystem cannot."""
        if _FALLOCATE is None:
            return False
        if _FALLOCATE(fd, 0, 0, size) == 0:
            return True
        code = ctypes.get_errno()
        if code in _NO_FALLOCATE:
            return False
        raise OSError(code, os.strerror(code))

    def writev(self, fd: int, buffers: Sequence[memoryview]) -> int:
        """Write buffers in order with one call; may write less than asked."""
        return os.writev(fd, buffers)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """Write data at offset (the file position is unchanged); may write less than asked."""
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Read into buffers in order from offset; may read less than asked (0 at end of file)."""
        return os.preadv(fd, buffers, offset)

    def stat(self, fd: int) -> os.stat_result:
        """Size and times of the open file."""
        return os.fstat(fd)

    def fsync(self, fd: int) -> None:
        """Flush the file's data and metadata to the device."""
        os.fsync(fd)

    def fsync_dir(self, path: str) -> None:
        """Flush a directory entry change (a rename) to the device."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename src over dst."""
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        """Remove a file."""
        os.unlink(path)

    def close(self, fd: int) -> None:
        """Close a file descriptor."""
        os.close(fd)


class LengthMismatchError(Exception):
    """A valid blob whose payload length differs from the caller's buffer (a caller bug, not rot)."""


@dataclass(slots=True)
class ScanReport:
    """What start() found under disk_path."""

    chunks: int = 0
    bytes: int = 0
    temp_removed: int = 0
    foreign_skipped: int = 0
    corrupt_removed: int = 0
    outdated_removed: int = 0  # chunks of another storage format (kvtier upgraded or downgraded)
    unreadable_skipped: int = 0


def error_kind(exc: BaseException) -> str:
    """Stats label of an I/O failure: 'corrupt', 'missing', or the errno name ('enospc', 'erofs')."""
    if isinstance(exc, BlobError):
        return "corrupt"
    if isinstance(exc, LengthMismatchError):
        return "length_mismatch"
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, "oserror").lower()
    return type(exc).__name__.lower()


class DiskTier:
    """LowerTier over a directory of blob files; every failure is a counted miss, never an exception."""

    tier = Tier.DISK

    def __init__(self, config: DiskConfig, io: DiskIO | None = None) -> None:
        if not config.path:
            raise ValueError("DiskTier needs a directory (setting disk_path, KVTIER_DISK_PATH)")
        self.root = os.path.abspath(config.path)
        self._prefix = os.path.join(self.root, "")  # root plus one separator, joined once
        self.capacity = config.capacity
        self.fsync = config.fsync
        self.io = io or DiskIO()
        self._preallocate = True  # until the filesystem says it cannot
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
        # while reads (a hit's load) keep their priority (app/affinity.py).
        self._writers = IOThreads(_IO_THREADS, "kvtier-disk-write", idle=True)
        self._temp_tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._temp_seq = itertools.count()

    # ------------------------------------------------------------------------------------------ helpers
    def path_of(self, key: ChunkKey) -> str:
        """Absolute file path of key."""
        return self._prefix + disk_relpath(key)

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
            found, report = await self._run(self._scan)
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

    def _scan(self) -> tuple[list[tuple[ChunkKey, int, float]], ScanReport]:
        self.io.makedirs(self.root)
        report = ScanReport()
        found: list[tuple[ChunkKey, int, float]] = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.startswith(TEMP_PREFIX):
                    # Left by a write that never finished (crash): never valid, safe to remove.
                    report.temp_removed += self._unlink_quiet([path])
                    continue
                key = parse_disk_relpath(os.path.relpath(path, self.root).replace(os.sep, "/"))
                if key is None:
                    report.foreign_skipped += 1  # not ours: leave it alone
                    continue
                try:
                    size, mtime = self._check_file(path, key)
                except BlobFormatError:
                    # No namespace of this build names it: unindexed, it would hold disk_size's space.
                    report.outdated_removed += self._unlink_quiet([path])
                    continue
                except BlobError:
                    report.corrupt_removed += self._unlink_quiet([path])
                    continue
                except OSError:
                    report.unreadable_skipped += 1  # an I/O error is not proof of rot: keep the file
                    continue
                found.append((key, size, mtime))
                report.chunks += 1
                report.bytes += size
        return found, report

    def _check_file(self, path: str, key: ChunkKey) -> tuple[int, float]:
        """Validate the header and length of one file (the payload is verified on every read)."""
        fd = self.io.open_read(path)
        try:
            buf = bytearray(codec.header_size(key))
            got = self._read_vec(fd, [memoryview(buf)], 0)
            header = codec.parse_header(memoryview(buf)[:got], key)
            st = self.io.stat(fd)
            if st.st_size != header.blob_size:
                raise BlobError(f"file is {st.st_size} bytes, header says {header.blob_size}")
            return st.st_size, st.st_mtime
        finally:
            self.io.close(fd)

    def _unlink_quiet(self, paths: list[str]) -> int:
        removed = 0
        for path in paths:
            try:
                self.io.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                pass  # counted by the caller's outcome; a file we cannot remove is still unindexed
        return removed

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
            job = self._writers.submit(self._write_file, key, view, evict, hook=hook)
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

    def _write_file(self, key: ChunkKey, payload: memoryview, evict: list[str]) -> None:
        self._unlink_quiet(evict)
        final = self.path_of(key)
        directory = final.rpartition(os.sep)[0]
        # Unique per process and write (O_EXCL catches the impossible clash); uuid4 costs ~25 us here.
        temp = os.path.join(directory, f"{TEMP_PREFIX}{self._temp_tag}-{next(self._temp_seq)}")
        try:
            fd = self.io.open_excl(temp)
        except FileNotFoundError:  # first chunk in this fan-out directory: create it, once
            self.io.makedirs(directory)
            fd = self.io.open_excl(temp)
        try:
            try:
                # One extent allocation for the whole file instead of ext4 reserving delayed-allocation
                # space page by page: writes of 2-8 MiB measured 10-20% faster here, and a full disk
                # fails before any byte is copied.
                size = codec.header_size(key) + payload.nbytes
                if self._preallocate and not self.io.preallocate(fd, size):
                    self._preallocate = False
                self._write_blob(fd, key, payload)
                if self.fsync:
                    self.io.fsync(fd)
            finally:
                self.io.close(fd)
            self.io.replace(temp, final)
        except BaseException:
            self._unlink_quiet([temp])
            raise
        if self.fsync:
            self.io.fsync_dir(directory)

    def _write_blob(self, fd: int, key: ChunkKey, payload: memoryview) -> None:
        """Write a blank header and the payload while the companion hashes it, then the real header."""
        digest = Handoff(codec.checksum, payload).offer(companion(payload.nbytes))
        try:
            self._write_all(fd, [memoryview(bytes(codec.header_size(key))), payload])
            header = codec.encode_header(key, payload, digest.result())
        finally:
            digest.settle()  # the companion may still be reading the caller's buffer
        self._pwrite_all(fd, memoryview(header), 0)

    def _pwrite_all(self, fd: int, data: memoryview, offset: int) -> None:
        """pwrite until every byte is written; a write that makes no progress is a full disk."""
        while data.nbytes:
            written = self.io.pwrite(fd, data, offset)
            if written <= 0:
                raise OSError(errno.ENOSPC, "short write made no progress")
            data, offset = data[written:], offset + written

    def _write_all(self, fd: int, buffers: list[memoryview]) -> None:
        """writev until every byte is written; a write that makes no progress is a full disk."""
        pending = [b for b in buffers if b.nbytes]
        while pending:
            written = self.io.writev(fd, pending)
            if written <= 0:
                raise OSError(errno.ENOSPC, "short write made no progress")
            while pending and written >= pending[0].nbytes:
                written -= pending[0].nbytes
                pending.pop(0)
            if written:
                pending[0] = pending[0][written:]

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """Read key's payload straight into dest and verify it; False on miss, error or corruption."""
        if key not in self._index:
            self._stats.misses += 1
            return False
        dest = memoryview(dest).cast("B")
        try:
            await self._run(self._read_file, key, dest)
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

    def _read_file(self, key: ChunkKey, dest: memoryview) -> None:
        fd = self.io.open_read(self.path_of(key))
        try:
            hsize = codec.header_size(key)
            count = codec.segment_count(dest.nbytes)
            digests = [0] * count
            segments = TwoEnds(count)
            first = segments.front()  # 0, read with the header (None for an empty payload)
            back = Handoff(self._read_segments, fd, dest, segments.back, digests, hsize)
            back.offer(companion(dest.nbytes))
            try:
                header = self._read_head(fd, key, hsize, dest, first, digests)
                self._read_segments(fd, dest, segments.front, digests, hsize)
                back.result()  # the companion's segments, or any it left, read here
            finally:
                segments.close()  # on an error, the companion takes no more segments
                back.settle()  # it may be reading into dest: the caller gets it back after
            if codec.combine(digests) != header.checksum:
                raise BlobError("payload checksum mismatch")
        finally:
            self.io.close(fd)

    def _read_head(
        self, fd: int, key: ChunkKey, hsize: int, dest: memoryview, first: int | None, digests: list[int]
    ) -> codec.BlobHeader:
        """Read and check the header, with segment first in the same system call, and hash that."""
        head = memoryview(bytearray(hsize))
        end = 0 if first is None else codec.segment_span(first, dest.nbytes)[1]
        got = self._read_vec(fd, self._with_end([head, dest[:end]], end, dest), 0)
        header = codec.parse_header(head[: min(got, hsize)], key)
        self._check_length(fd, header, dest)
        if got != hsize + end:
            raise BlobError(f"file has {got} of {header.blob_size} bytes or more")
        if first is not None:
            digests[first] = codec.segment_digest(dest[:end])
        return header

    def _read_segments(
        self, fd: int, dest: memoryview, take: Callable[[], int | None], digests: list[int], hsize: int
    ) -> None:
        """Read and hash the segments take() hands out until none is left (worker or companion)."""
        while (i := take()) is not None:
            start, end = codec.segment_span(i, dest.nbytes)
            self._read_part(fd, dest, start, end, hsize)
            digests[i] = codec.segment_digest(dest[start:end])

    def _read_part(self, fd: int, dest: memoryview, start: int, end: int, hsize: int) -> None:
        """Read dest[start:end] from the file; a short read is corruption."""
        got = self._read_vec(fd, self._with_end([dest[start:end]], end, dest), hsize + start)
        if got != end - start:  # fewer: truncated; more: the byte past the end exists
            raise BlobError(f"file has {hsize + start + got} of {hsize + dest.nbytes} bytes or more")

    @staticmethod
    def _with_end(buffers: list[memoryview], end: int, dest: memoryview) -> list[memoryview]:
        """buffers, plus one byte past the payload when they reach its end (it must not exist)."""
        return [*buffers, memoryview(bytearray(1))] if end == dest.nbytes else buffers

    def _check_length(self, fd: int, header: codec.BlobHeader, dest: memoryview) -> None:
        """A valid header whose payload length is not the buffer's: rot if the file disagrees too."""
        if header.payload_len == dest.nbytes:
            return
        size = self.io.stat(fd).st_size
        if size != header.blob_size:
            raise BlobError(f"file is {size} bytes, header says {header.blob_size}")
        raise LengthMismatchError(f"stored payload is {header.payload_len} bytes, buffer is {dest.nbytes}")

    def _read_vec(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        """Fill buffers in order from offset; returns the bytes read (fewer only at end of file)."""
        pending = [b for b in buffers if b.nbytes]
        done = 0
        while pending:
            n = self.io.preadv(fd, pending, offset + done)
            if n <= 0:
                break
            done += n
            while pending and n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            if n:
                pending[0] = pending[0][n:]
        return done

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
            await self._run(self._unlink_quiet, [self.path_of(k) for k in keys])
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
            self._unlink_quiet([self.path_of(key)])  # no loop (a synchronous caller): one syscall
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
