"""Disk tier: restart keeps every chunk, faults are counted misses, LRU within disk_size skips pins."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvtier.runtime import handoff
from kvtier.runtime.handoff import Lane
from kvtier.storage import codec
from kvtier.storage.base import BlobError, BlobFormatError, ChunkKey, ClearableTier, LowerTier, Tier
from kvtier.storage.config import DiskConfig
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.disk_files import TEMP_PREFIX, DiskIO
from tests.support.skips import missing

ROOT = Path(__file__).resolve().parents[2]

NS = "00112233445566ff"
CHUNK = 4096
BLOB = codec.FIXED_HEADER_SIZE + len(NS) + 1 + 8 + CHUNK  # prefix hashes below are 8 bytes


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(8, "big"))


def payload(i: int, size: int = CHUNK) -> memoryview:
    return memoryview(bytes((i + j) % 251 for j in range(size)))


def settings(path: Path, size: int = 1 << 30, fsync: bool = False) -> DiskConfig:
    return DiskConfig(str(path), size, fsync)


async def started(path: Path, io: DiskIO | None = None, **kw: int | bool) -> DiskTier:
    """A started tier whose index has loaded (tests of the load itself: test_disk_index.py)."""
    tier = DiskTier(settings(path, **kw), io=io)  # type: ignore[arg-type]
    await tier.start()
    await asyncio.wait_for(tier.wait_loaded(), 30)
    assert tier.index_complete
    return tier


async def read(tier: DiskTier, i: int, size: int = CHUNK) -> bytes | None:
    dest = bytearray(size)
    return bytes(dest) if await tier.get_into(key(i), memoryview(dest)) else None


def files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def exists(path: str | Path) -> bool:
    return Path(path).exists()


def make_debris(root: Path, tier: DiskTier) -> Path:
    """What a crash or an operator might leave: a temp file, a foreign file, a bad header."""
    some_dir = tier.path_of(key(3)).rsplit("/", 1)[0]
    Path(some_dir, TEMP_PREFIX + "deadbeef").write_bytes(b"partial")
    (root / "README.txt").write_text("not a chunk")
    bad = Path(tier.path_of(key(99)))
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"garbage that is no blob header at all, long enough to parse" * 2)
    return bad


def flip_bit(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def damage(tier: DiskTier) -> None:
    """Key 0 deleted, key 1 truncated, key 2 a payload bit flipped, key 3 a header bit flipped."""
    Path(tier.path_of(key(0))).unlink()
    with open(tier.path_of(key(1)), "r+b") as f:
        f.truncate(BLOB - 10)
    flip_bit(tier.path_of(key(2)), BLOB - 100)
    flip_bit(tier.path_of(key(3)), 13)


async def test_round_trip_and_protocol(tmp_path: Path) -> None:
    tier = await started(tmp_path, fsync=True)
    assert isinstance(tier, LowerTier) and tier.tier is Tier.DISK
    assert await tier.put(key(1), payload(1))
    assert await tier.contains_many([key(1), key(2)]) == [True, False]
    assert await read(tier, 1) == bytes(payload(1))
    assert await read(tier, 2) is None
    stats = tier.stats()
    assert (stats.chunks, stats.bytes, stats.stores, stats.hits, stats.misses) == (1, BLOB, 1, 1, 1)
    assert stats.bytes_written == stats.bytes_read == CHUNK and not stats.errors
    assert [p.name for p in files(tmp_path)] == [key(1).prefix_hash.hex() + ".kvt"]
    await tier.close()


async def test_restart_finds_every_chunk_and_cleans_debris(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    assert all(await asyncio.gather(*(tier.put(key(i), payload(i)) for i in range(20))))
    await tier.close()
    bad = make_debris(tmp_path, tier)

    again = await started(tmp_path)
    assert await again.contains_many([key(i) for i in range(20)]) == [True] * 20
    for i in range(20):
        assert await read(again, i) == bytes(payload(i))
    report = again.last_scan
    assert (report.chunks, report.temp_removed, report.foreign_skipped, report.corrupt_removed) == (
        20, 1, 1, 1,
    )  # fmt: skip
    assert not exists(bad) and exists(tmp_path / "README.txt")
    errors = again.stats().errors
    assert errors == {"scan_temp": 1, "scan_foreign": 1, "corrupt": 1}
    assert again.stats().chunks == 20
    await again.close()


class FaultyIO(DiskIO):
    """Fails chosen system calls with a chosen errno; can also make writes short."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}
        self.short_writes = False
        self.no_preallocate = False  # act as a filesystem without fallocate
        self.preallocations = 0
        self.fail_reads_from: int | None = None  # file offset from which reads fail with EIO

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise OSError(self.fail[name], os.strerror(self.fail[name]))

    def writev(self, fd: int, buffers: Sequence[memoryview]) -> int:
        self._maybe_fail("writev")
        if self.short_writes:
            return os.write(fd, buffers[0][:7])
        return super().writev(fd, buffers)

    def open_excl(self, path: str) -> int:
        self._maybe_fail("open_excl")
        return super().open_excl(path)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self._maybe_fail("pwrite")
        return super().pwrite(fd, data, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.fail_reads_from is not None and offset >= self.fail_reads_from:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().preadv(fd, buffers, offset)

    def preallocate(self, fd: int, size: int) -> bool:
        self._maybe_fail("preallocate")
        self.preallocations += 1
        return not self.no_preallocate and super().preallocate(fd, size)

    def open_read(self, path: str) -> int:
        self._maybe_fail("open_read")
        return super().open_read(path)

    def makedirs(self, path: str) -> None:
        self._maybe_fail("makedirs")
        super().makedirs(path)


async def test_enospc_is_a_counted_failure_and_leaves_no_temp_file(tmp_path: Path) -> None:
    io = FaultyIO()
    tier = await started(tmp_path, io=io)
    io.fail["writev"] = errno.ENOSPC
    assert not await tier.put(key(1), payload(1))
    assert tier.stats().errors == {"enospc": 1}
    assert await tier.contains_many([key(1)]) == [False]
    assert files(tmp_path) == []
    assert tier.stats().bytes == 0  # the reservation was given back
    del io.fail["writev"]
    assert await tier.put(key(1), payload(1))
    await tier.close()


async def test_short_writes_are_completed(tmp_path: Path) -> None:
    io = FaultyIO()
    io.short_writes = True
    tier = await started(tmp_path, io=io)
    assert await tier.put(key(5), payload(5))
    assert await read(tier, 5) == bytes(payload(5))
    await tier.close()


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
async def test_read_only_filesystem_injected(tmp_path: Path, code: int) -> None:
    io = FaultyIO()
    tier = await started(tmp_path, io=io)
    io.fail["open_excl"] = code
    assert not await tier.put(key(1), payload(1))
    io.fail["open_read"] = code
    assert await read(tier, 1) is None
    assert tier.stats().errors == {errno.errorcode[code].lower(): 1}
    await tier.close()


async def _read_only_directory(path: Path) -> list[object]:
    """In a process that directory permissions bind: a put into read-only directories and a read."""
    tier = await started(path)
    stored = await tier.put(key(1), payload(1))
    folders = [folder for folder, _, _ in os.walk(path)]  # every one: key 2 goes beside key 1
    for folder in folders:
        os.chmod(folder, 0o555)
    try:
        refused = not await tier.put(key(2), payload(2))
        kept = await read(tier, 1) == bytes(payload(1))
        errors = tier.stats().errors
    finally:
        for folder in folders:
            os.chmod(folder, 0o755)
    await tier.close()
    return [stored, refused, kept, errors]


def test_read_only_directory(tmp_path: Path) -> None:
    # Root ignores directory permissions (CAP_DAC_OVERRIDE), and CI runs as root: the check runs in a
    # child process that has dropped the capabilities that override them (a setuid to nobody would
    # leave it unable to reach this Python, installed under /root).
    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            missing("util-linux setpriv is not installed (it drops root's capabilities for this check)")
        caps = "-dac_override,-dac_read_search"
        drop = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    code = (
        "import asyncio, json, sys; from pathlib import Path; "
        "from tests.storage_lower.test_disk_tier import _read_only_directory; "
        "print(json.dumps(asyncio.run(_read_only_directory(Path(sys.argv[1])))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [*drop, sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    stored, refused, kept, errors = json.loads(child.stdout.strip().splitlines()[-1])
    assert (stored, refused, kept) == (True, True, True)
    assert errors == {"eacces": 1}


async def test_unwritable_root_marks_unhealthy(tmp_path: Path) -> None:
    io = FaultyIO()
    io.fail["makedirs"] = errno.EACCES
    tier = await started(tmp_path / "sub", io=io)
    assert not tier.stats().healthy
    assert not await tier.put(key(1), payload(1))
    assert tier.stats().errors["eacces"] == 2
    await tier.close()


async def test_deleted_truncated_and_flipped_files_are_never_served(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    for i in range(4):
        assert await tier.put(key(i), payload(i))
    damage(tier)
    for i in range(4):
        assert await read(tier, i) is None
    stats = tier.stats()
    assert stats.errors == {"missing": 1, "corrupt": 3}
    assert (stats.hits, stats.misses, stats.chunks) == (0, 4, 0)
    assert await tier.contains_many([key(i) for i in range(4)]) == [False] * 4
    assert files(tmp_path) == []  # corrupt files were removed
    await tier.close()


async def test_reads_an_engine_made_itself_count_as_hits_and_corrupt_files_go(tmp_path: Path) -> None:
    tier = await started(tmp_path, size=3 * BLOB)
    for i in range(3):
        assert await tier.put(key(i), payload(i))
    # Read elsewhere (the file channel): chunk 0 good, chunk 2 corrupt. Chunk 0 is now marked used,
    # so the next put that needs room evicts chunk 1, unused.
    await tier.read_elsewhere([key(0)], CHUNK, [key(2)])
    stats = tier.stats()
    assert (stats.hits, stats.bytes_read, stats.misses, stats.errors) == (1, CHUNK, 1, {"corrupt": 1})
    assert not exists(tier.path_of(key(2)))
    assert await tier.put(key(3), payload(3)) and await tier.put(key(4), payload(4))
    assert await tier.contains_many([key(i) for i in range(5)]) == [True, False, False, True, True]
    await tier.close()


async def test_length_mismatch_is_counted_not_deleted(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    assert await tier.put(key(1), payload(1))
    assert await read(tier, 1, size=CHUNK - 1) is None
    assert tier.stats().errors == {"length_mismatch": 1}
    assert await read(tier, 1) == bytes(payload(1))
    await tier.close()


async def test_eviction_within_disk_size_skips_pinned_and_spares_used(tmp_path: Path) -> None:
    tier = await started(tmp_path, size=3 * BLOB)
    for i in range(3):
        assert await tier.put(key(i), payload(i))
    tier.pin([key(0)])
    assert await read(tier, 1)  # key 1 is now marked used, key 2 is not
    assert await tier.put(key(3), payload(3))  # evicts key 2 (unused, unpinned)
    assert await tier.contains_many([key(i) for i in range(4)]) == [True, True, False, True]
    assert await tier.put(key(4), payload(4))  # evicts key 1, its mark cleared as the hand passed
    assert await tier.contains_many([key(i) for i in range(5)]) == [True, False, False, True, True]
    stats = tier.stats()
    assert stats.evictions == 2 and stats.bytes == 3 * BLOB <= stats.capacity
    assert len(files(tmp_path)) == 3
    tier.pin([key(3), key(4)])
    assert not await tier.put(key(5), payload(5))  # everything pinned: no room
    assert tier.stats().errors == {"full": 1}
    tier.unpin([key(0), key(3), key(4)])
    assert await tier.put(key(5), payload(5))
    assert not await tier.put(key(6), payload(6, size=4 * BLOB))
    assert tier.stats().errors == {"full": 1, "too_large": 1}
    await tier.close()


async def test_restart_over_capacity_evicts_oldest(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    for i in range(4):
        assert await tier.put(key(i), payload(i))
        os.utime(tier.path_of(key(i)), (1000 + i, 1000 + i))
    await tier.close()
    small = await started(tmp_path, size=2 * BLOB)
    assert await small.contains_many([key(i) for i in range(4)]) == [False, False, True, True]
    assert len(files(tmp_path)) == 2
    await small.close()


async def test_delete_of_pinned_key_is_deferred_to_last_unpin(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    assert await tier.put(key(1), payload(1))
    tier.pin([key(1)])
    tier.pin([key(1)])
    await tier.delete(key(1))
    assert await tier.contains_many([key(1)]) == [False]
    assert await read(tier, 1) == bytes(payload(1))  # the lease can still stage it
    tier.unpin([key(1)])
    assert exists(tier.path_of(key(1)))
    tier.unpin([key(1)])
    await tier.close()  # waits for the deferred removal
    assert not exists(tier.path_of(key(1)))
    assert tier.stats().chunks == 0


async def test_delete_and_concurrent_puts_of_one_key(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    results = await asyncio.gather(*(tier.put(key(7), payload(7)) for _ in range(5)))
    assert all(results) and tier.stats().stores == 1
    await tier.delete(key(7))
    await tier.delete(key(7))  # idempotent
    assert files(tmp_path) == []
    assert tier.stats().bytes == 0
    await tier.close()


async def test_cancelled_put_still_indexes_its_file(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    task = asyncio.create_task(tier.put(key(8), payload(8, size=1 << 20)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await tier.contains_many([key(8)]) == [True]
    assert len(files(tmp_path)) == 1
    await tier.close()


async def test_clear_keeps_pinned_chunks(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    for i in range(5):
        assert await tier.put(key(i), payload(i))
    tier.pin([key(2)])
    assert isinstance(tier, ClearableTier)
    assert await tier.clear() == 4
    assert await tier.contains_many([key(i) for i in range(5)]) == [False, False, True, False, False]
    assert len(files(tmp_path)) == 1 and tier.stats().bytes == BLOB
    await tier.close()


async def test_calls_after_close_are_counted_failures(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    assert await tier.put(key(1), payload(1))
    await tier.close()
    assert not await tier.put(key(2), payload(2))
    assert await read(tier, 1) is None
    assert tier.stats().errors == {"runtimeerror": 2}
    assert tier.stats().bytes == BLOB  # the refused write reserved nothing


async def test_preallocation_full_disk_and_filesystems_without_it(tmp_path: Path) -> None:
    io = FaultyIO()
    tier = await started(tmp_path, io=io)
    io.fail["preallocate"] = errno.ENOSPC  # a full disk is found before any byte is copied
    assert not await tier.put(key(1), payload(1))
    assert tier.stats().errors == {"enospc": 1} and files(tmp_path) == []
    del io.fail["preallocate"]
    io.no_preallocate = True
    assert await tier.put(key(1), payload(1))  # no fallocate: plain writes, and no more asking
    assert await tier.put(key(2), payload(2))
    assert io.preallocations == 1
    assert [await read(tier, i) for i in (1, 2)] == [bytes(payload(1)), bytes(payload(2))]
    await tier.close()


def test_preallocate_sizes_the_file(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not DiskIO().preallocate(fd, 3 * 4096 + 5):
            missing(f"the filesystem of {tmp_path} has no fallocate")
        assert os.fstat(fd).st_size == 3 * 4096 + 5
    finally:
        os.close(fd)


def rewrite_as_version(path: Path, version: int) -> bytes:
    """Make path's blob one that a kvtier of another format version wrote (header checksum redone)."""
    import struct

    import xxhash

    blob = path.read_bytes()
    fixed = bytearray(blob[:28])
    struct.pack_into("<H", fixed, 4, version)
    echo_len = struct.unpack_from("<I", fixed, 8)[0]
    echo = blob[36 : 36 + echo_len]
    blob = bytes(fixed) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(fixed) + echo)) + blob[36:]
    path.write_bytes(blob)
    return blob


async def test_restart_removes_chunks_of_another_format_as_outdated_not_corrupt(tmp_path: Path) -> None:
    tier = await started(tmp_path)
    for i in range(3):
        assert await tier.put(key(i), payload(i))
    await tier.close()
    old = Path(tier.path_of(key(1)))
    with pytest.raises(BlobError) as raised:
        codec.parse_header(rewrite_as_version(old, 1), key(1))
    assert type(raised.value) is BlobFormatError  # intact header, other version: not rot

    again = await started(tmp_path)
    report = again.last_scan
    assert (report.chunks, report.outdated_removed, report.corrupt_removed) == (2, 1, 0)
    assert again.stats().errors == {"scan_outdated": 1}
    assert not exists(old) and again.stats().bytes == 2 * BLOB  # its space is not held unaccounted
    assert await read(again, 0) == bytes(payload(0)) and await read(again, 1) is None
    await again.close()


# ------------------------------------------------------------------------------ segmented reads
# With 4 KiB checksum segments a payload of a few KiB takes the same path as a chunk of megabytes: the
# worker reads and checksums segments from the front (the first with the header) while its companion
# does the same from the back. The format's segment size is patched for writer and reader alike.
SEG = 4096
ODD = 5 * SEG + 123  # six segments, the last one short
HEADER = BLOB - CHUNK


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "SEGMENT", SEG)
    monkeypatch.setattr(handoff, "COMPANION_MIN_BYTES", 2 * SEG)  # scaled down with the segments


async def segmented(path: Path, io: DiskIO | None = None) -> DiskTier:
    assert codec.SEGMENT == SEG
    return await started(path, io=io)


def decoded(tier: DiskTier, i: int) -> bytes:
    """The payload of key i's file, decoded apart from the tier (header and checksum verified)."""
    return bytes(codec.decode(Path(tier.path_of(key(i))).read_bytes(), key(i)))


class PolicyIO(DiskIO):
    """Records the scheduling policy of the thread that writes and of the one that reads."""

    def __init__(self) -> None:
        self.writes: set[int] = set()
        self.reads: set[int] = set()

    def writev(self, fd: int, buffers: Sequence[memoryview]) -> int:
        self.writes.add(os.sched_getscheduler(0))
        return super().writev(fd, buffers)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self.reads.add(os.sched_getscheduler(0))
        return super().preadv(fd, buffers, offset)


async def test_writes_take_only_idle_cpu_time_and_reads_keep_their_priority(tmp_path: Path) -> None:
    # Nobody waits for a write (write-behind), while a hit's load is on its request's path.
    io = PolicyIO()
    tier = await started(tmp_path, io=io)
    assert await tier.put(key(1), payload(1))
    assert await read(tier, 1) == bytes(payload(1))
    assert (io.writes, io.reads) == ({os.SCHED_IDLE}, {os.SCHED_OTHER})
    await tier.close()


@pytest.mark.usefixtures("small_segments")
async def test_only_chunks_from_the_threshold_up_are_shared_with_the_companion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offered: list[object] = []
    real_put = Lane.put

    def put(lane: Lane, fn: Callable[..., object], *args: object) -> None:
        offered.append(fn)
        real_put(lane, fn, *args)

    monkeypatch.setattr(Lane, "put", put)
    tier = await segmented(tmp_path)
    tier._threads.cores = tier._writers.cores = 8  # a core is always spare: only the chunk's size decides
    small, big = 2 * SEG - 1, ODD
    assert await tier.put(key(1), payload(1, small))
    assert await read(tier, 1, small) == bytes(payload(1, small))
    assert offered == []
    assert await tier.put(key(2), payload(2, big))
    assert await read(tier, 2, big) == bytes(payload(2, big))
    assert len(offered) == 2  # the put's checksum, then the get's segments from the back
    assert tier.stats().errors == {}
    await tier.close()


@pytest.mark.usefixtures("small_segments")
async def test_segmented_round_trip_with_and_without_companion(tmp_path: Path) -> None:
    tier = await segmented(tmp_path)
    for i in range(3):
        assert await tier.put(key(i), payload(i, ODD))
    for i in range(3):
        assert await read(tier, i, ODD) == bytes(payload(i, ODD))  # in an I/O thread: companion
    dest = bytearray(ODD)
    tier.files.read(key(1), memoryview(dest))  # not on an I/O thread: the caller reads it all
    assert dest == bytes(payload(1, ODD))
    assert decoded(tier, 2) == bytes(payload(2, ODD))  # the checksum came from the put's companion
    assert tier.stats().errors == {}
    await tier.close()


@pytest.mark.usefixtures("small_segments")
async def test_segmented_empty_and_one_segment_payloads(tmp_path: Path) -> None:
    tier = await segmented(tmp_path)
    for i, size in enumerate((0, 1, SEG, SEG + 1, 2 * SEG)):
        assert await tier.put(key(i), payload(i, size))
        assert await read(tier, i, size) == bytes(payload(i, size))
    await tier.close()


def cut(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def grow(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


@pytest.mark.usefixtures("small_segments")
async def test_segmented_damage_anywhere_is_a_counted_miss(tmp_path: Path) -> None:
    tier = await segmented(tmp_path)
    damages = [
        lambda p: flip_bit(p, HEADER + ODD - 1),  # last byte: the short last segment
        lambda p: flip_bit(p, HEADER),  # first byte: the segment read with the header
        lambda p: flip_bit(p, HEADER + 3 * SEG - 1),  # last byte of a middle segment
        lambda p: flip_bit(p, HEADER + 3 * SEG),  # first byte of the next one
        lambda p: cut(p, HEADER + ODD - 100),  # truncated in the last segment
        lambda p: cut(p, HEADER + SEG + 100),  # truncated in the second segment
        lambda p: cut(p, HEADER + 5 * SEG),  # truncated at a segment boundary
        grow,  # a byte past the end
    ]
    for i, damage_file in enumerate(damages):
        assert await tier.put(key(i), payload(i, ODD))
        damage_file(tier.path_of(key(i)))
    for i in range(len(damages)):
        assert await read(tier, i, ODD) is None
    stats = tier.stats()
    assert stats.errors == {"corrupt": len(damages)} and stats.misses == len(damages)
    assert files(tmp_path) == []  # corrupt files are removed
    await tier.close()


@pytest.mark.usefixtures("small_segments")
async def test_segmented_length_mismatch_is_not_corruption(tmp_path: Path) -> None:
    tier = await segmented(tmp_path)
    assert await tier.put(key(1), payload(1, ODD))
    assert await read(tier, 1, ODD - 1) is None
    assert tier.stats().errors == {"length_mismatch": 1}
    assert await read(tier, 1, ODD) == bytes(payload(1, ODD))
    await tier.close()


@pytest.mark.usefixtures("small_segments")
async def test_read_error_in_a_later_segment_is_counted_and_keeps_the_file(tmp_path: Path) -> None:
    io = FaultyIO()
    tier = await segmented(tmp_path, io=io)
    assert await tier.put(key(1), payload(1, ODD))
    io.fail_reads_from = HEADER + 4 * SEG  # the last two segments: the companion's first, or anyone's
    assert await read(tier, 1, ODD) is None
    assert tier.stats().errors == {"eio": 1}
    assert await tier.contains_many([key(1)]) == [True]  # an I/O error is no proof of rot
    io.fail_reads_from = None
    assert await read(tier, 1, ODD) == bytes(payload(1, ODD))
    await tier.close()


@pytest.mark.usefixtures("small_segments")
async def test_header_write_failure_leaves_no_temp_file(tmp_path: Path) -> None:
    io = FaultyIO()
    tier = await segmented(tmp_path, io=io)
    io.fail["pwrite"] = errno.ENOSPC  # the header goes in last, after the payload and its checksum
    assert not await tier.put(key(1), payload(1, ODD))
    assert tier.stats().errors == {"enospc": 1}
    assert files(tmp_path) == [] and tier.stats().bytes == 0
    await tier.close()


@pytest.mark.usefixtures("small_segments")
async def test_concurrent_segmented_gets_into_separate_buffers(tmp_path: Path) -> None:
    tier = await segmented(tmp_path)
    assert all(await asyncio.gather(*(tier.put(key(i), payload(i, ODD)) for i in range(12))))
    got = await asyncio.gather(*(read(tier, i, ODD) for i in range(12)))
    assert got == [bytes(payload(i, ODD)) for i in range(12)]
    await tier.close()
