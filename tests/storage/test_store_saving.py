"""TieredStore saving and housekeeping: reserve/commit/abort, write policy, delete, clear, stats, close."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier.app.settings import load_settings, storage_config
from kvtier.storage.arena import ArenaMapping
from kvtier.storage.base import (
    SlotRef,
    SlotStateError,
    StorageError,
    Tier,
)
from kvtier.storage.store import build_store
from kvtier.storage.tiers.disk import DiskTier
from tests.storage.store_env import (
    BIG,
    CHUNK,
    SPEC,
    H,
    answer,
    exists,
    listing,
    payload,
    settled,
    until,
)


# -------------------------------------------------------------------------------- reserve / commit
async def test_reserve_dedups_against_cpu_and_reservations(make) -> None:
    env = await make()
    await env.save([0])
    slots = env.store.reserve(env.ns, [H[0], H[1], H[1]])
    assert slots[0] is None and slots[1] is not None and slots[2] is None
    assert env.store.reserve(env.ns, [H[1]]) == [None]  # reserved, not yet committed
    env.store.abort([slots[1]])
    again = env.store.reserve(env.ns, [H[1]])
    assert again[0] is not None
    env.store.abort([again[0]])
    assert env.store.stats().reserve_dropped == 0  # duplicates are not drops


async def test_commit_and_abort_reject_bad_slots_without_side_effects(make) -> None:
    env = await make()
    s0, s1 = env.store.reserve(env.ns, [H[0], H[1]])
    assert s0 is not None and s1 is not None
    with pytest.raises(SlotStateError):
        env.store.commit(env.ns, [H[0], H[1]], [s1, s0])  # swapped
    with pytest.raises(SlotStateError):
        env.store.commit(env.ns, [H[0]], [SlotRef(s0.offset, s0.length + 1)])
    with pytest.raises(SlotStateError):
        env.store.commit(env.ns, [H[0], H[0]], [s0, s0])
    with pytest.raises(ValueError):
        env.store.commit(env.ns, [H[0]], [])
    assert env.store.stats().tiers["cpu"].chunks == 0
    env.store.abort([s1])
    with pytest.raises(SlotStateError):
        env.store.abort([s1])
    with pytest.raises(SlotStateError):
        env.store.commit(env.ns, [H[1]], [s1])
    env.store.commit(env.ns, [H[0]], [s0])
    with pytest.raises(SlotStateError):
        env.store.commit(env.ns, [H[0]], [s0])
    assert env.store.stats().slots_in_use == 1


async def test_two_namespaces_of_different_sizes_share_the_budget(make) -> None:
    env = await make(chunks=4)
    big = env.store.register(BIG)
    assert BIG.chunk_bytes == 2 * CHUNK
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    assert await env.save([10], ns=big, n=BIG.chunk_bytes) == [True]
    cpu = env.store.stats().tiers["cpu"]
    assert cpu.evictions == 2 and cpu.chunks == 3 and cpu.bytes == 4 * CHUNK
    assert not env.held(0) and not env.held(1)  # LRU went first
    assert (await answer(env.store.lookup(env.ns, [H[0]], "x"))).tiers == [Tier.DISK]  # written through
    env.store.release("x")
    res = await answer(env.store.lookup(big, [H[10]], "y"))
    assert res.num_hit == 1 and env.read(res.slots[0]) == payload(H[10], BIG.chunk_bytes)
    env.store.release("y")
    assert env.store.stats().namespaces == 2


# -------------------------------------------------------------------------------- write policy
async def test_write_through_pins_chunks_while_written(make) -> None:
    env = await make(chunks=2)
    gate = env.disk.put_gate = asyncio.Event()
    await env.save([0, 1])
    await until(lambda: env.disk.putting == 2)  # both writes started (two workers)
    assert env.store.stats().write_queue_depth == 2
    assert env.store.reserve(env.ns, [H[2]]) == [None]  # chunks being written are not evicted
    assert env.store.stats().reserve_dropped == 1 and env.store.stats().writes_yielded == 0
    gate.set()
    assert await env.store.flush(2.0)
    assert set(env.disk.data) == set(env.redis.data) == {env.key(0), env.key(1)}
    slot = (env.store.reserve(env.ns, [H[2]]))[0]
    assert slot is not None
    env.store.abort([slot])


async def test_full_write_queue_drops_and_counts(make) -> None:
    env = await make(write_queue_size=1, write_workers=1)
    gate = env.disk.put_gate = asyncio.Event()
    await env.save([0])
    await env.disk.put_started.wait()  # 0 in flight
    await env.save([1])  # queued
    await env.save([2])  # dropped: commit did not wait
    stats = env.store.stats()
    assert stats.writes_dropped == 1 and stats.write_queue_depth == 2
    gate.set()
    assert await env.store.flush(2.0)
    assert env.key(2) not in env.disk.data
    await answer(env.store.lookup(env.ns, [H[2]], "r"))  # a hit retries the dropped write
    env.store.release("r")
    assert await env.store.flush(2.0)
    assert env.key(2) in env.disk.data
    await settled(env)


async def test_on_reuse_writes_on_first_hit_only(make) -> None:
    env = await make(write_policy="on_reuse")
    await env.save([0])
    assert await env.store.flush(2.0)
    assert env.disk.puts == []
    await answer(env.store.lookup(env.ns, [H[0]], "r"))
    await answer(env.store.lookup(env.ns, [H[0]], "r"))
    env.store.release("r")
    assert await env.store.flush(2.0)
    assert env.disk.puts == [env.key(0)] and env.redis.puts == [env.key(0)]
    await settled(env)


# ---------------------------------------------------------------------------- delete, clear, stats
async def test_delete_reaches_every_tier_and_spares_leased_slots(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    env.disk.data[env.key(1)] = payload(H[1])
    res = await answer(env.store.lookup(env.ns, [H[0]], "r"))
    assert await env.store.delete(env.ns, [H[0], H[1], H[9]]) == 2
    assert not env.held(0)
    assert not env.disk.data and not env.redis.data
    assert env.read(res.slots[0]) == payload(H[0])  # the lease's slot is not reused
    assert env.store.stats().slots_in_use == 1
    env.store.release("r")
    assert env.store.stats().slots_in_use == 0


async def test_clear_drops_unleased_chunks(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    await answer(env.store.lookup(env.ns, [H[0]], "r"))
    assert await env.store.clear([Tier.CPU]) == 1
    assert env.held(0) and not env.held(1)
    assert await env.store.clear([Tier.DISK]) == 2
    assert not env.disk.data and len(env.redis.data) == 2
    env.store.release("r")


async def test_stats_per_tier(make) -> None:
    env = await make()
    await env.save([0])
    await answer(env.store.lookup(env.ns, [H[0], H[1], H[2]], "r"))
    stats = env.store.stats()
    assert set(stats.tiers) == {"cpu", "disk", "redis"}
    cpu = stats.tiers["cpu"]
    assert (cpu.hits, cpu.misses, cpu.stores, cpu.chunks, cpu.bytes) == (1, 1, 1, 1, CHUNK)
    assert cpu.capacity == 4 * CHUNK
    assert stats.slots_in_use == 1 and stats.slots_total_bytes == CHUNK
    assert stats.leases_active == 1 and stats.namespaces == 1
    env.store.release("r")


# -------------------------------------------------------------------------------- close
async def test_close_drains_writes_and_releases_everything(make) -> None:
    env = await make()
    env.disk.delay = 0.02
    await env.save([0])
    await answer(env.store.lookup(env.ns, [H[0]], "r"))
    env.client.close()
    await env.store.close(drain_timeout=2.0)
    assert env.key(0) in env.disk.data  # drained before the tiers closed
    assert env.disk.closed and env.redis.closed
    assert not exists(env.path)
    await env.store.close()
    with pytest.raises(StorageError):
        await answer(env.store.lookup(env.ns, [H[0]], "r"))


async def test_close_gives_up_on_a_stuck_tier(make) -> None:
    env = await make()
    env.disk.put_gate = asyncio.Event()  # never opened
    await env.save([0])
    env.client.close()
    await env.store.close(drain_timeout=0.05)
    assert env.store.stats().writes_dropped == 1
    assert not exists(env.path)


async def test_build_store_from_settings(tmp_path: Path) -> None:
    settings = load_settings({"shm_dir": str(tmp_path), "cpu_size": "1MiB", "lease_ttl": 5}, env={})
    async with await build_store(storage_config(settings)) as store:
        ns = store.register(SPEC)
        info = store.arena_info()
        assert Path(info.path).parent == tmp_path and info.size == 1 << 20
        slots = store.reserve(ns, [H[0]])
        assert slots[0] is not None
        store.commit(ns, [H[0]], [slots[0]])
        assert (await answer(store.lookup(ns, [H[0]], "r"))).num_hit == 1
        assert store.lower == []
    assert listing(tmp_path) == []


async def test_build_store_with_the_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    extra = {"shm_dir": str(tmp_path / "shm"), "cpu_size": "1MiB", "disk_path": str(tmp_path / "d")}
    settings = load_settings(extra, env={})
    async with await build_store(storage_config(settings)) as store:
        ns = store.register(SPEC)
        slots = store.reserve(ns, H[:2])
        client = ArenaMapping.open(store.arena_info())
        for h, slot in zip(H[:2], slots, strict=True):
            assert slot is not None
            client.view(slot)[:] = payload(h)
        store.commit(ns, H[:2], [s for s in slots if s is not None])
        assert await store.flush(5.0)
        client.close()
    async with await build_store(storage_config(settings)) as store:  # a fresh arena: only the disk remembers
        (disk,) = store.lower
        assert isinstance(disk, DiskTier)
        await asyncio.wait_for(disk.wait_loaded(), 30)  # the index loads in the background
        ns = store.register(SPEC)
        res = await answer(store.lookup(ns, H[:3], "r"))
        assert res.num_hit == 2 and res.tiers == [Tier.DISK, Tier.DISK]
        staged = await store.stage("r")
        assert staged.failed == []
        client = ArenaMapping.open(store.arena_info())
        assert [bytes(client.view(s)) for s in staged.slots if s] == [payload(h) for h in H[:2]]
        client.close()
    assert listing(tmp_path / "shm") == []
