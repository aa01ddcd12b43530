"""The worker's own disk reads: chunk files land row by row in the KV blocks, checked; damage and
missing files are told apart; which loads qualify."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier.app.file_channel import FileChannelError, FileClient, FileServer, channel_path
from kvtier.connector.disk_reads import (
    CHANNEL_RETRY_S,
    READ_DEADLINE_S,
    DiskRead,
    DiskReader,
    DiskReadResult,
    direct_reads,
    file_channel_of,
)
from kvtier.connector.metadata import ChunkLoad, LoadJob
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.keys import disk_relpath
from tests.app import wait_until

NS = "00112233445566ff"
LAYERS, BLOCKS, BPC = 3, 8, 2
ROWS = (96, 160)  # two planes a page (as where K and V lie apart), of unequal sizes
PAGE = sum(ROWS)
CHUNK_BYTES = LAYERS * BPC * PAGE


def _payload(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes()


def _rows(payload: bytes, layer: int, j: int) -> list[bytes]:
    """The rows of slot block j of one layer, plane by plane, in a payload."""
    start = (layer * BPC + j) * PAGE
    return [payload[start : start + ROWS[0]], payload[start + ROWS[0] : start + PAGE]]


class Disk:
    """Chunk files under a root, served over a file channel, read into a KV cache of planes."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "disk"
        prefix = str(self.root) + "/"
        self.server = FileServer(channel_path(str(tmp_path / "s.sock")), lambda k: prefix + disk_relpath(k))
        # Each layer's planes: [num_blocks, row] views of one buffer, strided as vLLM's would be.
        self.kv = [np.zeros((BLOCKS, PAGE), dtype=np.uint8) for _ in range(LAYERS)]
        planes = [[kv[:, : ROWS[0]], kv[:, ROWS[0] :]] for kv in self.kv]
        self.reader = DiskReader(FileClient(self.server.path), NS, planes, BPC)

    def path(self, h: bytes) -> Path:
        return self.root / disk_relpath(ChunkKey(NS, h))

    def store(self, h: bytes, payload: bytes) -> None:
        path = self.path(h)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(codec.encode(ChunkKey(NS, h), payload, [b"block-hash"]))

    def block(self, layer: int, block: int) -> list[bytes]:
        row = self.kv[layer][block].tobytes()
        return [row[: ROWS[0]], row[ROWS[0] :]]

    def close(self) -> None:
        self.reader.close()
        self.server.close()


def _read(disk: Disk, reads: list[DiskRead]) -> DiskReadResult:
    """Open a load and poll it until it ends (the page cache holds the files: the first poll)."""
    load = disk.reader.open(reads)
    assert load is not None
    assert wait_until(load.advance, 10)
    return load.result


def _read_on_two_threads(disk: Disk, reads: list[DiskRead]) -> DiskReadResult:
    """_read with the load's chunks split between this thread and another, both started together."""
    barrier = threading.Barrier(2)

    def run_all(tasks: Sequence[Callable[[], None]]) -> None:
        def gated(task: Callable[[], None]) -> None:
            barrier.wait(10)
            task()

        other = threading.Thread(target=lambda: [gated(t) for t in tasks[1::2]])
        other.start()
        for task in tasks[::2]:
            gated(task)
        other.join(10)
        assert not other.is_alive()

    plain, disk.reader.run_all = disk.reader.run_all, run_all
    try:
        return _read(disk, reads)
    finally:
        disk.reader.run_all = plain


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    d = Disk(tmp_path)
    yield d
    d.close()


def test_chunks_land_row_by_row_in_scattered_blocks(disk: Disk) -> None:
    a, b = _payload(1), _payload(2)
    disk.store(b"\xaa", a)
    disk.store(b"\xbb", b)
    result = _read(disk, [DiskRead(0, b"\xaa", 0, [5, 2]), DiskRead(3, b"\xbb", 0, [7, 0])])
    assert (result.failed, result.read) == ([], [b"\xaa", b"\xbb"])
    assert result.nbytes == 2 * CHUNK_BYTES
    for layer in range(LAYERS):
        for j, (in_a, in_b) in enumerate([(5, 7), (2, 0)]):
            assert disk.block(layer, in_a) == _rows(a, layer, j)
            assert disk.block(layer, in_b) == _rows(b, layer, j)
        assert not disk.kv[layer][[1, 3, 4, 6]].any()  # no other block touched


