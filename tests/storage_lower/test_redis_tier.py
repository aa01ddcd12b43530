"""Redis tier: fakeredis for tier logic, a real redis-server for the raw fast path, TTL, auth and faults."""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fakeredis
import pytest
import redis

from kvtier.app.settings import KVTierSettings, storage_config
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, ClearableTier, LowerTier, Tier
from kvtier.storage.breaker import CircuitBreaker
from kvtier.storage.config import RedisConfig
from kvtier.storage.keys import redis_key
from kvtier.storage.tiers import redis_wire
from kvtier.storage.tiers.redis import RedisTier, client_url
from kvtier.storage.tiers.redis_wire import (
    RawConnection,
)
from tests.support.redis_fixtures import TEST_PASSWORD
from tests.support.redis_server import RedisServer, make_tls_files
from tests.support.skips import missing

NS = "aabbccddeeff0011"
CHUNK = 64 * 1024  # payload() repeats a 4 KiB pattern
F = TypeVar("F", bound=Callable[..., Any])


def needs_redis(test: F) -> F:
    """A test of a real redis-server: marked `redis`; without one installed, the suite's skip policy
    (need_redis: skipped, failed under CI) applies, as to every test of a redis fixture."""
    return pytest.mark.redis(pytest.mark.usefixtures("redis_installed")(test))  # type: ignore[no-any-return]


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(8, "big"))


