"""Every tier tells its listener of each chunk that enters or leaves it (the KV events' source)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import fakeredis

from kvtier.storage import codec
from kvtier.storage.arena import Arena, SlotAllocator
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.config import DiskConfig, RedisConfig
from kvtier.storage.store import TieredStore
from kvtier.storage.tiers.cpu import CpuTier
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.redis import RedisTier
from tests.storage.store_env import SPEC

CHUNK = 4096
NS = "0123456789abcdef"


class Recorder:
    """A TierListener that keeps its calls, and the set of keys each tier holds by them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Tier, list[ChunkKey], list[tuple[bytes, ...]]]] = []
        self.held: dict[Tier, dict[ChunkKey, tuple[bytes, ...]]] = {t: {} for t in Tier}

    def stored(self, tier: Tier, keys: Sequence[ChunkKey], covered: Sequence[Sequence[bytes]]) -> None:
        blocks = [tuple(c) for c in covered]
        self.calls.append(("stored", tier, list(keys), blocks))
        self.held[tier].update(zip(keys, blocks, strict=True))

    def removed(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        self.calls.append(("removed", tier, list(keys), []))
        for key in keys:
            self.held[tier].pop(key, None)

    def cleared(self, tier: Tier) -> None:
        self.calls.append(("cleared", tier, [], []))
        self.held[tier].clear()


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, bytes([i]) * 32)


def blocks(i: int) -> list[bytes]:
    return [bytes([i, b]) * 16 for b in range(3)] + [bytes([i]) * 32]


def payload(i: int) -> memoryview:
    return memoryview(bytes([i]) * CHUNK)


# ---------------------------------------------------------------------------------------------- CPU
def test_cpu_tier_announces_commits_evictions_removals_and_clears() -> None:
    rec = Recorder()
    cpu = CpuTier(SlotAllocator(3 * CHUNK), rec)
    slots = [cpu.reserve(CHUNK) for _ in range(3)]
    assert None not in slots
    cpu.commit_many([key(1), key(2), key(3)], slots, covered=[blocks(1), blocks(2), blocks(3)])  # type: ignore[arg-type]
    assert rec.calls == [
        ("stored", Tier.CPU, [key(1), key(2), key(3)], [tuple(blocks(i)) for i in (1, 2, 3)])
    ]
    slot = cpu.reserve(CHUNK)  # full: evicts the least recently used, key 1
    assert slot is not None
    assert rec.calls[-1] == ("removed", Tier.CPU, [key(1)], [])
    cpu.commit(key(4), slot)  # committed without block hashes: the listener is told none
    assert rec.calls[-1] == ("stored", Tier.CPU, [key(4)], [()])
    assert cpu.remove(key(2))
    assert rec.calls[-1] == ("removed", Tier.CPU, [key(2)], [])
    assert cpu.clear() == 2
    assert rec.held[Tier.CPU] == {}


def test_cpu_tier_without_a_listener_still_commits_and_evicts() -> None:
    cpu = CpuTier(SlotAllocator(CHUNK))
    slot = cpu.reserve(CHUNK)
    assert slot is not None
    cpu.commit(key(1), slot)
    assert cpu.reserve(CHUNK) is not None  # evicts key 1
    assert cpu.entry(key(1)) is None


# ---------------------------------------------------------------------------------------------- store
async def test_store_commit_keeps_block_hashes_through_to_the_lower_tier(tmp_path: Path) -> None:
    rec = Recorder()
    disk = DiskTier(DiskConfig(str(tmp_path / "disk"), 1 << 20, False), listener=rec)
    await disk.start()
    await disk.wait_loaded()
    arena = Arena.create(tmp_path, 4 * SPEC.chunk_bytes, prefault=False)
    store = TieredStore(arena, [disk], listener=rec)
    try:
        ns = store.register(SPEC)
        size = SPEC.chunk_bytes
        hashes = [bytes([7]) * 32]
        slots = store.reserve(ns, hashes)
        assert slots[0] is not None and slots[0].length == size
        store.commit(ns, hashes, [slots[0]], [blocks(7)])
        assert await store.flush(5.0)
        k = ChunkKey(ns, hashes[0])
        assert rec.held[Tier.CPU] == {k: tuple(blocks(7))}
        assert rec.held[Tier.DISK] == {k: tuple(blocks(7))}
        assert await store.held(ns, [*hashes, b"\x09" * 32]) == {
            Tier.CPU: [True, False],
            Tier.DISK: [True, False],
        }
        assert await store.delete(ns, hashes) == 1
        assert rec.held[Tier.CPU] == {} and rec.held[Tier.DISK] == {}
    finally:
        await store.close(1.0)


