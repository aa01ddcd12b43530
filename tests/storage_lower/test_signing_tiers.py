"""Signed shared tiers against real servers: an attacker's well-formed chunk is a counted forgery,
not loaded and deleted with keys set; without keys the same chunk loads (the negative control)."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import obstore
import pytest
import redis

from kvtier.storage import codec
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import ObjectConfig, RedisConfig
from kvtier.storage.keys import redis_key
from kvtier.storage.signing import Signer
from kvtier.storage.tiers.object import ObjectTier
from kvtier.storage.tiers.object_client import build_store
from kvtier.storage.tiers.object_index import object_path
from kvtier.storage.tiers.redis import RedisTier
from kvtier.storage.tiers.redis_wire import RANGE_PIECE
from tests.support.object_store import SeaweedServer
from tests.support.redis_server import RedisServer

NS = "aabbccddeeff0011"
VICTIM, ATTACKER = Signer([b"v" * 32]), Signer([b"a" * 32])
SMALL, LARGE = 64 * 1024, 3 * RANGE_PIECE  # one GET; GETRANGE slices


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(8, "big"))


def forged_blob(how: str, k: ChunkKey, data: bytes) -> bytes:
    """What an attacker with write access stores: unsigned with a valid checksum, signed with its
    own key, or the victim's signed chunk of another key with the echo rewritten."""
    if how == "unsigned":
        return codec.encode(k, data)
    if how == "other_key":
        return codec.encode(k, data, signer=ATTACKER)
    good = codec.encode(key(999), data, signer=VICTIM)
    header = codec.parse_header(good)
    echo = f"{k.namespace}:".encode() + k.prefix_hash
    import struct

    import xxhash

    fixed = struct.pack(
        "<4sHHIQQ", codec.MAGIC, codec.SIGNED_VERSION, 0, len(echo), len(data), header.checksum
    )
    sig = header.key_id + header.tag
    return fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed + echo + sig)) + echo + sig + data


# ------------------------------------------------------------------------------------------------ Redis
def redis_tier(server: RedisServer, signer: Signer | None, fast_path: bool = True) -> RedisTier:
    return RedisTier(RedisConfig(url=server.url, pool_size=2, ttl=0), signer=signer, fast_path=fast_path)


@pytest.mark.redis
@pytest.mark.parametrize("size", [SMALL, LARGE])
@pytest.mark.parametrize("how", ["unsigned", "other_key", "borrowed"])
@pytest.mark.parametrize("fast_path", [True, False])
async def test_redis_forgery_is_counted_not_loaded_and_deleted(
    redis_server: RedisServer, size: int, how: str, fast_path: bool, caplog: pytest.LogCaptureFixture
) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    raw.flushall()
    data = os.urandom(size)
    raw.set(redis_key(key(1)), forged_blob(how, key(1), data))
    tier = redis_tier(redis_server, VICTIM, fast_path)
    try:
        dest = bytearray(size)
        with caplog.at_level(logging.WARNING, logger="kvtier.redis"):
            assert not await tier.get_into(key(1), memoryview(dest))
        assert tier.stats().errors == {"forged": 1}
        assert raw.exists(redis_key(key(1))) == 0
        # Distinct lines: a record reaches pytest twice where an earlier test routed kvtier's lines to vLLM.
        assert sorted({r.getMessage() for r in caplog.records if "forged" in r.getMessage()}) == [
            f"redis {redis_server.url}: {key(1)} failed its MAC check (forged); deleted"
        ]
    finally:
        await tier.close()
        raw.close()
    if how == "unsigned":  # negative control: without keys the same chunk IS loaded
        raw = redis.Redis.from_url(redis_server.url)
        raw.set(redis_key(key(1)), forged_blob(how, key(1), data))
        plain = redis_tier(redis_server, None, fast_path)
        try:
            dest = bytearray(size)
            assert await plain.get_into(key(1), memoryview(dest))
            assert bytes(dest) == data and plain.stats().errors == {}
        finally:
            await plain.close()
            raw.close()


