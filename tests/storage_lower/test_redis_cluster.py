"""Redis tier against a real Redis Cluster: basic behaviour, lookups split per shard, and failover.

The failover tests hold the dead primary's replica back (cluster-replica-no-failover) while they check
the outage, so what the tier answers then does not depend on how fast the cluster reacts; then they let
the replica take over and wait (bounded) until the tier serves the promoted shard.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import pytest

from kvtier.storage.base import ChunkKey
from kvtier.storage.config import RedisConfig
from kvtier.storage.keys import redis_key
from kvtier.storage.tiers.redis import RedisTier
from tests.support import redis_fixtures
from tests.support.redis_fixtures import need_redis, replicated_cluster
from tests.support.redis_server import RedisClusterServers

# No skipif here: the fixtures skip when redis-server is missing, or fail when CI is set.
pytestmark = pytest.mark.redis
NS = "c1c2c3c4c5c6c7c8"
CHUNK = 32 * 1024
T = TypeVar("T")


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(8, "big"))


def payload(i: int) -> memoryview:
    return memoryview(random.Random(i).randbytes(4096) * (CHUNK // 4096))


@pytest.fixture
async def tier(redis_cluster: RedisClusterServers) -> AsyncIterator[RedisTier]:
    # A generous call timeout: these tests are about the cluster, not timeouts (test_redis_tier and
    # the fault tests cover those), and a host stall over the 1 s default (seen in CI) would open
    # the breaker and fail a put here.
    t = RedisTier(RedisConfig(redis_cluster.url, cluster=True, ttl=100, timeout=10.0))
    await t.start()
    yield t
    await t.close()


async def read(tier: RedisTier, k: ChunkKey) -> bytes | None:
    dest = bytearray(CHUNK)
    return bytes(dest) if await tier.get_into(k, memoryview(dest)) else None


async def test_cluster_round_trip(tier: RedisTier) -> None:
    assert tier.is_cluster and not tier.fast_path and tier.stats().healthy
    keys = [key(i) for i in range(30)]
    assert all(await asyncio.gather(*(tier.put(k, payload(i)) for i, k in enumerate(keys))))
    got = await asyncio.gather(*(read(tier, k) for k in keys))
    assert got == [bytes(payload(i)) for i in range(30)]
    assert await read(tier, key(999)) is None
    await tier.delete(key(0))
    assert await tier.contains_many([key(0), key(1)]) == [False, True]
    stats = tier.stats()
    assert (stats.stores, stats.hits, stats.misses, stats.errors) == (30, 30, 1, {})


async def test_cluster_lookups_split_per_shard(
    tier: RedisTier, redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [key(1000 + i) for i in range(60)]
    for i, k in enumerate(keys[::2]):
        assert await tier.put(k, payload(i))
    names = [redis_key(k) for k in keys]
    groups = await tier.shard_groups(names)
    assert len(groups) == 3  # 60 keys land on every one of the 3 primaries
    assert sorted(i for g in groups.values() for i in g) == list(range(60))
    for node, group in groups.items():  # each group is exactly the keys of its node
        assert {redis_cluster.primary_for_key(names[i]).port for i in group} == {int(node.split(":")[1])}

    batches: list[int] = []
    original = RedisTier._exists_batch

    async def spy(client: object, batch: list[str]) -> list[bool]:
        batches.append(len(batch))
        return await original(client, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(RedisTier, "_exists_batch", staticmethod(spy))
    found = await tier.contains_many(keys)
    assert found == [i % 2 == 0 for i in range(60)]
    assert sorted(batches) == sorted(len(g) for g in groups.values())  # one pipeline per shard


async def test_cluster_pins_ttl_and_corruption(tier: RedisTier) -> None:
    assert await tier.put(key(2000), payload(1))
    client = tier._client
    assert 0 < await client.ttl(redis_key(key(2000))) <= 100
    tier.pin([key(2000)])
    await tier.delete(key(2000))
    assert await tier.contains_many([key(2000)]) == [False]
    assert await read(tier, key(2000)) == bytes(payload(1))
    tier.unpin([key(2000)])
    await asyncio.sleep(0)
    await client.set(redis_key(key(2001)), b"garbage")
    assert await read(tier, key(2001)) is None
    assert tier.stats().errors == {"corrupt": 1}
    assert await client.exists(redis_key(key(2001))) == 0


async def test_cluster_clear(tier: RedisTier) -> None:
    keys = [key(3000 + i) for i in range(12)]
    for i, k in enumerate(keys):
        assert await tier.put(k, payload(i))
    tier.pin([keys[0]])
    dropped = await tier.clear()
    assert dropped >= 11  # other tests' leftovers in the shared cluster may go too
    assert await tier.contains_many(keys) == [True] + [False] * 11
    tier.unpin([keys[0]])


async def test_cluster_follows_a_moved_slot(tier: RedisTier, redis_cluster: RedisClusterServers) -> None:
    """A slot resharded to another primary: the old one answers MOVED, the client follows it and
    learns the slot's new home; nothing is counted as an error."""
    k = key(5000)
    name = redis_key(k)
    assert await tier.put(k, payload(5))
    source = redis_cluster.primary_for_key(name)
    target = next(n for n in redis_cluster.primary_nodes() if n is not source)
    redis_cluster.move_slot(name, target)
    assert await read(tier, k) == bytes(payload(5))
    assert await tier.contains_many([k]) == [True]
    assert list(await tier.shard_groups([name])) == [f"127.0.0.1:{target.port}"]
    assert tier.stats().errors == {}


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_missing_redis_server_fails_under_ci_and_skips_elsewhere(
    ci: str, outcome: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_fixtures, "have_redis_server", lambda: False)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="redis-server is not installed"):
        need_redis()