def test_a_partial_load_writes_only_its_blocks_and_still_checks_the_whole_chunk(disk: Disk) -> None:
    a = _payload(3)
    disk.store(b"\xaa", a)
    result = _read(disk, [DiskRead(0, b"\xaa", 1, [4])])  # vLLM holds block 0
    assert result.read == [b"\xaa"] and not result.failed
    for layer in range(LAYERS):
        assert disk.block(layer, 4) == _rows(a, layer, 1)
        assert not np.delete(disk.kv[layer], 4, axis=0).any()
    # A flip in the skipped block's rows is found as well: they are read and hashed, not used.
    data = bytearray(disk.path(b"\xaa").read_bytes())
    data[codec.header_size(ChunkKey(NS, b"\xaa")) + 3] ^= 1  # layer 0, slot block 0
    disk.path(b"\xaa").write_bytes(bytes(data))
    result = _read(disk, [DiskRead(0, b"\xaa", 1, [4])])
    assert (result.failed, result.corrupt, result.read) == ([0], [b"\xaa"], [])


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - CHUNK_BYTES // 2)


def _flip(offset: int):
    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x10
        path.write_bytes(bytes(data))

    return flip


@pytest.mark.parametrize(
    ("damage", "bad"),
    [
        (_truncate, True),
        (_flip(13), True),  # the header
        (_flip(-CHUNK_BYTES // 3), True),  # the payload
        (_flip(-5), False),  # the trailer (block hashes for the disk scan): not what a load reads
    ],
)
def test_damage_fails_its_chunk_only(disk: Disk, damage, bad: bool) -> None:
    a, b = _payload(4), _payload(5)
    disk.store(b"\xaa", a)
    disk.store(b"\xbb", b)
    damage(disk.path(b"\xaa"))
    result = _read(disk, [DiskRead(0, b"\xaa", 0, [0, 1]), DiskRead(1, b"\xbb", 0, [2, 3])])
    if not bad:
        assert result.read == [b"\xaa", b"\xbb"] and not result.failed
        return
    assert (result.failed, result.corrupt, result.read) == ([0], [b"\xaa"], [b"\xbb"])
    assert result.nbytes == CHUNK_BYTES
    assert disk.block(0, 2) == _rows(b, 0, 0)


def test_a_missing_file_reads_nothing(disk: Disk) -> None:
    disk.store(b"\xaa", _payload(6))
    assert disk.reader.open([DiskRead(0, b"\xaa", 0, [0, 1]), DiskRead(1, b"\xbb", 0, [2, 3])]) is None
    assert not any(kv.any() for kv in disk.kv)


def test_a_channel_that_fails_is_an_error_by_name_and_left_alone_a_while(
    disk: Disk, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk.server.close()
    with pytest.raises(FileChannelError, match="No such file"):
        disk.reader.open([DiskRead(0, b"\xaa", 0, [0, 1])])
    disk.server = FileServer(disk.server.path, lambda k: f"{disk.root}/{disk_relpath(k)}")
    disk.store(b"\xaa", _payload(12))
    with pytest.raises(FileChannelError, match="failed recently"):  # not asked: no wait on vLLM's thread
        disk.reader.open([DiskRead(0, b"\xaa", 0, [0, 1])])
    later = time.monotonic() + CHANNEL_RETRY_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert _read(disk, [DiskRead(0, b"\xaa", 0, [0, 1])]).read == [b"\xaa"]


def test_files_not_in_the_page_cache_are_read_as_they_arrive(disk: Disk) -> None:
    a = _payload(7)
    disk.store(b"\xaa", a)
    fd = os.open(disk.path(b"\xaa"), os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the load asks for it to be read ahead
    os.close(fd)
    result = _read(disk, [DiskRead(0, b"\xaa", 0, [6, 7])])
    assert result.read == [b"\xaa"] and disk.block(LAYERS - 1, 7) == _rows(a, LAYERS - 1, 1)


def test_a_filesystem_without_nowait_reads_are_read_and_waited_for(
    disk: Disk, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk.store(b"\xaa", _payload(8))
    disk.store(b"\xbb", _payload(13))
    plain = os.preadv
    flags_seen: list[int] = []
    refused: list[int] = []
    lock = threading.Lock()
    first_read_again = threading.Event()
    both_asked = threading.Barrier(2)

    def preadv(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        flags_seen.append(flags)
        if flags:
            both_asked.wait(10)  # each thread asks with the flag before either learns it fails
            with lock:
                refused.append(threading.get_ident())
                second = len(refused) == 2
            if second:  # refused only after the first thread has learnt it and read again
                assert first_read_again.wait(10)
            raise OSError(errno.EOPNOTSUPP, "not supported")
        first_read_again.set()
        return plain(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    two = [DiskRead(0, b"\xaa", 0, [0, 1]), DiskRead(1, b"\xbb", 0, [2, 3])]
    # Both chunks are read at once, on two threads as in vLLM: both meet the refusal.
    result = _read_on_two_threads(disk, two)
    assert (result.read, result.failed, len(refused)) == ([b"\xaa", b"\xbb"], [], 2)
    flags_seen.clear()
    assert _read(disk, [DiskRead(0, b"\xaa", 0, [0, 1])]).read == [b"\xaa"]
    assert flags_seen == [0]  # asked once


def test_a_load_the_disk_never_serves_fails_at_its_deadline(
    disk: Disk, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk.store(b"\xaa", _payload(9))
    disk.store(b"\xbb", _payload(10))
    load = disk.reader.open([DiskRead(0, b"\xaa", 0, [0, 1]), DiskRead(1, b"\xbb", 0, [2, 3])])
    assert load is not None
    monkeypatch.setattr(disk.reader, "fill", lambda chunk: False)  # never in the page cache
    assert not load.advance()
    assert load.advance(now=time.monotonic() + READ_DEADLINE_S + 1)
    assert (load.result.failed, load.result.corrupt, load.result.read) == ([0, 1], [], [])


def _target(fd: int) -> str | None:
    """The file descriptor fd of this process refers to, None once it is closed."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def test_an_abandoned_load_closes_its_files(disk: Disk) -> None:
    disk.store(b"\xaa", _payload(11))
    assert disk.reader.open([DiskRead(0, b"\xcc", 0, [0, 1])]) is None  # the channel is connected now
    load = disk.reader.open([DiskRead(0, b"\xaa", 0, [0, 1])])
    assert load is not None
    # The load's own descriptors (the file server's copies close on its thread, in their own time).
    fds = [chunk.fd for chunk in load._files]
    paths = {_target(fd) for fd in fds}
    assert len(fds) == 1 and len(paths) == 1 and str(next(iter(paths))).startswith(f"{disk.root}/")
    load.close()
    assert [_target(fd) for fd in fds if _target(fd) in paths] == []


def _job(*chunks: ChunkLoad) -> LoadJob:
    return LoadJob("r", "lease", list(chunks), is_async=True)


def test_which_loads_are_read_from_files() -> None:
    cpu = ChunkLoad(0, 0, [1, 2], slot=(0, 64), key=b"\x01", tier=Tier.CPU)
    on_disk = ChunkLoad(1, 1, [3], key=b"\x02", tier=Tier.DISK)
    assert direct_reads(_job(cpu, on_disk), rank=0) == [DiskRead(1, b"\x02", 1, [3])]
    assert direct_reads(_job(cpu), rank=0) == []  # nothing to read: copied from its slot
    # Rank 1 holds chunk 0 in a lower tier: no slot of its own, and a CPU-tier combined hit is
    # not a disk file to read.
    assert direct_reads(_job(cpu, on_disk), rank=1) is None
    redis = ChunkLoad(1, 0, [3], key=b"\x02", tier=Tier.REDIS)
    assert direct_reads(_job(cpu, redis), rank=0) is None
    assert direct_reads(_job(ChunkLoad(1, 0, [3], tier=Tier.DISK)), rank=0) is None  # no key


def test_which_engines_read_disk_files() -> None:
    layout = "LBHNC/cpu:AVX512/FullAttentionSpec"
    assert file_channel_of(True, "unix:///run/kvtier.sock", layout) == "/run/kvtier.sock.files"
    assert file_channel_of(False, "unix:///run/kvtier.sock", layout) == ""
    assert file_channel_of(True, "tcp://10.0.0.1:7000", layout) == ""
    assert file_channel_of(True, "unix:///run/kvtier.sock", "LBNHC/cuda/FullAttentionSpec") == ""
    assert file_channel_of(True, "bogus://x", layout) == ""
