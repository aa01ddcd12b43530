"""The disk tier's index: compact in memory, loaded in the background while the tier serves, and
exact about every put, delete, clear and eviction that happens during the load."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.storage import codec
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import DiskConfig
from kvtier.storage.tiers import disk as disk_module
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.disk_files import TEMP_PREFIX, DiskIO
from kvtier.storage.tiers.disk_index import DiskIndex, IndexLoad, NamespaceIds, ScanBatch, order_by_mtime
from tests.storage.store_env import until

NS = "00112233445566ff"
OTHER_NS = "ffeeddccbbaa9988"
PAYLOAD = 256


def key(fan: int, i: int, ns: str = NS) -> ChunkKey:
    """A key whose file lies in fan-out directory ``fan`` (its hash's first byte)."""
    return ChunkKey(ns, bytes([fan]) + i.to_bytes(7, "big"))


BLOB = codec.header_size(key(0, 0)) + PAYLOAD


def payload(i: int) -> memoryview:
    return memoryview(bytes((i + j) % 251 for j in range(PAYLOAD)))


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def exists(path: str) -> bool:
    return os.path.exists(path)


# ------------------------------------------------------------------------------------- the index alone
def test_namespace_ids_are_small_and_round_trip() -> None:
    ids = NamespaceIds()
    a, b = key(1, 2), key(1, 2, OTHER_NS)
    assert ids.find(NS) is None
    compact_a, compact_b = ids.compact(a), ids.compact(b)
    assert compact_a == b"\0\0\0\0" + a.prefix_hash and compact_b == b"\0\0\0\1" + b.prefix_hash
    assert ids.key_of(compact_a) == a and ids.key_of(compact_b) == b
    assert type(ids.key_of(compact_a)) is ChunkKey and ids.find(NS) == b"\0\0\0\0"


def test_index_keeps_the_bytes_of_its_files_and_evicts_by_clock() -> None:
    index = DiskIndex()
    keys = [index.ids.compact(key(0, i)) for i in range(6)]
    for compact in keys:
        index.put(compact, 100)  # new keys start unused
    index.put(keys[5], 500)  # stored anew: a new size, counted once, and a use
    assert index.used == 5 * 100 + 500 and len(index) == 6 and not index.touch(b"nope")
    # The hand takes unused keys in id order, and passes the used one.
    assert index.victims(200) == keys[:2]
    assert [index.pop(c) for c in keys[:2]] == [100, 100] and index.pop(keys[0]) is None
    assert index.used == 3 * 100 + 500
    assert index.touch(keys[3])  # used: the hand gives it a second chance
    assert index.victims(200) == [keys[2], keys[4]]
    assert index.victims(1000, held=lambda c: c != keys[3]) == []  # 100 bytes may go: too few
    assert index.victims(100, held=lambda c: c != keys[3], slack=50) == [keys[3]]  # slack if it can
    assert index.find(key(0, 3)) == keys[3] and index.find(key(0, 0)) is None
    assert index.find(key(0, 3, OTHER_NS)) is None  # a namespace with no id: no allocation
    assert index.ids.find(OTHER_NS) is None
    fresh = index.ids.compact(key(0, 9))
    index.put(fresh, 100)  # takes a removed key's id
    assert len(index) == 5 and index.size_of(fresh) == 100 and index.used == 4 * 100 + 500
    with pytest.raises(ValueError, match="reorder of 5 entries got 1"):
        index.reorder({keys[3]: 100})
    index.reorder({c: index.size_of(c) or 0 for c in [keys[5], fresh, keys[2], keys[3], keys[4]]})
    assert index.victims(index.used) == [keys[5], fresh, keys[2], keys[3], keys[4]]  # oldest first


def test_index_memory_per_chunk_is_at_most_200_bytes() -> None:
    # vLLM's block hashes are 32 bytes (sha256); every chunk of a namespace has one file size.
    n = 100_000
    rng = random.Random(7)
    keys = [ChunkKey(NS, rng.randbytes(32)) for _ in range(n)]
    size = codec.header_size(keys[0]) + (2 << 20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = DiskIndex()
        for k in keys:
            index.put(index.ids.compact(k), size + 0)  # a fresh int each time: the index shares one
        per_chunk = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(index) == n and index.used == n * size
    assert per_chunk <= 200, f"{per_chunk:.1f} bytes per chunk"


def test_order_by_mtime_sorts_oldest_first_and_keeps_ties_in_order() -> None:
    from array import array

    ordered = order_by_mtime([b"a", b"b", b"c", b"d"], [1, 2, 3, 4], array("d", [5.0, 1.0, 5.0, 0.5]))
    assert list(ordered.items()) == [(b"d", 4), (b"b", 2), (b"a", 1), (b"c", 3)]


def _simulate_load(seed: int) -> None:
    """One random interleaving of scan batches and the loop's own puts, reads, deletes and clears,
    checked against a model of the files on disk and their recency."""
    rng = random.Random(seed)
    index = DiskIndex()
    compact = [index.ids.compact(key(i % 7, i)) for i in range(60)]
    on_disk = {c: (rng.randrange(1, 9) * 100, rng.random()) for c in rng.sample(compact, 40)}
    # The scan's view: every file present at start, in random order, seen before anything changed.
    seen = list(on_disk.items())
    rng.shuffle(seen)
    batches = [seen[i : i + 5] for i in range(0, len(seen), 5)]
    load = IndexLoad()
    truth = dict(on_disk)  # what is on disk now
    recent: list[bytes] = []  # keys stored or read during the load, most recent last
    removed: set[bytes] = set()
    for batch in batches:
        for _ in range(rng.randrange(4)):
            op, c = rng.choice(("put", "read", "delete", "clear")), rng.choice(compact)
            if op == "put":
                truth[c] = (777, 0.0)
                removed.discard(c)  # its scanned file went; this is a new one
                index.put(c, 777)
                load.stored(c)
                recent = [*(r for r in recent if r != c), c]
            elif op == "read" and index.touch(c):
                load.stored(c)
                recent = [*(r for r in recent if r != c), c]
            elif op == "delete":
                truth.pop(c, None)
                load.dropped.add(c)
                index.pop(c)
                recent = [r for r in recent if r != c]
            elif op == "clear" and rng.random() < 0.2:
                load.cleared = True
                for k in index.key_list():
                    load.dropped.add(k)
                    index.pop(k)
                truth = {}
                recent = []
        scan = ScanBatch([c for c, _ in batch], [s for _, (s, _) in batch], [m for _, (_, m) in batch])
        for c in load.merge(index, scan, set()):
            removed.add(c)
            truth.pop(c, None)
    load.settle(index, order_by_mtime(*load.records()))
    old = sorted((c for c in truth if c not in recent), key=lambda c: on_disk[c][1])
    # Eviction takes the scanned files oldest first, then the keys stored or read during the load.
    assert index.victims(index.used) == old + recent
    assert {c: index.size_of(c) for c in index.key_list()} == {c: size for c, (size, _) in truth.items()}
    assert index.used == sum(size for size, _ in truth.values())
    assert removed.isdisjoint(index.key_list())


@pytest.mark.parametrize("seed", range(40))
def test_a_load_interleaved_with_the_loops_own_changes_ends_exact(seed: int) -> None:
    _simulate_load(seed)


def test_a_scanned_file_of_a_key_being_written_is_indexed_until_the_write_replaces_it() -> None:
    index, load = DiskIndex(), IndexLoad()
    c = index.ids.compact(key(0, 1))
    load.cleared = True  # even after a clear: the write may fail and leave the file there
    assert load.merge(index, ScanBatch([c], [300], [1.0]), writing={c}) == []
    assert index.size_of(c) == 300 and index.used == 300
    index.put(c, 500)  # the write's bookkeeping replaces it: counted once
    load.stored(c)
    assert index.used == 500


def test_bad_files_are_removed_unless_a_newer_file_of_the_key_exists() -> None:
    index, load = DiskIndex(), IndexLoad()
    fresh, writing, stale = (index.ids.compact(key(0, i)) for i in range(3))
    index.put(fresh, 10)
    bad = ScanBatch(bad=[fresh, writing, stale])
    assert load.merge(index, bad, writing={writing}) == [stale]


# ------------------------------------------------------------------------------------- the tier loading
class GateIO(DiskIO):
    """Holds the scan's header reads of chosen fan-out directories until let through."""

    def __init__(self, fans: set[int]) -> None:
        self.held = tuple(f"/{NS}/{fan:02x}/" for fan in fans)
        self.gate = threading.Event()
        self.waiting = 0

    def open_read(self, path: str) -> int:
        if threading.current_thread().name.startswith("kvtier-disk-scan") and any(
            h in path for h in self.held
        ):
            self.waiting += 1
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the gate")
        return super().open_read(path)


async def filled(root: Path, keys: list[ChunkKey], mtime: Callable[[int], float] | None = None) -> None:
    """Files for keys under root, written by a tier of their own (optionally dated)."""
    tier = DiskTier(DiskConfig(str(root), 1 << 30))
    await tier.start()
    await tier.wait_loaded()
    for i, k in enumerate(keys):
        assert await tier.put(k, payload(i))
        if mtime is not None:
            os.utime(tier.path_of(k), (mtime(i), mtime(i)))
    await tier.close()


async def gated(root: Path, fans: set[int], capacity: int = 1 << 30) -> tuple[DiskTier, GateIO]:
    """A started tier whose scan is held at the first header read in the fan-out directories fans."""
    io = GateIO(fans)
    tier = DiskTier(DiskConfig(str(root), capacity), io=io)
    await tier.start()
    await until(lambda: io.waiting > 0, within_s=30)
    return tier, io


async def test_the_tier_serves_at_once_and_hits_arrive_as_the_index_fills(tmp_path: Path) -> None:
    early, late = [key(0, i) for i in range(5)], [key(1, i) for i in range(5)]
    await filled(tmp_path, early + late)
    tier, io = await gated(tmp_path, {1})
    assert not tier.index_complete
    await until(lambda: tier.stats().chunks == len(early), within_s=30)  # the other directory is merged
    assert await tier.contains_many(early + late) == [True] * 5 + [False] * 5
    dest = bytearray(PAYLOAD)
    assert await tier.get_into(early[2], memoryview(dest)) and dest == payload(2)
    assert not await tier.get_into(late[0], memoryview(dest))  # not indexed yet: a miss
    assert not tier.index_complete and tier.stats().healthy
    io.gate.set()
    await asyncio.wait_for(tier.wait_loaded(), 30)
    assert tier.index_complete
    assert await tier.contains_many(early + late) == [True] * 10
    stats = tier.stats()
    assert (stats.chunks, stats.bytes, stats.hits, stats.misses) == (10, 10 * BLOB, 1, 1)
    assert tier.last_scan.chunks == 10 and not stats.errors
    await tier.close()


async def test_puts_and_deletes_during_the_load_are_exact(tmp_path: Path) -> None:
    old = [key(1, i) for i in range(6)]
    await filled(tmp_path, old)
    tier, io = await gated(tmp_path, {1})
    new = key(2, 0)
    assert await tier.put(new, payload(9))  # a new key
    assert await tier.put(old[0], payload(0))  # a key whose file the scan has not reached yet
    await tier.delete(old[1])  # not indexed yet, but its file goes now and stays gone
    assert await tier.contains_many([new, old[0], old[1]]) == [True, True, False]
    assert not exists(tier.path_of(old[1]))
    io.gate.set()
    await asyncio.wait_for(tier.wait_loaded(), 30)
    assert await tier.contains_many(old) == [True, False, True, True, True, True]
    stats = tier.stats()
    on_disk = files(tmp_path)
    assert stats.chunks == len(on_disk) == 6  # old 0 and 2..5, and the new key, each once
    assert stats.bytes == sum(p.stat().st_size for p in on_disk) == 6 * BLOB
    # The keys stored during the load are the most recent: eviction takes the scanned ones first.
    assert [tier._ids.key_of(c) for c in tier._index.victims(tier._index.used)][-2:] == [new, old[0]]
    await tier.close()


async def test_clear_during_the_load_removes_what_the_scan_finds_later(tmp_path: Path) -> None:
    early, late = [key(0, i) for i in range(3)], [key(1, i) for i in range(4)]
    await filled(tmp_path, early + late)
    tier, io = await gated(tmp_path, {1})
    await until(lambda: tier.stats().chunks == len(early), within_s=30)
    tier.pin([early[0]])
    assert await tier.clear() == 2  # the known unpinned ones
    after = key(3, 0)
    assert await tier.put(after, payload(1))
    io.gate.set()
    await asyncio.wait_for(tier.wait_loaded(), 30)
    assert await tier.contains_many([*early, *late, after]) == [True, False, False] + [False] * 4 + [True]
    assert files(tmp_path) == sorted(Path(tier.path_of(k)) for k in (early[0], after))
    assert tier.stats().bytes == 2 * BLOB
    await tier.close()


async def test_no_eviction_before_the_index_is_complete_and_oldest_go_first_after(tmp_path: Path) -> None:
    old = [key(1, i) for i in range(4)]
    await filled(tmp_path, old, mtime=lambda i: 1000.0 + i)
    tier, io = await gated(tmp_path, {1}, capacity=3 * BLOB)
    fresh = [key(2, i) for i in range(4)]
    for i in range(3):
        assert await tier.put(fresh[i], payload(i))  # fits with what is known so far (nothing)
    assert not await tier.put(fresh[3], payload(3))  # would not fit: refused, nothing evicted
    assert tier.stats().errors == {"full": 1} and tier.stats().evictions == 0
    io.gate.set()
    await asyncio.wait_for(tier.wait_loaded(), 30)
    # Seven files for room of three: the four scanned, oldest first, are evicted; not the new ones.
    assert await tier.contains_many(old + fresh[:3]) == [False] * 4 + [True] * 3
    assert len(files(tmp_path)) == 3 and tier.stats().bytes == 3 * BLOB
    assert tier.stats().evictions == 4
    await tier.close()


async def test_close_during_the_load_ends_it(tmp_path: Path) -> None:
    old = [key(1, i) for i in range(3)]
    await filled(tmp_path, old)
    tier, io = await gated(tmp_path, {1})
    closing = asyncio.create_task(tier.close())
    io.gate.set()
    await asyncio.wait_for(closing, 30)
    assert not tier.index_complete and len(files(tmp_path)) == 3


async def test_eviction_frees_a_slack_of_disk_size_beyond_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_module, "_SLACK_SHIFT", 2)  # slack: a quarter of disk_size, two blobs
    tier = DiskTier(DiskConfig(str(tmp_path), 8 * BLOB))
    await tier.start()
    await tier.wait_loaded()
    keys = [key(0, i) for i in range(10)]
    for i in range(8):
        assert await tier.put(keys[i], payload(i))
    assert tier.stats().evictions == 0
    assert await tier.put(keys[8], payload(8))  # needs one: evicts three, the oldest
    assert await tier.contains_many(keys[:9]) == [False] * 3 + [True] * 6
    assert await tier.put(keys[9], payload(9))  # fits in the room the slack made
    assert tier.stats().evictions == 3 and len(files(tmp_path)) == 7
    await tier.close()


def test_the_scan_keeps_this_tiers_temp_files_and_removes_others(tmp_path: Path) -> None:
    tier = DiskTier(DiskConfig(str(tmp_path), 1 << 20))
    fan = Path(tier.path_of(key(0, 1))).parent
    fan.mkdir(parents=True)
    mine = fan / f"{tier.files._own_temp}7"
    crashed = fan / f"{TEMP_PREFIX}1-deadbeef-7"
    mine.write_bytes(b"in flight")
    crashed.write_bytes(b"left by a crash")
    batch, report = tier.files.scan_unit(str(fan.parent), tier._ids.prefix)
    assert mine.exists() and not crashed.exists()
    assert report.temp_removed == 1 and batch.keys == []


async def test_a_failed_scan_leaves_a_complete_index_of_what_it_found(tmp_path: Path) -> None:
    await filled(tmp_path, [key(0, 1)])
    tier = DiskTier(DiskConfig(str(tmp_path), 1 << 20))

    def broken(*_: object) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    tier.files.scan_plan = broken  # type: ignore[method-assign]
    await tier.start()
    await asyncio.wait_for(tier.wait_loaded(), 30)
    assert tier.index_complete and tier.stats().healthy
    assert tier.stats().errors == {"scan_failed": 1} and tier.stats().chunks == 0
    assert await tier.put(key(0, 2), payload(2))  # the tier still stores and serves
    assert await tier.contains_many([key(0, 1), key(0, 2)]) == [False, True]
    await tier.close()
