"""Disk hits the worker reads itself: the chunk files, opened by the service and handed over its file
channel (``kvtier.app.file_channel``), read with ``preadv`` straight into the KV blocks.

The reads run on vLLM's worker thread, never on one of their own, and never wait for the disk: each
poll reads what the page cache holds (``RWF_NOWAIT``). Only for KV caches in host memory.
Design: docs/internals.md#disk-hits-the-worker-reads-disk_readspy
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.app.address import parse_url
from kvtier.app.file_channel import FileChannelError, FileClient, channel_path, close_all
from kvtier.connector import faults
from kvtier.connector.metadata import LoadJob
from kvtier.storage import codec
from kvtier.storage.base import BlobError, ChunkKey, Tier

log = logging.getLogger(f"vllm.{__name__}")

try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError):
    IOV_MAX = 1024


def file_channel_of(enabled: bool, service_url: str, kv_layout: str) -> str:
    """The file channel a worker reads disk hits through ('' for none): with the setting on, a
    unix-socket service, and KV caches in host memory (the namespace's kv_layout names the
    platform second)."""
    parts = kv_layout.split("/")
    if not enabled or len(parts) < 2 or parts[1].partition(":")[0] != "cpu":  # e.g. "cpu:AVX512"
        return ""
    try:
        address = parse_url(service_url)
    except ValueError:
        return ""
    return channel_path(address.path) if address.scheme == "unix" else ""


@dataclass(frozen=True, slots=True)
class DiskRead:
    """Read chunk ``key`` (chunk ``index`` of its load job) and put its blocks
    ``[first, first + len(block_ids))`` into ``block_ids``."""

    index: int
    key: bytes
    first: int
    block_ids: list[int]


def direct_reads(job: LoadJob, rank: int) -> list[DiskRead] | None:
    """The file reads of an async load whose every chunk is this rank's CPU-tier slot or a disk
    hit; None when a chunk must be staged (a Redis hit, or a plan without chunk keys)."""
    reads = []
    for i, chunk in enumerate(job.chunks):
        if chunk.slot_of(rank) is not None:
            continue  # copied from the arena, as a CPU-tier hit
        if chunk.tier != Tier.DISK or not chunk.key:
            return None
        reads.append(DiskRead(i, chunk.key, chunk.first, chunk.block_ids))
    return reads


@dataclass(slots=True)
class DiskReadResult:
    """How a load's reads went: the chunks that failed, those of them whose file is corrupt, the
    chunks read whole, and their bytes."""

    failed: list[int] = field(default_factory=list)
    corrupt: list[bytes] = field(default_factory=list)
    read: list[bytes] = field(default_factory=list)
    nbytes: int = 0


# A load whose files the page cache still lacks this long after it was opened fails its remaining
# chunks (recomputed) rather than keep its request waiting on a disk that does not answer.
READ_DEADLINE_S = 5.0
# Opening runs on vLLM's worker thread: a channel that fails (or does not answer within
# CHANNEL_TIMEOUT_S) is left alone this long, the service reading disk hits meanwhile, so a frozen
# service costs one bounded wait, not one per load.
CHANNEL_TIMEOUT_S = 1.0
CHANNEL_RETRY_S = 30.0


def _run_here(tasks: Sequence[Callable[[], None]]) -> None:
    for task in tasks:
        task()


class _Rows:
    """One plane's block rows as slices of one flat memoryview (cheaper than a numpy row each)."""

    __slots__ = ("_blocks", "_flat", "_row", "_stride")

    def __init__(self, plane: np.ndarray) -> None:
        blocks, row = plane.shape
        stride = int(plane.strides[0])
        span = (blocks - 1) * stride + row
        self._flat: memoryview = np.lib.stride_tricks.as_strided(plane, shape=(span,), strides=(1,)).data
        self._blocks, self._row, self._stride = int(blocks), int(row), stride

    def row(self, block: int) -> memoryview:
        """The bytes of block's row (IndexError for a block outside the plane)."""
        if not 0 <= block < self._blocks:
            raise IndexError(f"block {block} is outside the KV cache of {self._blocks} blocks")
        start = block * self._stride
        return self._flat[start : start + self._row]


