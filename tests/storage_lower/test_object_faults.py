"""Object tier under faults, against a real S3 server: killed and restarted, slow, 503 SlowDown and
500s, denied writes, and objects damaged between a lookup and its stage (exact failed chunks)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest

from kvtier.storage.arena import Arena
from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.breaker import CircuitBreaker
from kvtier.storage.config import ObjectConfig, StoreConfig
from kvtier.storage.keys import namespace_id
from kvtier.storage.store import TieredStore
from kvtier.storage.tiers.object import ObjectTier
from kvtier.storage.tiers.object_client import build_store
from kvtier.storage.tiers.object_index import object_path
from tests.storage.fakes import FakeTier
from tests.storage.store_env import SPEC, Clock, answer, payload
from tests.support.object_store import S3FaultProxy, SeaweedServer

CHUNK = SPEC.chunk_bytes
NS = namespace_id(SPEC)


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, bytes([i + 1]) * 16)


def data(i: int) -> memoryview:
    return memoryview(payload(key(i).prefix_hash, CHUNK))


def config(endpoint: str, prefix: str, **overrides: Any) -> ObjectConfig:
    base: dict[str, Any] = {
        "url": f"s3://kvtier-test/{prefix}",
        "endpoint": endpoint,
        "timeout": 5.0,
        "refresh_period": 3600.0,
        "retries": 2,
        "backoff": 0.01,
        "breaker_period": 1.0,
    }
    base.update(overrides)
    return ObjectConfig(**base)


@pytest.fixture
def proxy(s3_server: SeaweedServer) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(s3_server.port) as p:
        yield p


@pytest.fixture
async def proxied(proxy: S3FaultProxy, aws_env: dict[str, str]) -> AsyncIterator[ObjectTier]:
    tier = ObjectTier(config(proxy.endpoint, f"f-{uuid.uuid4().hex[:12]}", timeout=30.0))
    await tier.start()
    await tier.wait_listed()
    try:
        yield tier
    finally:
        await tier.close()


async def put_all(tier: ObjectTier, idx: list[int]) -> None:
    for i in idx:
        assert await tier.put(key(i), data(i))
    await tier.settle()


async def test_a_killed_store_is_a_miss_and_serves_again_once_restarted(
    s3_server_fn: SeaweedServer, aws_env: dict[str, str]
) -> None:
    clock = Clock()
    cfg = config(s3_server_fn.endpoint, "kill", retries=0, timeout=20.0)
    tier = ObjectTier(cfg, breaker=CircuitBreaker(cfg.breaker_period, clock=clock))
    await tier.start()
    try:
        await tier.wait_listed()
        await put_all(tier, [0])
        s3_server_fn.kill()
        dest = memoryview(bytearray(CHUNK))
        assert not await tier.get_into(key(0), dest)
        down = dict(tier.stats().errors)
        # A refused connection, or a pooled one the dead server never answers: one failure either way.
        assert sum(down.get(k, 0) for k in ("connection", "timeout")) == 1
        assert tier.stats().misses == 1 and not tier.stats().healthy
        assert await tier.contains_many([key(0)]) == [False]  # down: lookups miss at once
        unavailable = down.get("unavailable", 0)
        assert not await tier.put(key(1), data(1))
        assert tier.stats().errors.get("unavailable", 0) == unavailable + 1
        s3_server_fn.restart()  # SeaweedFS may lose what it took just before a SIGKILL: write anew
        clock.now += cfg.breaker_period
        assert await tier.put(key(1), data(1))  # the breaker's probe call
        await tier.settle()
        assert tier.stats().healthy and await tier.contains_many([key(1)]) == [True]
        assert await tier.get_into(key(1), dest)
        assert bytes(dest) == bytes(data(1))
        assert tier.stats().hits == 1
    finally:
        await tier.close()


async def test_a_slow_store_never_holds_a_lookup_and_a_load_times_out_into_a_miss(
    proxy: S3FaultProxy, aws_env: dict[str, str]
) -> None:
    prefix = f"slow-{uuid.uuid4().hex[:8]}"
    writer = ObjectTier(config(proxy.endpoint, prefix, timeout=30.0))  # a first write may grow volumes
    await writer.start()
    await put_all(writer, [0])
    await writer.close()
    tier = ObjectTier(config(proxy.endpoint, prefix, timeout=1.0, retries=0))
    await tier.start()
    try:
        await tier.wait_listed()
        proxy.hang()
        lookup = tier.contains_many([key(0), key(1)])
        with pytest.raises(StopIteration) as answered:
            lookup.send(None)  # answered without yielding to the loop once: no request made
        assert answered.value.value == [True, False]
        assert not await tier.get_into(key(0), memoryview(bytearray(CHUNK)))
        assert tier.stats().errors == {"timeout": 1}
        assert tier.stats().misses == 1
    finally:
        proxy.hang(False)
        await tier.close()


async def test_slowdown_is_retried_with_backoff_then_served(proxied: ObjectTier, proxy: S3FaultProxy) -> None:
    await put_all(proxied, [0])
    proxy.fail(503, "SlowDown", times=2, method="GET")
    dest = memoryview(bytearray(CHUNK))
    assert await proxied.get_into(key(0), dest)
    assert bytes(dest) == bytes(data(0))
    assert (proxy.count("GET", 503), proxy.count("GET", 200, path=NS)) == (2, 1)
    assert proxied.stats().errors == {}


async def test_500s_past_the_retries_are_a_counted_miss(proxied: ObjectTier, proxy: S3FaultProxy) -> None:
    await put_all(proxied, [0])
    proxy.fail(500, "InternalError", times=3, method="GET")
    assert not await proxied.get_into(key(0), memoryview(bytearray(CHUNK)))
    assert proxy.count("GET", 500, path=NS) == 3  # the call and its 2 retries
    assert proxied.stats().errors == {"server_error": 1}
    assert proxied.stats().misses == 1


async def test_a_denied_write_is_counted_and_the_other_tiers_keep_the_chunk(
    proxy: S3FaultProxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    proxy.fail(403, "AccessDenied", times=1, method="PUT")
    tier = ObjectTier(config(proxy.endpoint, f"deny-{uuid.uuid4().hex[:8]}", timeout=30.0))
    await tier.start()
    disk = FakeTier(Tier.DISK)
    arena = Arena.create(str(tmp_path), 1 << 20)
    tiers: list[Any] = [disk, tier]  # FakeTier's put takes no block hashes
    store = TieredStore(arena, tiers, StoreConfig())
    try:
        ns = store.register(SPEC)
        (slot,) = store.reserve(ns, [key(0).prefix_hash])
        assert slot is not None
        view = arena.view(slot)
        view[:] = data(0)
        view.release()
        store.commit(ns, [key(0).prefix_hash], [slot])
        assert await store.flush(5.0)
        await tier.settle()
        assert bytes(disk.data[key(0)]) == bytes(data(0))  # the disk tier wrote it as ever
        assert tier.stats().errors == {"denied": 1} and tier.stats().stores == 0
        assert tier.stats().healthy  # the store answered: reads may still be allowed
        assert await tier.contains_many([key(0)]) == [False]
    finally:
        await store.close()


@pytest.mark.parametrize("damage", ["bitflip", "truncate"])
async def test_objects_damaged_between_lookup_and_stage_fail_exactly_their_chunks(
    s3_server: SeaweedServer, aws_env: dict[str, str], tmp_path: Path, damage: str
) -> None:
    prefix = f"stage-{uuid.uuid4().hex[:8]}"
    tier = ObjectTier(config(s3_server.endpoint, prefix, timeout=30.0))
    await tier.start()
    store = TieredStore(Arena.create(str(tmp_path), 1 << 20), [tier], StoreConfig())
    try:
        ns = store.register(SPEC)
        await put_all(tier, [0, 1, 2])
        hashes = [key(i).prefix_hash for i in range(3)]
        found = await answer(store.lookup(ns, hashes, "lease"))
        assert (found.num_hit, found.tiers) == (3, [Tier.OBJECT] * 3)
        raw = build_store(config(s3_server.endpoint, prefix))
        blob = bytearray(await (await obstore.get_async(raw, object_path(key(1)))).bytes_async())
        if damage == "bitflip":
            blob[-100] ^= 0x01
        else:
            blob = blob[: len(blob) // 2]
        await obstore.put_async(raw, object_path(key(1)), bytes(blob))
        staged = await store.stage("lease")
        assert staged.failed == [1]
        assert [s is not None for s in staged.slots] == [True, False, True]
        assert tier.stats().errors == {"corrupt": 1}
        assert (tier.stats().hits, tier.stats().misses) == (2, 1)
    finally:
        await store.close()
