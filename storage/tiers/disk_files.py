"""The disk tier's files: the system calls, and the blob files they write and read, on I/O threads.

Who owns what: ``BlobFiles`` holds no state the event loop reads; its methods run on the disk tier's
I/O threads and report by return value or exception. The tier (``storage.tiers.disk``) keeps the index.
Design: docs/internals.md#disk-tier-diskpy-disk_filespy-disk_indexpy
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from kvtier.runtime.handoff import Handoff, TwoEnds, companion
from kvtier.storage import codec
from kvtier.storage.base import BlobError, BlobFormatError, ChunkKey
from kvtier.storage.keys import disk_relpath, parse_disk_relpath
from kvtier.storage.tiers.disk_index import ScanBatch

TEMP_PREFIX = ".tmp-"
PrefixOf = Callable[[str], bytes]  # a namespace's compact-key prefix (disk_index.NamespaceIds.prefix)


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
    """What the index's load found under disk_path (corrupt and outdated files: found, then removed)."""

    chunks: int = 0
    bytes: int = 0
    temp_removed: int = 0
    foreign_skipped: int = 0
    corrupt_removed: int = 0
    outdated_removed: int = 0  # chunks of another storage format (kvtier upgraded or downgraded)
    unreadable_skipped: int = 0

    def add(self, other: ScanReport) -> None:
        """Add other's counts to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


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


class BlobFiles:
    """The chunk files under one root directory: scan, write, read, remove (run on I/O threads)."""

    def __init__(self, root: str, io: DiskIO, fsync: bool) -> None:
        self.root = root
        self._prefix = os.path.join(root, "")  # root plus one separator, joined once
        self.io = io
        self.fsync = fsync
        self._preallocate = True  # until the filesystem says it cannot
        self._temp_tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._own_temp = f"{TEMP_PREFIX}{self._temp_tag}-"
        self._temp_seq = itertools.count()

    def path_of(self, key: ChunkKey) -> str:
        """Absolute file path of key."""
        return self._prefix + disk_relpath(key)

    def scan_plan(self, prefix_of: PrefixOf) -> tuple[list[str], ScanBatch, ScanReport]:
        """The directories to scan one at a time (``root/namespace/fan``, see ``scan_unit``), and what
        lies in the two levels above them."""
        units: list[str] = []
        batch, report = ScanBatch(), ScanReport()
        for top in os.scandir(self.root):
            if not top.is_dir(follow_symlinks=False):
                self._scan_file(top.path, top.name, prefix_of, batch, report)
                continue
            for sub in os.scandir(top.path):
                if sub.is_dir(follow_symlinks=False):
                    units.append(sub.path)
                else:
                    self._scan_file(sub.path, sub.name, prefix_of, batch, report)
        return units, batch, report

    def scan_unit(self, directory: str, prefix_of: PrefixOf) -> tuple[ScanBatch, ScanReport]:
        """Every chunk file under directory (compact key, size, mtime), with the corrupt and
        older-format files to remove; removes the temp files of writes that never finished."""
        batch, report = ScanBatch(), ScanReport()
        for dirpath, _dirs, names in os.walk(directory):
            for name in names:
                self._scan_file(os.path.join(dirpath, name), name, prefix_of, batch, report)
        return batch, report

    def _scan_file(
        self, path: str, name: str, prefix_of: PrefixOf, batch: ScanBatch, report: ScanReport
    ) -> None:
        """Sort one file found by the scan into batch and report."""
        if name.startswith(TEMP_PREFIX):
            # Left by a write that never finished (crash): never valid, safe to remove. This
            # process's own belong to writes in flight.
            if not name.startswith(self._own_temp):
                report.temp_removed += self.unlink_quiet([path])
            return
        key = parse_disk_relpath(path[len(self._prefix) :].replace(os.sep, "/"))
        if key is None:
            report.foreign_skipped += 1  # not ours: leave it alone
            return
        compact = prefix_of(key.namespace) + key.prefix_hash
        try:
            size, mtime, covered = self.check_file(path, key)
        except BlobFormatError:
            # No namespace of this build names it: unindexed, it would hold disk_size's space.
            report.outdated_removed += 1
            batch.bad.append(compact)
            return
        except BlobError:
            report.corrupt_removed += 1
            batch.bad.append(compact)
            return
        except FileNotFoundError:
            return  # removed since it was listed (a delete or an eviction): nothing to index
        except OSError:
            report.unreadable_skipped += 1  # an I/O error is not proof of rot: keep the file
            return
        batch.keys.append(compact)
        batch.sizes.append(size)
        batch.mtimes.append(mtime)
        batch.covered.append(covered)
        report.chunks += 1
        report.bytes += size

    def check_file(self, path: str, key: ChunkKey) -> tuple[int, float, Sequence[bytes]]:
        """Validate the header, length and trailer of one file (the payload is verified on every
        read); returns its size, mtime and the block hashes its trailer names."""
        fd = self.io.open_read(path)
        try:
            buf = bytearray(codec.header_size(key))
            got = self._read_vec(fd, [memoryview(buf)], 0)
            header = codec.parse_header(memoryview(buf)[:got], key)
            st = self.io.stat(fd)
            if st.st_size != header.blob_size:
                raise BlobError(f"file is {st.st_size} bytes, header says {header.blob_size}")
            trailer = bytearray(header.trailer_len)
            at = header.size + header.payload_len
            if self._read_vec(fd, [memoryview(trailer)], at) != header.trailer_len:
                raise BlobError("the file ends inside its trailer")
            return st.st_size, st.st_mtime, codec.decode_trailer(trailer)
        finally:
            self.io.close(fd)

    def unlink_quiet(self, paths: list[str]) -> int:
        """Remove these files, ignoring failures; returns how many were removed."""
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

    def write(self, key: ChunkKey, payload: memoryview, evict: list[str], trailer: bytes = b"") -> None:
        """Remove the evicted files, then write key's blob (with the trailer codec.encode_trailer
        made, if any) to a temp file and rename it into place."""
        self.unlink_quiet(evict)
        final = self.path_of(key)
        directory = final.rpartition(os.sep)[0]
        # Unique per process and write (O_EXCL catches the impossible clash), and cheaper than uuid4.
        temp = os.path.join(directory, f"{TEMP_PREFIX}{self._temp_tag}-{next(self._temp_seq)}")
        try:
            fd = self.io.open_excl(temp)
        except FileNotFoundError:  # first chunk in this fan-out directory: create it, once
            self.io.makedirs(directory)
            fd = self.io.open_excl(temp)
        try:
            try:
                # One extent allocation for the whole file instead of ext4 reserving delayed-allocation
                # space page by page: faster (docs/performance.md), and a full disk fails before any
                # byte is copied.
                size = codec.header_size(key) + payload.nbytes + len(trailer)
                if self._preallocate and not self.io.preallocate(fd, size):
                    self._preallocate = False
                self._write_blob(fd, key, payload, trailer)
                if self.fsync:
                    self.io.fsync(fd)
            finally:
                self.io.close(fd)
            self.io.replace(temp, final)
        except BaseException:
            self.unlink_quiet([temp])
            raise
        if self.fsync:
            self.io.fsync_dir(directory)

    def _write_blob(self, fd: int, key: ChunkKey, payload: memoryview, trailer: bytes) -> None:
        """Write a blank header, the payload and the trailer while the companion hashes the payload,
        then the real header."""
        digest = Handoff(codec.checksum, payload).offer(companion(payload.nbytes))
        try:
            self._write_all(fd, [memoryview(bytes(codec.header_size(key))), payload, memoryview(trailer)])
            header = codec.encode_header(
                key, payload, digest.result(), len(trailer), codec.is_described(trailer)
            )
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

    def read(self, key: ChunkKey, dest: memoryview) -> None:
        """Read key's payload into dest and verify its checksum; raises on a miss or a bad file."""
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
        got = self._read_vec(fd, [head, dest[:end]], 0)
        header = codec.parse_header(head[: min(got, hsize)], key)
        self._check_length(fd, header, dest)
        if got != hsize + end:
            raise BlobError(f"file has {got} of {header.blob_size} bytes")
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
        got = self._read_vec(fd, [dest[start:end]], hsize + start)
        if got != end - start:  # truncated since the length was checked
            raise BlobError(f"file has {hsize + start + got} of {hsize + dest.nbytes} bytes")

    def _check_length(self, fd: int, header: codec.BlobHeader, dest: memoryview) -> None:
        """The file's size must be the header's (payload and trailer: a longer or shorter file is rot);
        a valid blob whose payload length is not the buffer's is a caller's mismatch."""
        size = self.io.stat(fd).st_size
        if size != header.blob_size:
            raise BlobError(f"file is {size} bytes, header says {header.blob_size}")
        if header.payload_len != dest.nbytes:
            raise LengthMismatchError(
                f"stored payload is {header.payload_len} bytes, buffer is {dest.nbytes}"
            )

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
