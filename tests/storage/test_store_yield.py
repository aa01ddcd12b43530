"""A save before a write-behind: queued lower-tier writes give their CPU slots to a reserve that
finds none; writes already running, and chunks a lease holds, keep theirs."""

from __future__ import annotations

import asyncio

from tests.storage.store_env import Env, H, answer, settled, until


def queued_only(env: Env, chunks: list[int]) -> bool:
    """Every chunk is pinned once (its queued write) and no write has started."""
    return all(env.pins(i) == 1 for i in chunks) and env.disk.putting == env.redis.putting == 0


async def test_queued_writes_give_way_to_a_reserve(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    assert queued_only(env, [0, 1, 2, 3])  # the workers have not run yet: nothing has started
    assert env.store.stats().write_queue_depth == 4
    assert await env.save([4]) == [True]
    stats = env.store.stats()
    assert stats.writes_yielded == 1 and stats.reserve_dropped == 0 and stats.writes_dropped == 0
    assert not env.held(0) and all(env.held(i) for i in (1, 2, 3, 4))  # the oldest gave way
    assert stats.tiers["cpu"].evictions == 1 and stats.write_queue_depth == 4
    assert await env.save([5, 6]) == [True, True]  # one reserve of two: the next two oldest
    stats = env.store.stats()
    assert stats.writes_yielded == 3 and stats.reserve_dropped == 0
    assert [i for i in range(7) if env.held(i)] == [3, 4, 5, 6]
    assert await env.store.flush(2.0)
    for tier in (env.disk, env.redis):
        assert sorted(tier.puts) == sorted(env.key(i) for i in (3, 4, 5, 6))  # never written
    assert (await answer(env.store.lookup(env.ns, [H[0]], "r"))).num_hit == 0  # gone everywhere
    env.store.release("r")
    await settled(env)


async def test_a_running_write_is_not_interrupted(make) -> None:
    env = await make(chunks=2, write_workers=1)
    gate = env.disk.put_gate = asyncio.Event()
    await env.save([0])
    await until(lambda: env.disk.putting == 1)  # 0 is being written
    await env.save([1])  # queued behind it
    assert await env.save([2]) == [True]
    stats = env.store.stats()
    assert stats.writes_yielded == 1 and stats.reserve_dropped == 0
    assert env.held(0) and not env.held(1) and env.held(2)
    assert await env.save([3]) == [True]  # 2 gives way; 0 is still being written
    stats = env.store.stats()
    assert stats.writes_yielded == 2 and stats.reserve_dropped == 0
    assert env.held(0) and not env.held(2) and env.held(3) and env.disk.putting == 1
    gate.set()
    assert await env.store.flush(2.0)
    assert env.disk.puts == [env.key(0), env.key(3)]
    await settled(env)


async def test_leased_chunks_are_never_taken(make) -> None:
    env = await make(chunks=2)
    await env.save([0, 1])
    assert queued_only(env, [0, 1])
    assert (await answer(env.store.lookup(env.ns, [H[0]], "r"))).num_hit == 1
    assert env.pins(0) == 2 and queued_only(env, [1])
    assert await env.save([2]) == [True]  # 1 gives way, 0 is leased as well as queued
    assert env.held(0) and not env.held(1)
    assert env.store.stats().writes_yielded == 1
    assert (await answer(env.store.lookup(env.ns, [H[0], H[2]], "r"))).num_hit == 2
    assert await env.save([3]) == [False]  # every chunk leased: nothing gives way
    stats = env.store.stats()
    assert stats.writes_yielded == 1 and stats.reserve_dropped == 1
    env.store.release("r")
    assert await env.store.flush(2.0)
    assert env.key(0) in env.disk.data and env.key(2) in env.disk.data
    assert env.key(1) not in env.disk.data
    await settled(env)
