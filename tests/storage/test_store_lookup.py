"""TieredStore lookups and their leases: prefixes across tiers, replacement, pins, recency, expiry."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.storage.base import (
    ArenaError,
    LookupResult,
    NamespaceSpec,
    SlotRef,
    StageResult,
    Tier,
    UnknownNamespaceError,
)
from tests.storage.store_env import (
    SPEC,
    H,
    answer,
    at_once,
    payload,
    settled,
    until,
)


# -------------------------------------------------------------------------------- namespaces
async def test_register_and_unknown_namespace(make) -> None:
    env = await make()
    assert env.store.register(SPEC) == env.ns
    with pytest.raises(UnknownNamespaceError):
        await answer(env.store.lookup("nope", [H[0]], "r"))
    with pytest.raises(UnknownNamespaceError):
        env.store.reserve("nope", [H[0]])
    with pytest.raises(UnknownNamespaceError):
        env.store.commit("nope", [], [])
    with pytest.raises(UnknownNamespaceError):
        await env.store.delete("nope", [H[0]])
    huge = NamespaceSpec("m", "bf16", "nhd", 16, 16, 64, 8192)
    with pytest.raises(ArenaError):
        env.store.register(huge)


# -------------------------------------------------------------------------------- lookup
async def test_cpu_hits_are_readable_by_a_client(make) -> None:
    env = await make()
    assert await env.save([0, 1]) == [True, True]
    res = await answer(env.store.lookup(env.ns, [H[0], H[1], H[2]], "r"))
    assert res.num_hit == 2 and res.tiers == [Tier.CPU, Tier.CPU]
    assert [env.read(s) for s in res.slots] == [payload(H[0]), payload(H[1])]
    assert env.store.stats().leases_active == 1
    env.store.release("r")
    env.store.release("r")  # idempotent
    await settled(env)


async def test_prefix_spans_tiers_with_one_batch_per_tier(make) -> None:
    env = await make()
    await env.save([0, 4])
    await env.store.flush()
    env.disk.data[env.key(1)] = payload(H[1])
    env.redis.data[env.key(2)] = payload(H[2])
    env.disk.contains_calls.clear()
    env.redis.contains_calls.clear()
    res = await answer(env.store.lookup(env.ns, H[:5], "r"))
    assert res.num_hit == 3
    assert res.tiers == [Tier.CPU, Tier.DISK, Tier.REDIS]
    assert res.slots[0] is not None and res.slots[1:] == [None, None]
    assert env.disk.contains_calls == [[env.key(1), env.key(2), env.key(3)]]
    assert env.redis.contains_calls == [[env.key(2), env.key(3)]]
    assert env.pins(0) == 1 and env.pins(4) == 0  # beyond the prefix: not held
    assert env.disk.pins == {env.key(1): 1} and env.redis.pins == {env.key(2): 1}
    env.store.release("r")
    await settled(env)


async def test_leased_chunks_survive_pressure(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    await answer(env.store.lookup(env.ns, [H[0]], "r"))
    slots = env.store.reserve(env.ns, H[4:8])
    assert [s is not None for s in slots] == [True, True, True, False]
    assert env.store.stats().reserve_dropped == 1
    assert env.held(0)
    env.store.release("r")
    assert (env.store.reserve(env.ns, [H[8]]))[0] is not None  # H0 may go now
    assert not env.held(0)
    env.store.abort([s for s in slots if s is not None])


async def test_lookup_answers_at_once_when_the_cpu_tier_decides(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    env.disk.contains_calls.clear()
    res = env.store.lookup(env.ns, [H[0], H[1]], "r")  # the answer itself: no Task needed
    assert isinstance(res, LookupResult) and res.num_hit == 2 and res.tiers == [Tier.CPU, Tier.CPU]
    assert [env.read(s) for s in res.slots] == [payload(H[0]), payload(H[1])]
    assert env.pins(0) == 1 and env.pins(1) == 1
    # A CPU miss may be a lower-tier hit: a coroutine, which changes nothing until it runs.
    pending = env.store.lookup(env.ns, [H[0], H[2]], "r2")
    assert not isinstance(pending, LookupResult)
    assert env.pins(0) == 1 and env.store.stats().leases_active == 1
    assert env.disk.contains_calls == []
    res = await pending
    assert res.num_hit == 1 and env.pins(0) == 2
    env.store.release("r")
    env.store.release("r2")
    await settled(env)


async def test_a_full_arena_drops_every_occurrence_of_a_hash(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    await answer(env.store.lookup(env.ns, H[:4], "r"))  # everything leased: nothing can be evicted
    assert env.store.reserve(env.ns, [H[5], H[5], H[6]]) == [None, None, None]
    assert env.store.stats().reserve_dropped == 3  # as when each was asked for one by one
    env.store.release("r")


async def test_repeated_lookup_replaces_the_lease(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    env.disk.data[env.key(5)] = payload(H[5])
    await answer(env.store.lookup(env.ns, [H[0]], "r"))
    await answer(env.store.lookup(env.ns, [H[1]], "r"))
    assert env.pins(0) == 0 and env.pins(1) == 1
    await answer(env.store.lookup(env.ns, [H[5]], "r"))
    assert env.pins(1) == 0 and env.disk.pins == {env.key(5): 1}
    res = await answer(env.store.lookup(env.ns, [H[9]], "r"))  # no hit still ends the old lease
    assert res.num_hit == 0 and res.tiers == [] and res.slots == []
    assert env.store.stats().leases_active == 0
    await settled(env)


async def test_repeating_a_lookup_keeps_one_pin_per_chunk(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()
    for _ in range(3):  # the same chunks again: the new lease takes the old one's pins over
        res = at_once(env.store.lookup(env.ns, [H[0], H[1]], "r"))
        assert res.num_hit == 2
        assert env.pins(0) == 1 and env.pins(1) == 1
    await answer(env.store.lookup(env.ns, [H[0], H[1]], "r"))
    assert env.pins(0) == 1 and env.pins(1) == 1 and env.store.stats().leases_active == 1
    at_once(env.store.lookup(env.ns, [H[0]], "r"))  # fewer chunks: the dropped one is unpinned
    assert env.pins(0) == 1 and env.pins(1) == 0
    env.store.release("r")
    await settled(env)


async def test_a_repeated_lookup_answers_with_the_slots_the_chunks_have_now(make) -> None:
    env = await make()
    await env.save([0, 1])
    await env.store.flush()

    def slots_now() -> list[SlotRef | None]:
        return [env.slot(0), env.slot(1)]

    first = at_once(env.store.lookup(env.ns, [H[0], H[1]], "r"))
    assert list(first.slots) == slots_now()
    again = at_once(env.store.lookup(env.ns, [H[0], H[1]], "r2", replaces="r"))  # takes the pins over
    assert list(again.slots) == slots_now()
    # Chunk 1 deleted while leased and stored again: a new slot, which the next lookup names.
    await env.store.delete(env.ns, [H[1]])
    await env.save([1])
    await env.store.flush()
    assert env.slot(1) != again.slots[1]
    third = at_once(env.store.lookup(env.ns, [H[0], H[1]], "r3", replaces="r2"))
    assert third.num_hit == 2 and list(third.slots) == slots_now()
    env.store.release("r3")
    await settled(env)


async def test_a_lookup_ends_the_lease_it_replaces(make) -> None:
    env = await make()
    await env.save([0, 1, 2])
    await env.store.flush()
    env.disk.data[env.key(5)] = payload(H[5])
    await answer(env.store.lookup(env.ns, [H[0], H[1]], "a"))
    # The same chunks under a new id: the pins move over, one per chunk, and "a" is gone.
    res = at_once(env.store.lookup(env.ns, [H[0], H[1]], "b", replaces="a"))
    assert res.num_hit == 2
    assert env.pins(0) == 1 and env.pins(1) == 1 and env.store.stats().leases_active == 1
    env.store.release("a")  # ended already: nothing left to end
    assert env.pins(0) == 1 and env.pins(1) == 1
    # Other chunks: the new ones are pinned, the replaced lease's are let go.
    at_once(env.store.lookup(env.ns, [H[2]], "c", replaces="b"))
    assert (env.pins(0), env.pins(1), env.pins(2)) == (0, 0, 1)
    # A lower-tier hit (the lookup that must wait) replaces as well.
    await answer(env.store.lookup(env.ns, [H[5]], "d", replaces="c"))
    assert env.pins(2) == 0 and env.disk.pins == {env.key(5): 1}
    assert env.store.stats().leases_active == 1
    # A miss takes no lease and still ends the one it replaces, on either path.
    res = await answer(env.store.lookup(env.ns, [H[9]], "e", replaces="d"))
    assert res.num_hit == 0 and env.disk.pins == {} and env.store.stats().leases_active == 0
    at_once(env.store.lookup(env.ns, [H[0]], "f"))
    pending = env.store.lookup(env.ns, [H[9]], "g", replaces="f")  # a lower tier may have it
    assert not isinstance(pending, LookupResult) and env.pins(0) == 1  # nothing changed yet
    await pending
    assert env.pins(0) == 0 and env.store.stats().leases_active == 0
    await settled(env)


async def test_a_lookup_that_replaces_its_own_lease_keeps_it(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    at_once(env.store.lookup(env.ns, [H[0]], "a"))
    at_once(env.store.lookup(env.ns, [H[0]], "a", replaces="a"))
    assert env.pins(0) == 1 and env.store.stats().leases_active == 1
    env.store.release("a")
    await settled(env)


async def test_taken_over_pins_make_chunks_recent_when_the_last_lease_lets_go(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    at_once(env.store.lookup(env.ns, [H[0]], "a"))
    at_once(env.store.lookup(env.ns, [H[1]], "x"))
    at_once(env.store.lookup(env.ns, [H[0]], "b", replaces="a"))  # 0's pin moves over, no release yet
    env.store.release("x")
    env.store.release("b")  # 0 is the most recently used now, then 1
    slots = env.store.reserve(env.ns, [H[4], H[5]])
    assert None not in slots and env.held(0) and env.held(1)
    env.store.abort([s for s in slots if s is not None])


async def test_a_chunk_is_recent_when_its_lease_lets_go(make) -> None:
    env = await make(chunks=4)
    await env.save([0, 1, 2, 3])
    await env.store.flush()
    at_once(env.store.lookup(env.ns, [H[0]], "a"))
    at_once(env.store.lookup(env.ns, [H[1]], "b"))
    env.store.release("b")
    env.store.release("a")  # in use until now: 0 and 1 are marked used, 2 and 3 are not
    slots = env.store.reserve(env.ns, [H[4], H[5]])
    assert None not in slots and not env.held(2) and not env.held(3)
    assert env.held(0) and env.held(1)
    # The clock's hand cleared 0's and 1's marks as it passed: a lease of 1 that lets go marks it
    # again, and 0, unused since, is the next to go.
    at_once(env.store.lookup(env.ns, [H[1]], "c"))
    env.store.release("c")
    last = env.store.reserve(env.ns, [H[6]])
    assert last[0] is not None
    assert not env.held(0) and env.held(1)
    env.store.abort([s for s in slots + last if s is not None])


async def test_lease_expiry_unpins_everything(make) -> None:
    env = await make()
    await env.save([0])
    await env.store.flush()
    env.disk.data[env.key(1)] = payload(H[1])
    await answer(env.store.lookup(env.ns, [H[0], H[1]], "r"))
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
    pending = env.store.lookup(env.ns, [H[0], H[1]], "r")
    assert not isinstance(pending, LookupResult)
    task = asyncio.create_task(pending)
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
    res = await answer(env.store.lookup(env.ns, [H[0], H[1]], "r"))
    assert res.num_hit == 1 and res.tiers == [Tier.CPU]
    env.store.release("r")