# ---------------------------------------------------------------------------------------------- disk
def _read_head(path: str, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def _write_at(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


async def _disk(root: Path, rec: Recorder, capacity: int = 1 << 20) -> DiskTier:
    tier = DiskTier(DiskConfig(str(root), capacity, False), listener=rec)
    await tier.start()
    await tier.wait_loaded()
    return tier


async def test_disk_tier_announces_writes_evictions_corrupt_deletes_and_clears(tmp_path: Path) -> None:
    rec = Recorder()
    size = codec.header_size(key(1)) + CHUNK + len(codec.encode_trailer(blocks(1)))
    tier = await _disk(tmp_path, rec, capacity=2 * size)
    try:
        assert await tier.put(key(1), payload(1), blocks(1))
        assert await tier.put(key(2), payload(2), blocks(2))
        assert rec.held[Tier.DISK] == {key(1): tuple(blocks(1)), key(2): tuple(blocks(2))}
        assert await tier.put(key(3), payload(3), blocks(3))  # evicts key 1 to fit
        assert ("removed", Tier.DISK, [key(1)], []) in rec.calls
        assert set(rec.held[Tier.DISK]) == {key(2), key(3)}
        path = tier.path_of(key(2))
        _write_at(path, codec.header_size(key(2)) + 10, b"\xff")  # the read then deletes the file
        assert not await tier.get_into(key(2), memoryview(bytearray(CHUNK)))
        assert set(rec.held[Tier.DISK]) == {key(3)}
        assert await tier.clear() == 1
        assert rec.held[Tier.DISK] == {}
    finally:
        await tier.close()


async def test_disk_tier_refusing_a_put_for_lack_of_room_announces_nothing(tmp_path: Path) -> None:
    rec = Recorder()
    tier = await _disk(tmp_path, rec, capacity=CHUNK // 2)
    try:
        assert not await tier.put(key(1), payload(1), blocks(1))
        assert tier.stats().errors == {"too_large": 1}
        assert rec.calls == []
    finally:
        await tier.close()


async def test_disk_index_load_announces_every_file_with_its_block_hashes(tmp_path: Path) -> None:
    first = Recorder()
    tier = await _disk(tmp_path, first)
    assert await tier.put(key(1), payload(1), blocks(1))
    assert await tier.put(key(2), payload(2))  # no block hashes known: none in the file
    await tier.close()
    (tmp_path / NS / "aa").mkdir()  # debris the scan leaves alone
    rec = Recorder()
    again = await _disk(tmp_path, rec)
    try:
        assert rec.held[Tier.DISK] == {key(1): tuple(blocks(1)), key(2): ()}
        got = memoryview(bytearray(CHUNK))
        assert await again.get_into(key(1), got)  # the trailer does not disturb a read
        assert bytes(got) == bytes(payload(1))
    finally:
        await again.close()


async def test_files_of_the_previous_format_are_removed_unannounced(tmp_path: Path) -> None:
    rec = Recorder()
    tier = await _disk(tmp_path, rec)
    assert await tier.put(key(1), payload(1), blocks(1))
    path = tier.path_of(key(1))
    await tier.close()
    head = bytearray(_read_head(path, codec.header_size(key(1))))  # rewritten as format 2 did
    head[4:6] = (2).to_bytes(2, "little")
    head[6:8] = (0).to_bytes(2, "little")
    import xxhash

    head[28:36] = xxhash.xxh3_64_intdigest(bytes(head[:28]) + bytes(head[36:])).to_bytes(8, "little")
    _write_at(path, 0, bytes(head))
    rec = Recorder()
    again = await _disk(tmp_path, rec)
    try:
        assert rec.calls == []
        assert again.last_scan.outdated_removed == 1
        assert again.stats().chunks == 0
    finally:
        await again.close()


# ---------------------------------------------------------------------------------------------- redis
def _redis(rec: Recorder) -> RedisTier:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    config = RedisConfig(url="redis://fake", ttl=60, timeout=1.0, pool_size=2, breaker_period=1.0)
    return RedisTier(config, client=client, fast_path=False, listener=rec)


async def test_redis_tier_announces_sets_deletes_and_clears() -> None:
    rec = Recorder()
    tier = _redis(rec)
    try:
        assert await tier.put(key(1), payload(1), blocks(1))
        assert await tier.put(key(2), payload(2), blocks(2))
        assert rec.held[Tier.REDIS] == {key(1): tuple(blocks(1)), key(2): tuple(blocks(2))}
        await tier.delete(key(1))
        assert set(rec.held[Tier.REDIS]) == {key(2)}
        assert await tier.clear() == 1
        assert rec.held[Tier.REDIS] == {}
    finally:
        await tier.close()


async def test_redis_keys_gone_behind_kvtiers_back_are_announced_when_a_lookup_misses_them() -> None:
    """The Redis guarantee (docs/events.md): an expired or evicted key is announced removed by the
    first lookup or read that finds it gone."""
    rec = Recorder()
    tier = _redis(rec)
    try:
        assert await tier.put(key(1), payload(1), blocks(1))
        assert await tier.put(key(2), payload(2), blocks(2))
        client = tier._client
        await client.delete("kvtier:" + NS + ":" + key(1).prefix_hash.hex())  # as a TTL would
        assert set(rec.held[Tier.REDIS]) == {key(1), key(2)}
        assert await tier.contains_many([key(1), key(2)]) == [False, True]
        assert set(rec.held[Tier.REDIS]) == {key(2)}
        await client.delete("kvtier:" + NS + ":" + key(2).prefix_hash.hex())
        assert not await tier.get_into(key(2), memoryview(bytearray(CHUNK)))
        assert rec.held[Tier.REDIS] == {}
    finally:
        await tier.close()