@dataclass(slots=True)
class _ChunkFile:
    """One chunk's open file and the buffers (header, then payload rows) still to fill from it."""

    read: DiskRead
    fd: int
    head: memoryview
    parts: list[memoryview]
    pending: list[memoryview]
    offset: int = 0  # file offset of pending[0]


class DiskLoad:
    """One load's chunk files, read into place poll by poll on the worker thread (see the module
    docstring); owns the descriptors until every chunk is read or failed, or close()."""

    def __init__(self, reader: DiskReader, files: list[_ChunkFile]) -> None:
        self._reader = reader
        self._files = files
        self._opened = time.monotonic()
        self.result = DiskReadResult()

    def advance(self, now: float | None = None) -> bool:
        """Read what the page cache holds of the remaining chunks (split with the copy thread);
        True once every chunk is read and checked, or failed (damaged, unreadable, or past
        READ_DEADLINE_S)."""
        outcomes = [""] * len(self._files)

        def one(i: int, chunk: _ChunkFile) -> None:
            outcomes[i] = self._reader.step(chunk)

        self._reader.run_all([functools.partial(one, i, c) for i, c in enumerate(self._files)])
        left = []
        for chunk, outcome in zip(self._files, outcomes, strict=True):
            if outcome == "left":
                left.append(chunk)
            else:
                self._record(chunk, outcome)
        self._files = left
        if left and (now or time.monotonic()) - self._opened > READ_DEADLINE_S:
            log.warning("kvtier: %d disk chunks not read in %.0f s: recomputed", len(left), READ_DEADLINE_S)
            for chunk in left:
                self._record(chunk, "failed")
            self._files = []
        return not self._files

    def _record(self, chunk: _ChunkFile, outcome: str) -> None:
        """Close a chunk's file and count how its read ended: "read", "corrupt" or "failed"."""
        os.close(chunk.fd)
        if outcome == "read":
            self.result.read.append(chunk.read.key)
            self.result.nbytes += self._reader.chunk_bytes
            return
        self.result.failed.append(chunk.read.index)
        if outcome == "corrupt":
            self.result.corrupt.append(chunk.read.key)

    def close(self) -> None:
        """Close the descriptors of chunks not read yet (the load is abandoned)."""
        close_all([c.fd for c in self._files])
        self._files = []


