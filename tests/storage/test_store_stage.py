"""TieredStore.stage: promotion of lower-tier hits into CPU slots, shared reads, failures, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.storage.base import (
    StageResult,
    Tier,
)
from tests.storage.store_env import (
    H,
    answer,
    payload,
    settled,
    until,
)


# -------------------------------------------------------------------------------- stage
async def test_stage_promotes_lower_hits_into_the_cpu_tier(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    env.redis.data[env.key(1)] = payload(H[1])
    res = await answer(env.store.lookup(env.ns, [H[0], H[1]], "r"))
    assert res.tiers == [Tier.DISK, Tier.REDIS]
    staged = await env.store.stage("r")
    assert staged.failed == [] and staged.tiers == [Tier.DISK, Tier.REDIS]
    assert [env.read(s) for s in staged.slots] == [payload(H[0]), payload(H[1])]
    assert env.pins(0) == 1 and env.pins(1) == 1  # the lease now holds the CPU copies
    assert not env.disk.pins and not env.redis.pins
    assert await env.store.stage("r") == staged  # nothing read twice
    assert env.disk.gets == [env.key(0)] and env.redis.gets == [env.key(1)]
    env.store.release("r")
    again = await answer(env.store.lookup(env.ns, [H[0], H[1]], "r2"))
    assert again.tiers == [Tier.CPU, Tier.CPU]
    env.store.release("r2")
    await settled(env)
    assert env.disk.puts == [] and env.redis.puts == []  # promoted chunks are not written back


async def test_stage_reports_exactly_the_chunks_lost_after_lookup(make) -> None:
    env = await make()
    for i in range(4):
        env.disk.data[env.key(i)] = payload(H[i])
    res = await answer(env.store.lookup(env.ns, H[:4], "r"))
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
    env.store.release("r")
    await settled(env)


async def test_stage_with_a_full_arena_fails_the_chunk(make) -> None:
    env = await make(chunks=2)
    await env.save([0, 1])
    await env.store.flush()
    await answer(env.store.lookup(env.ns, [H[0], H[1]], "a"))
    env.disk.data[env.key(2)] = payload(H[2])
    await answer(env.store.lookup(env.ns, [H[2]], "b"))
    staged = await env.store.stage("b")
    assert staged.failed == [0] and staged.slots == [None]
    assert env.store.stats().tiers["cpu"].errors == {"full": 1}
    env.store.release("a")
    env.store.release("b")
    await settled(env)


async def test_concurrent_stages_read_a_chunk_once(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    env.disk.delay = 0.02
    await answer(env.store.lookup(env.ns, [H[0]], "a"))
    await answer(env.store.lookup(env.ns, [H[0]], "b"))
    a, b = await asyncio.gather(env.store.stage("a"), env.store.stage("b"))
    assert a.slots == b.slots and a.failed == b.failed == []
    assert env.disk.gets == [env.key(0)] and env.pins(0) == 2
    env.store.release("a")
    env.store.release("b")
    await settled(env)


async def test_cancelled_stage_still_settles_its_slot(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    env.disk.data[env.key(1)] = payload(H[1])
    gate = env.disk.get_gate = asyncio.Event()
    await answer(env.store.lookup(env.ns, [H[0]], "a"))
    task = asyncio.create_task(env.store.stage("a"))
    await until(lambda: bool(env.disk.gets))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await until(lambda: env.held(0))
    assert env.pins(0) == 1 and not env.disk.pins  # the live lease got the promoted copy
    # A lease released while its read runs: the chunk lands unpinned, nothing is leaked.
    gate.clear()
    await answer(env.store.lookup(env.ns, [H[1]], "b"))
    task = asyncio.create_task(env.store.stage("b"))
    await until(lambda: len(env.disk.gets) == 2)
    env.store.release("b")
    gate.set()
    assert await task == StageResult([], [], [])
    assert env.pins(1) == 0
    env.store.release("a")
    await settled(env)
    assert env.store.stats().slots_in_use == 2


async def test_delete_during_promotion_does_not_resurrect(make) -> None:
    env = await make()
    env.disk.data[env.key(0)] = payload(H[0])
    gate = env.disk.get_gate = asyncio.Event()
    await answer(env.store.lookup(env.ns, [H[0]], "r"))
    task = asyncio.create_task(env.store.stage("r"))
    await until(lambda: bool(env.disk.gets))
    env.disk.get_gate = None
    assert await env.store.delete(env.ns, [H[0]]) == 1
    gate.set()
    staged = await task
    assert staged.failed == [0] and not env.held(0)
    env.store.release("r")
    await settled(env)
    assert env.store.stats().slots_in_use == 0
