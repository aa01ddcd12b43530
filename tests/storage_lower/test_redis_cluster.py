"""Redis tier against a real 3-node Redis Cluster: basic behaviour, lookups split per shard."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.asyncio import RedisCluster

from kvtier.storage.base import ChunkKey
from kvtier.storage.config import RedisConfig
from kvtier.storage.keys import redis_key
from kvtier.storage.tiers.redis import RedisTier
from tests.support.redis_server import RedisClusterServers, have_redis_server

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="redis-server is not installed"),
]
NS = "c1c2c3c4c5c6c7c8"
CHUNK = 32 * 1024


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(8, "big"))


def payload(i: int) -> memoryview:
    return memoryview(random.Random(i).randbytes(4096) * (CHUNK // 4096))


@pytest.fixture
async def tier(redis_cluster: RedisClusterServers) -> RedisTier:
    # A generous call timeout: these tests are about the cluster, not timeouts (test_redis_tier and
    # the fault tests cover those), and a host stall over the 1 s default (seen in CI) would open
    # the breaker and fail a put here.
    t = RedisTier(RedisConfig(redis_cluster.url, cluster=True, ttl=100, timeout=10.0))
    await t.start()
    yield t  # type: ignore[misc]
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
    groups = tier.shard_groups(names)
    assert len(groups) == 3  # 60 keys land on every one of the 3 primaries
    assert sorted(i for g in groups for i in g) == list(range(60))
    client = tier._client
    assert isinstance(client, RedisCluster)
    for group in groups:  # each group is exactly the keys of one node
        assert len({client.get_node_from_key(names[i]).name for i in group}) == 1  # type: ignore[union-attr]

    batches: list[int] = []
    original = RedisTier._exists_batch

    async def spy(client: object, batch: list[str]) -> list[bool]:
        batches.append(len(batch))
        return await original(client, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(RedisTier, "_exists_batch", staticmethod(spy))
    found = await tier.contains_many(keys)
    assert found == [i % 2 == 0 for i in range(60)]
    assert sorted(batches) == sorted(len(g) for g in groups)  # one pipeline per shard


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