class DiskReader:
    """Opens loads' chunk files over the file channel and reads them into the KV cache's planes."""

    def __init__(
        self,
        files: FileClient,
        namespace: str,
        planes: Sequence[Sequence[np.ndarray]],
        blocks_per_chunk: int,
        run_all: Callable[[Sequence[Callable[[], None]]], None] = _run_here,
    ) -> None:
        self._files = files
        self.namespace = namespace
        self._planes = [[_Rows(p) for p in layer] for layer in planes]
        self._bpc = blocks_per_chunk
        self._row_bytes = [int(p.shape[1]) for p in planes[0]]
        self.chunk_bytes = len(planes) * blocks_per_chunk * sum(self._row_bytes)
        self.run_all = run_all
        self._flags = os.RWF_NOWAIT  # 0 once the disk's filesystem is seen not to take it
        self._retry_at = 0.0  # monotonic time before which the channel is not asked (it failed)

    def open(self, reads: list[DiskRead]) -> DiskLoad | None:
        """The load of these chunks, its files asked to be read ahead; None when a file is not
        there (nothing was read). FileChannelError when the channel cannot answer."""
        now = time.monotonic()
        if now < self._retry_at:
            raise FileChannelError(f"file channel {self._files.path} failed recently; retried later")
        try:
            fds = self._files.open(self.namespace, [r.key for r in reads])
        except FileChannelError:
            self._retry_at = now + CHANNEL_RETRY_S
            raise
        if None in fds:
            close_all(fds)
            return None
        files = []
        for read, fd in zip(reads, fds, strict=True):
            assert fd is not None
            with contextlib.suppress(OSError):  # only a hint: the reads work without it
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            head = memoryview(bytearray(codec.header_size(ChunkKey(self.namespace, read.key))))
            parts = self._parts(read)
            files.append(_ChunkFile(read, fd, head, parts, [head, *parts]))
        return DiskLoad(self, files)

    def step(self, chunk: _ChunkFile) -> str:
        """Read what the page cache holds of one chunk: "left" when some is still to come, else
        the chunk checked: "read", "corrupt" or "failed" (an I/O error)."""
        try:
            if not self.fill(chunk):
                return "left"
            self.verify(chunk)
        except BlobError as exc:
            log.warning("kvtier: disk chunk %s is bad: %s", chunk.read.key.hex(), exc)
            return "corrupt"
        except OSError as exc:
            log.warning("kvtier: reading disk chunk %s failed: %s", chunk.read.key.hex(), exc)
            return "failed"
        except Exception as exc:  # a bug must cost a recompute, not vLLM's worker
            faults.caught(exc, "a disk read")
            return "failed"
        return "read"

    def fill(self, chunk: _ChunkFile) -> bool:
        """Read into the chunk's buffers what can be had without waiting for the disk; True when
        nothing is left to read (every buffer filled, or the file ended early)."""
        while chunk.pending:
            batch = chunk.pending[:IOV_MAX]
            flags = self._flags  # once: the other thread of a load may clear it meanwhile
            try:
                n = os.preadv(chunk.fd, batch, chunk.offset, flags)
            except BlockingIOError:
                return False  # the rest is not in the page cache yet
            except OSError as exc:
                if exc.errno != errno.EOPNOTSUPP or not flags:
                    raise
                self._flags = 0  # this filesystem (e.g. tmpfs) cannot say "not cached": read and wait
                continue
            if n <= 0:
                return True  # end of file: verify() finds it short
            chunk.offset += n
            taken = 0
            while taken < len(batch) and n >= batch[taken].nbytes:
                n -= batch[taken].nbytes
                taken += 1
            del chunk.pending[:taken]
            if n:
                chunk.pending[0] = chunk.pending[0][n:]
        return True

    def verify(self, chunk: _ChunkFile) -> None:
        """BlobError unless the chunk's header is its key's and its payload rows match the checksum."""
        header = codec.parse_header(
            chunk.head[: min(chunk.offset, chunk.head.nbytes)], ChunkKey(self.namespace, chunk.read.key)
        )
        if header.payload_len != self.chunk_bytes:
            raise BlobError(f"stored payload is {header.payload_len} bytes, a chunk is {self.chunk_bytes}")
        expected = chunk.head.nbytes + self.chunk_bytes
        if chunk.offset != expected:
            raise BlobError(f"file has {chunk.offset} of {expected} bytes")
        hasher = codec.PayloadHasher()
        for part in chunk.parts:
            hasher.update(part)
        if hasher.intdigest() != header.checksum:
            raise BlobError("payload checksum mismatch")

    def _parts(self, read: DiskRead) -> list[memoryview]:
        """The payload's rows in order: layer by layer, block by block, plane by plane; rows of a
        block the load skips go to scratch."""
        last = read.first + len(read.block_ids)
        skipped = self._bpc - len(read.block_ids)
        page = sum(self._row_bytes)
        scratch = memoryview(bytearray(skipped * len(self._planes) * page)) if skipped else None
        used = 0
        parts: list[memoryview] = []
        for layer in self._planes:
            for j in range(self._bpc):
                if read.first <= j < last:
                    block = read.block_ids[j - read.first]
                    parts.extend(rows.row(block) for rows in layer)
                    continue
                assert scratch is not None
                for size in self._row_bytes:
                    parts.append(scratch[used : used + size])
                    used += size
        return parts

    def close(self) -> None:
        """Close the file channel."""
        self._files.close()