# ------------------------------------------------------------------------------------------ failover
# The call timeout of the failover tests: the hung primary costs it once; calls to live nodes stay far
# within it even on a loaded machine, so the outage's error counts are exact.
FAILOVER_CALL_TIMEOUT = 3.0
N_KEYS = 60


async def bounded(call: Awaitable[T]) -> T:
    """Await a tier call, failing the test if it hangs past the tier's own limits (route + call)."""
    async with asyncio.timeout(4 * FAILOVER_CALL_TIMEOUT):
        return await call


async def wait_served(tier: RedisTier, k: ChunkKey, expected: bytes) -> None:
    """Read k until it comes back as expected (the tier found the promoted shard), 600 tries at most.

    Polled: the tier learns of the failover from the cluster, and nothing here can be waited on."""
    for _ in range(600):  # 30 s or more
        if await read(tier, k) == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{k} was not served again after 600 tries: {tier.stats()}")


@pytest.mark.parametrize(
    ("how", "full_coverage"),
    [
        pytest.param("kill", False, id="killed-primary"),
        pytest.param("hang", False, id="hung-primary"),
        pytest.param("kill", True, id="killed-primary-full-coverage"),
    ],
)
async def test_failover_dead_shard_is_a_miss_then_the_promoted_replica_serves(
    how: str, full_coverage: bool
) -> None:
    """A dead or hung primary: its keys are counted misses at once, the other shards serve on (or,
    under Redis's default full coverage, answer CLUSTERDOWN: misses too, no breaker opened); after the
    cluster promotes its replica, every key written before the kill is served again, long before the
    dead node's breaker period ends (600 s here: only the slot map following the failover helps)."""
    with replicated_cluster(full_coverage) as cluster:
        config = RedisConfig(
            cluster.url, cluster=True, ttl=100, timeout=FAILOVER_CALL_TIMEOUT, breaker_period=600
        )
        tier = RedisTier(config)
        await tier.start()
        try:
            keys = [key(4000 + i) for i in range(N_KEYS)]
            assert all(await asyncio.gather(*(tier.put(k, payload(i)) for i, k in enumerate(keys))))
            cluster.wait_synced()  # every key is on its primary's replica too
            names = [redis_key(k) for k in keys]
            victim = cluster.primary_for_key(names[0])
            (replica,) = cluster.replicas_of(victim)
            on_victim = [cluster.primary_for_key(n) is victim for n in names]
            cluster.allow_failover(replica, False)
            (cluster.kill if how == "kill" else cluster.hang)(victim)
            cluster.wait_failed(victim, "fail" if full_coverage else "ok")

            # The outage: no replica takes over yet.
            serving = [not v and not full_coverage for v in on_victim]
            assert await bounded(tier.contains_many(keys)) == serving
            got = [await bounded(read(tier, k)) for k in keys]
            assert got == [bytes(payload(i)) if serving[i] else None for i in range(N_KEYS)]
            assert await bounded(tier.put(keys[0], payload(0))) is False
            dead = sum(on_victim)
            expected = {"connection" if how == "kill" else "timeout": 1, "unavailable": dead + 1}
            if full_coverage:  # each live shard's EXISTS pipeline, then every read of its keys
                expected["cluster"] = 2 + N_KEYS - dead
            stats = tier.stats()
            assert (stats.errors, stats.healthy) == (expected, False)

            # The replica takes over: the tier follows the slot map there.
            cluster.allow_failover(replica, True)
            assert cluster.wait_failover(victim) is replica
            await wait_served(tier, keys[0], bytes(payload(0)))
            assert await tier.contains_many(keys) == [True] * N_KEYS
            got = [await read(tier, k) for k in keys]
            assert got == [bytes(payload(i)) for i in range(N_KEYS)]
            assert await tier.put(keys[0], payload(7)) and await read(tier, keys[0]) == bytes(payload(7))
            assert cluster.primary_for_key(names[0]) is replica
            assert tier.stats().healthy
        finally:
            await tier.close()
