"""TieredStore over a real arena (in tmp_path) and fake lower tiers: leases, stage, save, policy."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.app.settings import load_settings, storage_config
from kvtier.storage.arena import Arena, ArenaMapping
from kvtier.storage.base import (
    ArenaError,
    ChunkKey,
    NamespaceSpec,
    SlotRef,
    SlotStateError,
    StageResult,
    StorageError,
    Tier,
    UnknownNamespaceError,
)
from kvtier.storage.store import StoreConfig, TieredStore, build_store
from tests.storage.fakes import FakeTier

SPEC = NamespaceSpec(
    model="m", kv_dtype="bf16", kv_layout="nhd", block_size=16, chunk_size=16, num_layers=2,
    page_bytes=8192,
)  # fmt: skip
BIG = NamespaceSpec(
    model="m2", kv_dtype="bf16", kv_layout="nhd", block_size=16, chunk_size=16, num_layers=2,
    page_bytes=16384,
)  # fmt: skip
CHUNK = SPEC.chunk_bytes  # 16 KiB
H = [bytes([i]) * 8 for i in range(16)]


def payload(h: bytes, n: int = CHUNK) -> bytes:
    return (h * (n // len(h) + 1))[:n]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    store: TieredStore
    ns: str
    client: ArenaMapping  # what a vLLM worker maps
    disk: FakeTier
    redis: FakeTier
    clock: Clock
    path: str

    def key(self, i: int) -> ChunkKey:
        return ChunkKey(self.ns, H[i])

    def read(self, slot: SlotRef | None) -> bytes:
        assert slot is not None
        view = self.client.view(slot)
        try:
            return bytes(view)
        finally:
            view.release()

    async def save(self, idx: list[int], ns: str | None = None, n: int = CHUNK) -> list[bool]:
        """Reserve, fill through the client mapping, commit: what a worker does."""
        ns = ns or self.ns
        hashes = [H[i] for i in idx]
        slots = await self.store.reserve(ns, hashes)
        done = [(h, s) for h, s in zip(hashes, slots, strict=True) if s is not None]
        for h, s in done:
            view = self.client.view(s)
            view[:] = payload(h, n)
            view.release()
        if done:
            await self.store.commit(ns, [h for h, _ in done], [s for _, s in done])
        return [s is not None for s in slots]

    def pins(self, i: int) -> int:
        entry = self.store.cpu.entry(self.key(i))
        assert entry is not None
        return entry.pins


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    envs: list[Env] = []

    async def factory(chunks: int = 4, **cfg: object) -> Env:
        clock = Clock()
        arena = Arena.create(tmp_path, chunks * CHUNK, prefault=False)
        disk, redis = FakeTier(Tier.DISK), FakeTier(Tier.REDIS)
        config = StoreConfig(**{"lease_ttl": 10.0, "write_queue_size": 8, **cfg})  # type: ignore[arg-type]
        store = TieredStore(arena, [redis, disk], config, clock)
        ns = await store.register(SPEC)
        env = Env(store, ns, ArenaMapping.open(store.arena_info()), disk, redis, clock, arena.path)
        envs.append(env)
        return env

    yield factory
    for env in envs:
        env.client.close()
        if env.disk.put_gate is not None:
            env.disk.put_gate.set()
        await env.store.close(1.0)
    assert listing(tmp_path) == []


def listing(path: Path) -> list[Path]:
    return list(path.iterdir())


def exists(path: str) -> bool:
    return os.path.exists(path)


async def until(pred: Callable[[], bool], within_s: float = 2.0) -> None:
    """Yield to the loop until pred() holds (fails the test after within_s)."""
    for _ in range(int(within_s / 0.001)):
        if pred():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


async def settled(env: Env) -> None:
    """Queued writes done, then no pin may be left anywhere."""
    assert await env.store.flush(2.0)
    assert env.store.cpu.pinned_chunks == 0
    assert not env.disk.pins and not env.redis.pins


# -------------------------------------------------------------------------------- namespaces
async def test_register_and_unknown_namespace(make) -> None:
    env = await make()
    assert await env.store.register(SPEC) == env.ns
    with pytest.raises(UnknownNamespaceError):
        await env.store.lookup("nope", [H[0]], "r")
    with pytest.raises(UnknownNamespaceError):
        await env.store.reserve("nope", [H[0]])
    with pytest.raises(UnknownNamespaceError):
        await env.store.commit("nope", [], [])
    with pytest.raises(UnknownNamespaceError):
        await env.store.delete("nope", [H[0]])
    huge = NamespaceSpec("m", "bf16", "nhd", 16, 16, 64, 8192)
    with pytest.raises(ArenaError):
        await env.store.register(huge)


# -------------------------------------------------------------------------------- lookup
async def test_cpu_hits_are_readable_by_a_client(make) -> None:
    env = await make()
    assert await env.save([0, 1]) == [True, True]
    res = await env.store.lookup(env.ns, [H[0], H[1], H[2]], "r")
    assert res.num_hit == 2 and res.tiers == [Tier.CPU, Tier.CPU]
    assert [env.read(s) for s in res.slots] == [payload(H[0]), payload(H[1])]
    assert env.store.stats().leases_active == 1
    await env.store.release("r")
    await env.store.release("r")  # idempotent
    await settled(env)


async def test_prefix_spans_tiers_with_one_batch_per_tier(make) -> None:
    env = await make()
    await env.save([0, 4])
    await env.store.flush()
    env.disk.data[env.key(1)] = payload(H[1])
    env.redis.data[env.key(2)] = payload(H[2])
    env.disk.contains_calls.clear()
    env.redis.contains_calls.clear()
    res = await env.store.lookup(env.ns, H[:5], "r")
    assert res.num_hit == 3
    assert res.tiers == [Tier.CPU, Tier.DISK, Tier.REDIS]
    assert res.slots[0] is not None and res.slots[1:] == [None, None]
    assert env.disk.contains_calls == [[env.key(1), env.key(2), env.key(3)]]
    assert env.redis.contains_calls == [[env.key(2), env.key(3)]]
    assert env.pins(0) == 1 and env.pins(4) == 0  # beyond the prefix: not held
    assert env.disk.pins == {env.key(1): 1} and env.redis.pins == {env.key(2): 1}
    await env.store.release("r")
    await settled(env)


async def test_leased_chunks_survive_pressure(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    await env.store.lookup(env.ns, [H[0]], "r")
    slots = await env.store.reserve(env.ns, H[4:8])
    assert [s is not None for s in slots] == [True, True, True, False]
    assert env.store.stats().reserve_dropped == 1
    assert env.key(0) in env.store.cpu
    await env.store.release("r")
    assert (await env.store.reserve(env.ns, [H[8]]))[0] is not None  # H0 may go now
    assert env.key(0) not in env.store.cpu
    await env.store.abort([s for s in slots if s is not None])


async def test_lookup_now_answers_from_the_cpu_tier_only(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    env.disk.contains_calls.clear()
    res = env.store.lookup_now(env.ns, [H[0], H[1]], "r")
    assert res is not None and res.num_hit == 2 and res.tiers == [Tier.CPU, Tier.CPU]
    assert [env.read(s) for s in res.slots] == [payload(H[0]), payload(H[1])]
    assert env.pins(0) == 1 and env.pins(1) == 1
    # A CPU miss may be a lower-tier hit: lookup_now declines and changes nothing.
    assert env.store.lookup_now(env.ns, [H[0], H[2]], "r2") is None
    assert env.pins(0) == 1 and env.store.stats().leases_active == 1
    assert env.disk.contains_calls == []
    res = await env.store.lookup(env.ns, [H[0], H[2]], "r2")
    assert res.num_hit == 1 and env.pins(0) == 2
    await env.store.release("r")
    await env.store.release("r2")
    await settled(env)


async def test_a_full_arena_drops_every_occurrence_of_a_hash(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    await env.store.lookup(env.ns, H[:4], "r")  # everything leased: nothing can be evicted
    assert await env.store.reserve(env.ns, [H[5], H[5], H[6]]) == [None, None, None]
    assert env.store.stats().reserve_dropped == 3  # as when each was asked for one by one
    await env.store.release("r")


async def test_repeated_lookup_replaces_the_lease(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    env.disk.data[env.key(5)] = payload(H[5])
    await env.store.lookup(env.ns, [H[0]], "r")
    await env.store.lookup(env.ns, [H[1]], "r")
    assert env.pins(0) == 0 and env.pins(1) == 1
    await env.store.lookup(env.ns, [H[5]], "r")
    assert env.pins(1) == 0 and env.disk.pins == {env.key(5): 1}
    res = await env.store.lookup(env.ns, [H[9]], "r")  # no hit still ends the old lease
    assert res.num_hit == 0 and res.tiers == [] and res.slots == []
    assert env.store.stats().leases_active == 0
    await settled(env)


async def test_repeating_a_lookup_keeps_one_pin_per_chunk(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    for _ in range(3):  # the same chunks again: the new lease takes the old one's pins over
        res = env.store.lookup_now(env.ns, [H[0], H[1]], "r")
        assert res is not None and res.num_hit == 2
        assert env.pins(0) == 1 and env.pins(1) == 1
    await env.store.lookup(env.ns, [H[0], H[1]], "r")
    assert env.pins(0) == 1 and env.pins(1) == 1 and env.store.stats().leases_active == 1
    env.store.lookup_now(env.ns, [H[0]], "r")  # fewer chunks: the dropped one is unpinned
    assert env.pins(0) == 1 and env.pins(1) == 0
    await env.store.release("r")
    await settled(env)


async def test_a_repeated_lookup_answers_with_the_slots_the_chunks_have_now(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()

    def slots_now() -> list[SlotRef | None]:
        return [env.store.cpu.get(env.key(0)), env.store.cpu.get(env.key(1))]

    first = env.store.lookup_now(env.ns, [H[0], H[1]], "r")
    assert first is not None and list(first.slots) == slots_now()
    again = env.store.lookup_now(env.ns, [H[0], H[1]], "r2", replaces="r")  # takes the pins over
    assert again is not None and list(again.slots) == slots_now()
    # Chunk 1 deleted while leased and stored again: a new slot, which the next lookup names.
    await env.store.delete(env.ns, [H[1]])
    await env.save([1])
    await env.store.flush()
    assert env.store.cpu.get(env.key(1)) != again.slots[1]
    third = env.store.lookup_now(env.ns, [H[0], H[1]], "r3", replaces="r2")
    assert third is not None and third.num_hit == 2 and list(third.slots) == slots_now()
    await env.store.release("r3")
    await settled(env)


async def test_a_lookup_ends_the_lease_it_replaces(make) -> None:
    env = await make()
    await env.save([0, 1, 2])
    await env.store.flush()
    env.disk.data[env.key(5)] = payload(H[5])
    await env.store.lookup(env.ns, [H[0], H[1]], "a")
    # The same chunks under a new id: the pins move over, one per chunk, and "a" is gone.
    res = env.store.lookup_now(env.ns, [H[0], H[1]], "b", replaces="a")
    assert res is not None and res.num_hit == 2
    assert env.pins(0) == 1 and env.pins(1) == 1 and env.store.stats().leases_active == 1
    await env.store.release("a")  # ended already: nothing left to end
    assert env.pins(0) == 1 and env.pins(1) == 1
    # Other chunks: the new ones are pinned, the replaced lease's are let go.
    env.store.lookup_now(env.ns, [H[2]], "c", replaces="b")
    assert (env.pins(0), env.pins(1), env.pins(2)) == (0, 0, 1)
    # A lower-tier hit (the lookup that must wait) replaces as well.
    await env.store.lookup(env.ns, [H[5]], "d", replaces="c")
    assert env.pins(2) == 0 and env.disk.pins == {env.key(5): 1}
    assert env.store.stats().leases_active == 1
    # A miss takes no lease and still ends the one it replaces, on either path.
    res = await env.store.lookup(env.ns, [H[9]], "e", replaces="d")
    assert res.num_hit == 0 and env.disk.pins == {} and env.store.stats().leases_active == 0
    env.store.lookup_now(env.ns, [H[0]], "f")
    assert env.store.lookup_now(env.ns, [H[9]], "g", replaces="f") is None  # a lower tier may have it
    assert env.pins(0) == 1  # declined: nothing changed
    await env.store.lookup(env.ns, [H[9]], "g", replaces="f")
    assert env.pins(0) == 0 and env.store.stats().leases_active == 0
    await settled(env)


async def test_a_lookup_that_replaces_its_own_lease_keeps_it(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    env.store.lookup_now(env.ns, [H[0]], "a")
    env.store.lookup_now(env.ns, [H[0]], "a", replaces="a")
    assert env.pins(0) == 1 and env.store.stats().leases_active == 1
    await env.store.release("a")
    await settled(env)


async def test_taken_over_pins_make_chunks_recent_when_the_last_lease_lets_go(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    env.store.lookup_now(env.ns, [H[0]], "a")
    env.store.lookup_now(env.ns, [H[1]], "x")
    env.store.lookup_now(env.ns, [H[0]], "b", replaces="a")  # 0's pin moves over, no release yet
    await env.store.release("x")
    await env.store.release("b")  # 0 is the most recently used now, then 1
    slots = await env.store.reserve(env.ns, [H[4], H[5]])
    assert None not in slots and env.key(0) in env.store.cpu and env.key(1) in env.store.cpu
    await env.store.abort([s for s in slots if s is not None])


async def test_a_chunk_is_recent_when_its_lease_lets_go(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    env.store.lookup_now(env.ns, [H[0]], "a")
    env.store.lookup_now(env.ns, [H[1]], "b")
    await env.store.release("b")
    await env.store.release("a")  # in use until now: 0 is the most recently used, then 1
    slots = await env.store.reserve(env.ns, [H[4], H[5]])
    assert None not in slots and env.key(2) not in env.store.cpu and env.key(3) not in env.store.cpu
    assert env.key(0) in env.store.cpu and env.key(1) in env.store.cpu
    last = await env.store.reserve(env.ns, [H[6]])
    assert last[0] is not None
    assert env.key(1) not in env.store.cpu and env.key(0) in env.store.cpu
    await env.store.abort([s for s in slots + last if s is not None])


async def test_lease_expiry_unpins_everything(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    env.disk.data[env.key(1)] = payload(H[1])
    await env.store.lookup(env.ns, [H[0], H[1]], "r")
    assert env.pins(0) == 1 and env.disk.pins
    env.clock.now += 10.5
    assert env.store.stats().leases_active == 0
    assert await env.store.stage("r") == StageResult([], [], [])
    await settled(env)


async def test_cancelled_lookup_keeps_no_pins(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    env.disk.delay = 30.0
    task = asyncio.create_task(env.store.lookup(env.ns, [H[0], H[1]], "r"))
    await until(lambda: bool(env.disk.contains_calls))
    assert env.pins(0) == 1  # held while the lower tiers are asked
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.pins(0) == 0 and env.store.stats().leases_active == 0


async def test_failing_tiers_degrade_to_misses(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    env.disk.data[env.key(1)] = payload(H[1])
    env.disk.fail = True
    env.redis.raise_errors = True
    res = await env.store.lookup(env.ns, [H[0], H[1]], "r")
    assert res.num_hit == 1 and res.tiers == [Tier.CPU]
    await env.store.release("r")


# -------------------------------------------------------------------------------- stage
async def test_stage_promotes_lower_hits_into_the_cpu_tier(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    env.redis.data[env.key(1)] = payload(H[1])
    res = await env.store.lookup(env.ns, [H[0], H[1]], "r")
    assert res.tiers == [Tier.DISK, Tier.REDIS]
    staged = await env.store.stage("r")
    assert staged.failed == [] and staged.tiers == [Tier.DISK, Tier.REDIS]
    assert [env.read(s) for s in staged.slots] == [payload(H[0]), payload(H[1])]
    assert env.pins(0) == 1 and env.pins(1) == 1  # the lease now holds the CPU copies
    assert not env.disk.pins and not env.redis.pins
    assert await env.store.stage("r") == staged  # nothing read twice
    assert env.disk.gets == [env.key(0)] and env.redis.gets == [env.key(1)]
    await env.store.release("r")
    again = await env.store.lookup(env.ns, [H[0], H[1]], "r2")
    assert again.tiers == [Tier.CPU, Tier.CPU]
    await env.store.release("r2")
    await settled(env)
    assert env.disk.puts == [] and env.redis.puts == []  # promoted chunks are not written back


async def test_stage_reports_exactly_the_chunks_lost_after_lookup(make) -> None:
    env = await make()
    for i in range(4):
        env.disk.data[env.key(i)] = payload(H[i])
    res = await env.store.lookup(env.ns, H[:4], "r")
    assert res.num_hit == 4
    env.disk.lose(env.key(1))
    env.disk.corrupt(env.key(2))
    staged = await env.store.stage("r")
    assert staged.failed == [1, 2]
    assert staged.slots[1] is None and staged.slots[2] is None
    assert env.read(staged.slots[0]) == payload(H[0])
    assert env.read(staged.slots[3]) == payload(H[3])
    assert not env.disk.pins  # failed ones unpinned, staged ones moved to the CPU tier
    assert env.disk.stats().errors == {"corrupt": 1}
    assert env.store.stats().slots_in_use == 2  # no slot left behind by the failures
    await env.store.release("r")
    await settled(env)


async def test_stage_with_a_full_arena_fails_the_chunk(make) -> None:
    env = await make(chunks=2)
    await env.save([0, 1])
    await env.store.flush()
    await env.store.lookup(env.ns, [H[0], H[1]], "a")
    env.disk.data[env.key(2)] = payload(H[2])
    await env.store.lookup(env.ns, [H[2]], "b")
    staged = await env.store.stage("b")
    assert staged.failed == [0] and staged.slots == [None]
    assert env.store.stats().tiers["cpu"].errors == {"full": 1}
    await env.store.release("a")
    await env.store.release("b")
    await settled(env)


async def test_concurrent_stages_read_a_chunk_once(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    env.disk.delay = 0.02
    await env.store.lookup(env.ns, [H[0]], "a")
    await env.store.lookup(env.ns, [H[0]], "b")
    a, b = await asyncio.gather(env.store.stage("a"), env.store.stage("b"))
    assert a.slots == b.slots and a.failed == b.failed == []
    assert env.disk.gets == [env.key(0)] and env.pins(0) == 2
    await env.store.release("a")
    await env.store.release("b")
    await settled(env)


async def test_cancelled_stage_still_settles_its_slot(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    env.disk.data[env.key(1)] = payload(H[1])
    gate = env.disk.get_gate = asyncio.Event()
    await env.store.lookup(env.ns, [H[0]], "a")
    task = asyncio.create_task(env.store.stage("a"))
    await until(lambda: bool(env.disk.gets))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await until(lambda: env.key(0) in env.store.cpu)
    assert env.pins(0) == 1 and not env.disk.pins  # the live lease got the promoted copy
    # A lease released while its read runs: the chunk lands unpinned, nothing is leaked.
    gate.clear()
    await env.store.lookup(env.ns, [H[1]], "b")
    task = asyncio.create_task(env.store.stage("b"))
    await until(lambda: len(env.disk.gets) == 2)
    await env.store.release("b")
    gate.set()
    assert await task == StageResult([], [], [])
    assert env.pins(1) == 0
    await env.store.release("a")
    await settled(env)
    assert env.store.stats().slots_in_use == 2


# -------------------------------------------------------------------------------- reserve / commit
async def test_reserve_dedups_against_cpu_and_reservations(make) -> None:
    env = await make()
    await env.save([0])
    slots = await env.store.reserve(env.ns, [H[0], H[1], H[1]])
    assert slots[0] is None and slots[1] is not None and slots[2] is None
    assert await env.store.reserve(env.ns, [H[1]]) == [None]  # reserved, not yet committed
    await env.store.abort([slots[1]])
    again = await env.store.reserve(env.ns, [H[1]])
    assert again[0] is not None
    await env.store.abort([again[0]])
    assert env.store.stats().reserve_dropped == 0  # duplicates are not drops


async def test_commit_and_abort_reject_bad_slots_without_side_effects(make) -> None:
    env = await make()
    s0, s1 = await env.store.reserve(env.ns, [H[0], H[1]])
    assert s0 is not None and s1 is not None
    with pytest.raises(SlotStateError):
        await env.store.commit(env.ns, [H[0], H[1]], [s1, s0])  # swapped
    with pytest.raises(SlotStateError):
        await env.store.commit(env.ns, [H[0]], [SlotRef(s0.offset, s0.length + 1)])
    with pytest.raises(SlotStateError):
        await env.store.commit(env.ns, [H[0], H[0]], [s0, s0])
    with pytest.raises(ValueError):
        await env.store.commit(env.ns, [H[0]], [])
    assert len(env.store.cpu) == 0
    await env.store.abort([s1])
    with pytest.raises(SlotStateError):
        await env.store.abort([s1])
    with pytest.raises(SlotStateError):
        await env.store.commit(env.ns, [H[1]], [s1])
    await env.store.commit(env.ns, [H[0]], [s0])
    with pytest.raises(SlotStateError):
        await env.store.commit(env.ns, [H[0]], [s0])
    assert env.store.stats().slots_in_use == 1


async def test_two_namespaces_of_different_sizes_share_the_budget(make) -> None:
    env = await make(chunks=4)
    big = await env.store.register(BIG)
    assert BIG.chunk_bytes == 2 * CHUNK
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    assert await env.save([10], ns=big, n=BIG.chunk_bytes) == [True]
    cpu = env.store.stats().tiers["cpu"]
    assert cpu.evictions == 2 and cpu.chunks == 3 and cpu.bytes == 4 * CHUNK
    assert env.key(0) not in env.store.cpu and env.key(1) not in env.store.cpu  # LRU went first
    assert (await env.store.lookup(env.ns, [H[0]], "x")).tiers == [Tier.DISK]  # written through
    await env.store.release("x")
    res = await env.store.lookup(big, [H[10]], "y")
    assert res.num_hit == 1 and env.read(res.slots[0]) == payload(H[10], BIG.chunk_bytes)
    await env.store.release("y")
    assert env.store.stats().namespaces == 2


# -------------------------------------------------------------------------------- write policy
async def test_write_through_pins_queued_chunks_until_written(make) -> None:
    env = await make(chunks=2)
    gate = env.disk.put_gate = asyncio.Event()
    await env.save([0, 1])
    assert env.store.stats().write_queue_depth == 2
    assert await env.store.reserve(env.ns, [H[2]]) == [None]  # queued chunks are not evicted
    assert env.store.stats().reserve_dropped == 1
    gate.set()
    assert await env.store.flush(2.0)
    assert set(env.disk.data) == set(env.redis.data) == {env.key(0), env.key(1)}
    slot = (await env.store.reserve(env.ns, [H[2]]))[0]
    assert slot is not None
    await env.store.abort([slot])


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
    await env.store.lookup(env.ns, [H[2]], "r")  # a hit retries the dropped write
    await env.store.release("r")
    assert await env.store.flush(2.0)
    assert env.key(2) in env.disk.data
    await settled(env)


async def test_on_reuse_writes_on_first_hit_only(make) -> None:
    env = await make(write_policy="on_reuse")
    await env.save([0])
    assert await env.store.flush(2.0)
    assert env.disk.puts == []
    await env.store.lookup(env.ns, [H[0]], "r")
    await env.store.lookup(env.ns, [H[0]], "r")
    await env.store.release("r")
    assert await env.store.flush(2.0)
    assert env.disk.puts == [env.key(0)] and env.redis.puts == [env.key(0)]
    await settled(env)


# ---------------------------------------------------------------------------- delete, clear, stats
async def test_delete_reaches_every_tier_and_spares_leased_slots(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    env.disk.data[env.key(1)] = payload(H[1])
    res = await env.store.lookup(env.ns, [H[0]], "r")
    assert await env.store.delete(env.ns, [H[0], H[1], H[9]]) == 2
    assert env.key(0) not in env.store.cpu
    assert not env.disk.data and not env.redis.data
    assert env.read(res.slots[0]) == payload(H[0])  # the lease's slot is not reused
    assert env.store.stats().slots_in_use == 1
    await env.store.release("r")
    assert env.store.stats().slots_in_use == 0


async def test_delete_during_promotion_does_not_resurrect(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    gate = env.disk.get_gate = asyncio.Event()
    await env.store.lookup(env.ns, [H[0]], "r")
    task = asyncio.create_task(env.store.stage("r"))
    await until(lambda: bool(env.disk.gets))
    env.disk.get_gate = None
    assert await env.store.delete(env.ns, [H[0]]) == 1
    gate.set()
    staged = await task
    assert staged.failed == [0] and env.key(0) not in env.store.cpu
    await env.store.release("r")
    await settled(env)
    assert env.store.stats().slots_in_use == 0


async def test_clear_drops_unleased_chunks(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    await env.store.lookup(env.ns, [H[0]], "r")
    assert await env.store.clear([Tier.CPU]) == 1
    assert env.key(0) in env.store.cpu and env.key(1) not in env.store.cpu
    assert await env.store.clear([Tier.DISK]) == 2
    assert not env.disk.data and len(env.redis.data) == 2
    await env.store.release("r")


async def test_stats_per_tier(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.lookup(env.ns, [H[0], H[1], H[2]], "r")
    stats = env.store.stats()
    assert set(stats.tiers) == {"cpu", "disk", "redis"}
    cpu = stats.tiers["cpu"]
    assert (cpu.hits, cpu.misses, cpu.stores, cpu.chunks, cpu.bytes) == (1, 1, 1, 1, CHUNK)
    assert cpu.capacity == 4 * CHUNK
    assert stats.slots_in_use == 1 and stats.slots_total_bytes == CHUNK
    assert stats.leases_active == 1 and stats.namespaces == 1
    await env.store.release("r")


# -------------------------------------------------------------------------------- close
async def test_close_drains_writes_and_releases_everything(make) -> None:
    env = await make()
    env.disk.delay = 0.02
    await env.save([0])
    await env.store.lookup(env.ns, [H[0]], "r")
    env.client.close()
    await env.store.close(drain_timeout=2.0)
    assert env.key(0) in env.disk.data  # drained before the tiers closed
    assert env.disk.closed and env.redis.closed
    assert not exists(env.path)
    await env.store.close()
    with pytest.raises(StorageError):
        await env.store.lookup(env.ns, [H[0]], "r")


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
        ns = await store.register(SPEC)
        info = store.arena_info()
        assert Path(info.path).parent == tmp_path and info.size == 1 << 20
        slots = await store.reserve(ns, [H[0]])
        assert slots[0] is not None
        await store.commit(ns, [H[0]], [slots[0]])
        assert (await store.lookup(ns, [H[0]], "r")).num_hit == 1
        assert store.lower == []
    assert listing(tmp_path) == []


async def test_build_store_with_the_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    pytest.importorskip("kvtier.storage.tiers.disk")
    (tmp_path / "shm").mkdir()
    extra = {"shm_dir": str(tmp_path / "shm"), "cpu_size": "1MiB", "disk_path": str(tmp_path / "d")}
    settings = load_settings(extra, env={})
    async with await build_store(storage_config(settings)) as store:
        ns = await store.register(SPEC)
        slots = await store.reserve(ns, H[:2])
        client = ArenaMapping.open(store.arena_info())
        for h, slot in zip(H[:2], slots, strict=True):
            assert slot is not None
            client.view(slot)[:] = payload(h)
        await store.commit(ns, H[:2], [s for s in slots if s is not None])
        assert await store.flush(5.0)
        client.close()
    async with await build_store(storage_config(settings)) as store:  # a fresh arena: only the disk remembers
        ns = await store.register(SPEC)
        res = await store.lookup(ns, H[:3], "r")
        assert res.num_hit == 2 and res.tiers == [Tier.DISK, Tier.DISK]
        staged = await store.stage("r")
        assert staged.failed == []
        client = ArenaMapping.open(store.arena_info())
        assert [bytes(client.view(s)) for s in staged.slots if s] == [payload(h) for h in H[:2]]
        client.close()
    assert listing(tmp_path / "shm") == []