@pytest.mark.redis
@pytest.mark.parametrize("size", [SMALL, LARGE])
@pytest.mark.parametrize("fast_path", [True, False])
async def test_redis_signed_round_trip_rotation_and_keyless_reads(
    redis_server: RedisServer, size: int, fast_path: bool
) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    data = os.urandom(size)
    old = redis_tier(redis_server, VICTIM, fast_path)
    rotated = redis_tier(redis_server, Signer([b"n" * 32, b"v" * 32]), fast_path)
    keyless = redis_tier(redis_server, None, fast_path)
    try:
        assert await old.put(key(1), memoryview(data))
        for reader in (old, rotated, keyless):  # keyless: a signed chunk reads on its checksum
            dest = bytearray(size)
            assert await reader.get_into(key(1), memoryview(dest)) and bytes(dest) == data
            assert reader.stats().errors == {}
        assert await rotated.put(key(2), memoryview(data))
        assert not await old.get_into(key(2), memoryview(bytearray(size)))  # not yet given the new key
        assert old.stats().errors == {"forged": 1}
    finally:
        for t in (old, rotated, keyless):
            await t.close()


# ------------------------------------------------------------------------------------------------ objects
def object_config(endpoint: str, prefix: str) -> ObjectConfig:
    return ObjectConfig(
        url=f"s3://kvtier-test/{prefix}", endpoint=endpoint, timeout=30.0, refresh_period=3600.0, backoff=0.01
    )


@pytest.mark.parametrize("how", ["unsigned", "other_key", "borrowed"])
async def test_object_forgery_is_counted_not_loaded_and_deleted(
    s3_server: SeaweedServer, aws_env: dict[str, str], how: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    cfg = object_config(s3_server.endpoint, prefix)
    store: Any = build_store(cfg)
    data = os.urandom(256 * 1024)
    await obstore.put_async(store, object_path(key(1)), forged_blob(how, key(1), data))
    tier = ObjectTier(cfg, signer=VICTIM)
    await tier.start()
    try:
        await tier.wait_listed()
        assert await tier.contains_many([key(1)]) == [True]
        with caplog.at_level(logging.WARNING, logger="kvtier.object"):
            assert not await tier.get_into(key(1), memoryview(bytearray(len(data))))
        assert tier.stats().errors == {"forged": 1}
        assert await tier.contains_many([key(1)]) == [False]
        with pytest.raises(FileNotFoundError):
            await obstore.head_async(store, object_path(key(1)))
        assert (
            len(
                {
                    r.getMessage()
                    for r in caplog.records
                    if "forged" in r.getMessage() and str(key(1)) in r.getMessage()
                }
            )
            == 1  # distinct lines, as above
        )
    finally:
        await tier.close()
    if how == "unsigned":  # negative control: without keys the same object IS loaded
        await obstore.put_async(store, object_path(key(1)), forged_blob(how, key(1), data))
        plain = ObjectTier(cfg)
        await plain.start()
        try:
            await plain.wait_listed()
            dest = bytearray(len(data))
            assert await plain.get_into(key(1), memoryview(dest)) and bytes(dest) == data
            assert plain.stats().errors == {}
        finally:
            await plain.close()


async def test_object_signed_round_trip(s3_server: SeaweedServer, aws_env: dict[str, str]) -> None:
    cfg = object_config(s3_server.endpoint, f"t-{uuid.uuid4().hex[:12]}")
    writer, reader = ObjectTier(cfg, signer=VICTIM), ObjectTier(cfg, signer=Signer([b"n" * 32, b"v" * 32]))
    data = os.urandom(256 * 1024)
    for t in (writer, reader):
        await t.start()
    try:
        assert await writer.put(key(1), memoryview(data), [b"block-a"])
        await writer.settle()
        await reader.refresh()
        dest = bytearray(len(data))
        assert await reader.get_into(key(1), memoryview(dest)) and bytes(dest) == data
        assert reader.stats().errors == {}
    finally:
        for t in (writer, reader):
            await t.close()