def payload(i: int, size: int = CHUNK) -> memoryview:
    return memoryview(random.Random(i).randbytes(4096) * (size // 4096))


def make_settings(url: str, **kw: object) -> RedisConfig:
    """The Redis tier's config as the service builds it from these settings."""
    config = storage_config(KVTierSettings(redis_url=url, **kw)).redis  # type: ignore[arg-type]
    assert config is not None
    return config


async def read(tier: RedisTier, k: ChunkKey, size: int = CHUNK) -> bytes | None:
    dest = bytearray(size)
    return bytes(dest) if await tier.get_into(k, memoryview(dest)) else None


# ---------------------------------------------------------------------------------------------- fakeredis
@pytest.fixture
def fake() -> fakeredis.FakeAsyncRedis:
    return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())


def fake_tier(client: fakeredis.FakeAsyncRedis, **kw: object) -> RedisTier:
    return RedisTier(make_settings("redis://127.0.0.1:1/0", **kw), client=client)


async def test_fake_round_trip_ttl_and_protocol(fake: fakeredis.FakeAsyncRedis) -> None:
    tier = fake_tier(fake, redis_ttl=50)
    assert isinstance(tier, LowerTier) and tier.tier is Tier.REDIS and not tier.fast_path
    await tier.start()
    data = payload(1)
    assert await tier.put(key(1), data)
    assert await tier.contains_many([key(1), key(2)]) == [True, False]
    assert await tier.contains_many([]) == []
    assert await read(tier, key(1)) == bytes(data)
    assert await read(tier, key(2)) is None
    assert 0 < await fake.ttl(redis_key(key(1))) <= 50
    stored = await fake.get(redis_key(key(1)))
    assert bytes(codec.decode(stored, key(1))) == bytes(data)  # one value: header + payload
    stats = tier.stats()
    assert (stats.stores, stats.hits, stats.misses, stats.errors) == (1, 1, 1, {})
    await tier.close()


async def test_fake_no_ttl_when_zero(fake: fakeredis.FakeAsyncRedis) -> None:
    tier = fake_tier(fake, redis_ttl=0)
    assert await tier.put(key(1), payload(1))
    assert await fake.ttl(redis_key(key(1))) == -1


async def test_fake_corrupt_value_is_counted_and_removed(fake: fakeredis.FakeAsyncRedis) -> None:
    tier = fake_tier(fake)
    assert await tier.put(key(1), payload(1))
    blob = bytearray(await fake.get(redis_key(key(1))))
    blob[-5] ^= 0x40
    await fake.set(redis_key(key(1)), bytes(blob))
    await fake.set(redis_key(key(2)), b"not a blob")
    await fake.set(redis_key(key(3)), codec.encode(key(4), bytes(payload(4))))  # foreign key echo
    for i in (1, 2, 3):
        assert await read(tier, key(i)) is None
    assert tier.stats().errors == {"corrupt": 3}
    assert await fake.exists(redis_key(key(1)), redis_key(key(2)), redis_key(key(3))) == 0


async def test_fake_length_mismatch_keeps_value(fake: fakeredis.FakeAsyncRedis) -> None:
    tier = fake_tier(fake)
    assert await tier.put(key(1), payload(1))
    assert await read(tier, key(1), size=CHUNK // 2) is None
    assert tier.stats().errors == {"length_mismatch": 1}
    assert await read(tier, key(1)) is not None


async def test_fake_pinned_delete_is_deferred(fake: fakeredis.FakeAsyncRedis) -> None:
    tier = fake_tier(fake)
    assert await tier.put(key(1), payload(1))
    assert await tier.put(key(2), payload(2))
    tier.pin([key(1)])
    await tier.delete(key(1))
    await tier.delete(key(2))
    assert await tier.contains_many([key(1), key(2)]) == [False, False]
    assert await read(tier, key(1)) is not None  # the lease still stages it
    assert await fake.exists(redis_key(key(1))) == 1
    tier.unpin([key(1)])
    tier.unpin([key(1)])  # an extra unpin is ignored
    await tier.close()  # waits for the deferred unlink
    assert await fake.exists(redis_key(key(1)), redis_key(key(2))) == 0


async def test_fake_put_revives_doomed_key(fake: fakeredis.FakeAsyncRedis) -> None:
    tier = fake_tier(fake)
    assert await tier.put(key(1), payload(1))
    tier.pin([key(1)])
    await tier.delete(key(1))
    assert await tier.put(key(1), payload(1))
    tier.unpin([key(1)])
    await tier.close()
    assert await fake.exists(redis_key(key(1))) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_fake_dead_server_trips_breaker_once_per_period() -> None:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeAsyncRedis(server=server)
    clock = Clock()
    tier = RedisTier(
        make_settings("redis://127.0.0.1:1/0"),
        client=client,
        breaker=CircuitBreaker(5.0, clock=clock),
    )
    assert await tier.put(key(1), payload(1))
    server.connected = False
    for _ in range(5):
        assert await read(tier, key(1)) is None
        assert await tier.contains_many([key(1)]) == [False]
        assert not await tier.put(key(2), payload(2))
    errors = tier.stats().errors
    assert errors == {"connection": 1, "unavailable": 14}
    assert not tier.stats().healthy
    clock.now += 5.0
    assert not await tier.put(key(2), payload(2))  # the probe fails: open for another period
    assert tier.stats().errors["connection"] == 2
    server.connected = True
    assert await read(tier, key(1)) is None  # still open
    clock.now += 5.0
    assert await read(tier, key(1)) is not None  # probe succeeds: closed again
    assert tier.stats().healthy
    assert await tier.put(key(2), payload(2))


async def test_fake_clear_drops_unpinned_kvtier_keys_only(fake: fakeredis.FakeAsyncRedis) -> None:
    tier = fake_tier(fake)
    for i in range(7):
        assert await tier.put(key(i), payload(i, size=4096))
    await fake.set("someone-else", b"x")
    tier.pin([key(3)])
    assert isinstance(tier, ClearableTier)
    assert await tier.clear() == 6
    assert await tier.contains_many([key(i) for i in range(7)]) == [i == 3 for i in range(7)]
    assert await fake.exists("someone-else") == 1


def test_cluster_url_translation() -> None:
    assert client_url("redis+cluster://h:7000") == "redis://h:7000"
    assert client_url("rediss+cluster://u:p@h:7000/0") == "rediss://u:p@h:7000/0"
    assert client_url("redis://h:1/2") == "redis://h:1/2"
    assert make_settings("redis+cluster://h:7000").cluster
    assert make_settings("redis://h:7000", redis_cluster=True).cluster
    assert not make_settings("redis://h:7000").cluster


def test_tls_url_uses_redis_asyncio() -> None:
    assert not RedisTier(make_settings("rediss://:pw@127.0.0.1:6380/0")).fast_path


# ---------------------------------------------------------------------------------------------- real server
@pytest.fixture
async def tier(redis_server: RedisServer) -> RedisTier:
    redis_server.command("FLUSHALL")
    t = RedisTier(make_settings(redis_server.url, redis_pool_size=4, redis_ttl=100))
    await t.start()
    yield t  # type: ignore[misc]
    await t.close()


@needs_redis
async def test_fast_path_round_trip_parallel(tier: RedisTier, redis_server: RedisServer) -> None:
    assert tier.fast_path and tier.stats().healthy
    datas = [payload(i) for i in range(12)]
    assert all(await asyncio.gather(*(tier.put(key(i), d) for i, d in enumerate(datas))))
    dests = [bytearray(CHUNK) for _ in datas]
    got = await asyncio.gather(*(tier.get_into(key(i), memoryview(d)) for i, d in enumerate(dests)))
    assert all(got) and [bytes(d) for d in dests] == [bytes(d) for d in datas]
    assert await tier.contains_many([key(0), key(11), key(12)]) == [True, True, False]
    assert await read(tier, key(12)) is None
    ttl = int(redis_server.command("TTL", redis_key(key(0))).strip(b":\r\n"))
    assert 0 < ttl <= 100
    await tier.delete(key(0))
    assert await tier.contains_many([key(0)]) == [False]
    stats = tier.stats()
    assert (stats.stores, stats.hits, stats.misses, stats.errors) == (12, 12, 1, {})


@needs_redis
async def test_new_connections_send_no_setup_commands(redis_server: RedisServer) -> None:
    """A connection's first command is the tier's own: no CLIENT SETINFO round trip before it."""
    redis_server.command("FLUSHALL")  # the server is shared: earlier tests' keys would be hits
    redis_server.command("CONFIG", "RESETSTAT")
    t = RedisTier(make_settings(redis_server.url, redis_pool_size=4))
    try:
        await t.start()
        assert await asyncio.gather(*(t.contains_many([key(i)]) for i in range(4))) == [[False]] * 4
        assert await t.put(key(0), payload(0))
        assert await read(t, key(0)) == bytes(payload(0))
    finally:
        await t.close()
    # A server before 7.2 refuses SETINFO (an error, not a call): both sections are checked.
    stats = redis_server.command("INFO", "commandstats").decode()
    errors = redis_server.command("INFO", "errorstats").decode()
    assert "cmdstat_exists:" in stats and "cmdstat_set:" in stats, stats
    assert "cmdstat_client|setinfo" not in stats, stats
    assert "errorstat_" not in errors, errors


@needs_redis
async def test_fast_path_no_ttl_and_big_values(tier: RedisTier, redis_server: RedisServer) -> None:
    tier.ttl = 0
    big = payload(3, size=3 << 20)
    assert await tier.put(key(3), big)
    assert redis_server.command("TTL", redis_key(key(3))) == b":-1\r\n"
    assert await read(tier, key(3), size=3 << 20) == bytes(big)


@pytest.fixture(params=["whole", "sliced"])
def read_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """whole: CHUNK-sized values are read by one GET; sliced: by 4 KiB GETRANGE slices, 3 in flight."""
    if request.param == "sliced":
        monkeypatch.setattr(redis_wire, "RANGE_PIECE", 4096)
        monkeypatch.setattr(redis_wire, "WINDOW_PIECES", 3)
    return str(request.param)


@needs_redis
async def test_fast_path_bad_values_keep_connection_in_sync(
    tier: RedisTier, redis_server: RedisServer, read_mode: str
) -> None:
    r = redis.Redis(port=redis_server.port)
    try:
        assert await tier.put(key(1), payload(1))
        blob = bytearray(r.get(redis_key(key(1))) or b"")
        blob[-100] ^= 1
        r.set(redis_key(key(1)), bytes(blob))  # payload bit flip
        r.set(redis_key(key(2)), b"x" * 10)  # shorter than any header
        r.set(redis_key(key(3)), codec.encode(key(3), b"y" * 100))  # valid, other length
        r.set(redis_key(key(4)), b"z" * (codec.header_size(key(4)) + CHUNK))  # right size, junk
        r.rpush(redis_key(key(6)), b"a list")  # WRONGTYPE: the server answers an error
        for i in (1, 2, 3, 4, 6, 7):
            assert await read(tier, key(i)) is None
        assert tier.stats().errors == {"corrupt": 3, "length_mismatch": 1, "server_error": 1}
        assert tier.stats().misses == 6 and tier.stats().healthy
        assert r.exists(redis_key(key(1)), redis_key(key(2)), redis_key(key(4))) == 0
        assert r.exists(redis_key(key(3)), redis_key(key(6))) == 2
        assert await tier.put(key(5), payload(5))  # the raw connections are still in sync
        assert await read(tier, key(5)) == bytes(payload(5))
    finally:
        r.close()


@needs_redis
@pytest.mark.parametrize("replacement", ["same_size", "shorter"])
async def test_value_replaced_between_slices_is_read_again_atomically(
    tier: RedisTier, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, replacement: str
) -> None:
    monkeypatch.setattr(redis_wire, "RANGE_PIECE", 4096)
    monkeypatch.setattr(redis_wire, "WINDOW_PIECES", 1)
    new_payload = payload(2, size=CHUNK if replacement == "same_size" else CHUNK // 2)
    r = redis.Redis(port=redis_server.port)
    original = RawConnection._read_into
    replaced = threading.Event()

    def read_into_then_replace(conn: RawConnection, dest: memoryview) -> None:
        original(conn, dest)
        if not replaced.is_set():  # after the first slice, before the later ones are asked for
            replaced.set()
            r.set(redis_key(key(1)), codec.encode(key(1), bytes(new_payload)))

    try:
        assert await tier.put(key(1), payload(1))
        monkeypatch.setattr(RawConnection, "_read_into", read_into_then_replace)
        r.config_resetstat()
        got = await read(tier, key(1))
        assert replaced.is_set()
        stats = r.info("commandstats")
        assert isinstance(stats, dict) and stats["cmdstat_exec"]["calls"] == 2  # streamed, then atomic
        if replacement == "same_size":
            assert got == bytes(new_payload)  # the torn read was not taken for corruption
            assert tier.stats().errors == {}
        else:
            assert got is None and tier.stats().errors == {"length_mismatch": 1}
        assert r.exists(redis_key(key(1))) == 1  # a good value is never unlinked
    finally:
        r.close()


@needs_redis
async def test_refused_transactions_fall_back_to_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_wire, "RANGE_PIECE", 4096)
    with RedisServer(extra_args=("--rename-command", "MULTI", "")) as server:
        tier = RedisTier(make_settings(server.url, redis_pool_size=1))
        assert await tier.put(key(1), payload(1))
        for _ in range(2):  # the second read goes straight to GET
            assert await read(tier, key(1)) == bytes(payload(1))
        assert tier.stats().errors == {}
        await tier.close()
    with RedisServer() as server:
        server.command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", "-getrange")
        tier = RedisTier(make_settings(f"redis://kv:pw@127.0.0.1:{server.port}/0"))
        assert await tier.put(key(1), payload(1))
        assert await read(tier, key(1)) == bytes(payload(1))
        assert tier.stats().errors == {}
        await tier.close()
        assert b"cmdstat_get:calls=1," in server.command("INFO", "commandstats")


@needs_redis
async def test_password_auth_and_db_select(redis_server_auth: RedisServer) -> None:
    url = f"redis://:{TEST_PASSWORD}@127.0.0.1:{redis_server_auth.port}/3"
    tier = RedisTier(make_settings(url))
    await tier.start()
    assert tier.fast_path
    assert await tier.put(key(1), payload(1))
    assert await read(tier, key(1)) == bytes(payload(1))
    assert await tier.contains_many([key(1)]) == [True]
    r = redis.Redis(port=redis_server_auth.port, password=TEST_PASSWORD, db=3)
    assert r.exists(redis_key(key(1))) == 1
    r.close()
    await tier.close()


@needs_redis
async def test_wrong_password_is_a_miss_and_never_logged(
    redis_server_auth: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "wrong-" + TEST_PASSWORD
    tier = RedisTier(make_settings(f"redis://:{secret}@127.0.0.1:{redis_server_auth.port}/0"))
    with caplog.at_level(logging.DEBUG):
        await tier.start()
        assert not await tier.put(key(1), payload(1))
        assert await read(tier, key(1)) is None
    assert tier.stats().error_total >= 2 and not tier.stats().healthy
    assert secret not in caplog.text and "***" in caplog.text
    assert secret not in tier.url_for_logs
    await tier.close()


@needs_redis
async def test_unix_socket_fast_path(tmp_path: Path) -> None:
    sock = str(tmp_path / "redis.sock")
    with RedisServer(extra_args=("--unixsocket", sock, "--unixsocketperm", "700")) as server:
        tier = RedisTier(make_settings(f"unix://{sock}?db=2"))
        await tier.start()
        assert tier.fast_path
        assert await tier.put(key(1), payload(1))
        assert await read(tier, key(1)) == bytes(payload(1))
        assert server.command("SELECT", "2")  # smoke: the server is there
        await tier.close()


@needs_redis
async def test_tls_via_redis_asyncio(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        missing("openssl is not installed (it makes the test's TLS certificates)")
    tls = await asyncio.to_thread(make_tls_files, str(tmp_path))
    with RedisServer(tls=tls, password=TEST_PASSWORD) as server:
        assert server.url.startswith("rediss://")
        tier = RedisTier(make_settings(server.url))
        await tier.start()
        assert not tier.fast_path and tier.stats().healthy
        assert await tier.put(key(1), payload(1))
        assert await read(tier, key(1)) == bytes(payload(1))
        assert await tier.contains_many([key(1), key(2)]) == [True, False]
        assert tier.stats().errors == {}
        await tier.close()


def _bytes_waiting_at(port: int) -> int:
    """Bytes received and not yet read by the server's end of loopback TCP connections on port."""
    waiting = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] == "01":  # ESTABLISHED
                    waiting += int(fields[4].split(":")[1], 16)
    return waiting


@needs_redis
async def test_cancelled_get_leaves_tier_usable(redis_server_fn: RedisServer) -> None:
    tier = RedisTier(make_settings(redis_server_fn.url, redis_timeout=5.0))
    big = payload(9, size=4 << 20)
    assert await tier.put(key(9), big)
    dest = bytearray(4 << 20)
    assert redis_server_fn.proc is not None
    redis_server_fn.proc.send_signal(signal.SIGSTOP)  # the GET is surely in flight when cancelled
    try:
        task = asyncio.create_task(tier.get_into(key(9), memoryview(dest)))
        for _ in range(500):  # until the GET's bytes wait in the stopped server's socket
            if _bytes_waiting_at(redis_server_fn.port):
                break
            await asyncio.sleep(0.01)
        assert _bytes_waiting_at(redis_server_fn.port), "the GET never reached the server"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        redis_server_fn.proc.send_signal(signal.SIGCONT)
    assert tier.stats().healthy and not tier.stats().errors  # a cancel is not a backend failure
    assert await read(tier, key(9), size=4 << 20) == bytes(big)
    await tier.close()


@needs_redis
async def test_stalled_server_costs_one_timeout_per_period(redis_server_fn: RedisServer) -> None:
    # The budget is spent once, while the server is stopped; before that the put must not time out
    # on a busy machine, so it is not tight.
    tier = RedisTier(make_settings(redis_server_fn.url, redis_timeout=1.0, breaker_period=60))
    await tier.start()
    assert await tier.put(key(1), payload(1))
    assert redis_server_fn.proc is not None
    redis_server_fn.proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(5):
            assert await read(tier, key(1)) is None
            assert await tier.contains_many([key(1)]) == [False]
        assert tier.stats().errors == {"timeout": 1, "unavailable": 9}
    finally:
        redis_server_fn.proc.send_signal(signal.SIGCONT)
    await tier.close()


@needs_redis
async def test_kill_during_loop_then_serves_again(redis_server_fn: RedisServer) -> None:
    period = 8.0
    clock = Clock()  # the breaker's: stepped by hand, an eighth of a period per round
    # A killed server refuses at once: no call here waits for the timeout, which is generous so that
    # a busy machine cannot turn a live server's reply into a failure.
    config = make_settings(redis_server_fn.url, redis_timeout=5.0, breaker_period=period)
    tier = RedisTier(config, breaker=CircuitBreaker(period, clock=clock))
    await tier.start()
    outcomes: list[bool] = []
    for i in range(40):
        if i == 15:
            redis_server_fn.kill()
        data = payload(i)
        stored = await tier.put(key(i), data)
        outcomes.append(stored and await read(tier, key(i)) == bytes(data))
        await tier.contains_many([key(i)])
        clock.now += period / 8
    assert all(outcomes[:15]) and not any(outcomes[15:])
    # The put of round 15 finds the server gone and opens the breaker; the puts of rounds 23, 31 and
    # 39, a period later each, are its probes and fail too. Every other call of rounds 15 to 39 is
    # refused without touching the server.
    assert tier.stats().errors == {"connection": 4, "unavailable": 2 * 25 - 4}
    assert not tier.stats().healthy

    redis_server_fn.restart()
    clock.now += period  # one breaker period: the next call is the probe and must succeed
    assert await tier.put(key(100), payload(100))
    assert await read(tier, key(100)) == bytes(payload(100))
    assert await tier.contains_many([key(100)]) == [True]
    assert tier.stats().healthy
    await tier.close()
