"""Redis tier: one value per chunk (blob header + payload, one SET), shared by every kvtier that can reach it.

Paths:
- Single server over redis:// or unix:// (the common case): GET and SET go through RawPool, blocking
  sockets driven by worker threads that read replies straight into the caller's buffer (values over
  1 MiB as streamed GETRANGE slices, which spares the server a fresh buffer per reply) and send values
  without packing them (see redis_wire). EXISTS, UNLINK and everything else use redis.asyncio.
- TLS (rediss://), Redis Cluster (redis+cluster://, rediss+cluster:// or the redis_cluster setting) and an
  injected client (tests: fakeredis) use redis.asyncio for everything; a cluster lookup is split into
  one pipeline per shard, run concurrently.

Failures: every call runs under ``redis_timeout``; a timeout or connection failure trips the circuit
breaker, which refuses calls (counted as 'unavailable', answered as misses) until ``breaker_period``
passes and one probe call succeeds. So a dead Redis costs one timeout per period, and nothing raises.

Pins: Redis evicts by its own TTL (``redis_ttl``, EX on every SET) and maxmemory policy, which a client
cannot veto, so pins here only govern ``delete``: deleting a pinned key hides it from this tier's
lookups at once and removes it from Redis when the last pin is released, so a lease that already
counted the chunk can still stage it.

Who owns what: the event loop owns the pins, stats, breaker and idle-connection list; worker threads
own a raw connection only while running one command on it. The tier owns the clients it builds and
closes them in close(); an injected client stays the caller's to close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.exceptions as rexc
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.runtime.handoff import run_to_end, wait_done
from kvtier.storage import codec
from kvtier.storage.base import BlobError, ChunkKey, Tier, TierStats
from kvtier.storage.breaker import CircuitBreaker
from kvtier.storage.config import RedisConfig, redact_url
from kvtier.storage.keys import REDIS_PREFIX, redis_key
from kvtier.storage.tiers.pins import PinBook
from kvtier.storage.tiers.redis_wire import (
    GetOutcome,
    RawConnection,
    RawEndpoint,
    ServerReplyError,
)

log = logging.getLogger("kvtier.redis")
T = TypeVar("T")
RedisClient = Redis | RedisCluster
# Connections beyond the data-path pool, so lookups and deletes never queue behind large transfers.
_SPARE_CONNECTIONS = 4
_CLEAR_BATCH = 500
# Cluster errors that mean the cluster (not this one command) is unwell.
_CLUSTER_FAILURES = (rexc.ClusterDownError, rexc.TryAgainError, rexc.MovedError, rexc.AskError)


def client_url(url: str) -> str:
    """The URL redis-py understands: redis+cluster:// -> redis://, rediss+cluster:// -> rediss://."""
    parts = urlsplit(url)
    scheme = parts.scheme.replace("+cluster", "")
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))


def _parse_redis_key(name: str) -> ChunkKey | None:
    """The key a ``kvtier:<ns>:<hex>`` name stands for, or None when it is not one."""
    parts = name.split(":")
    if len(parts) != 3 or parts[0] != REDIS_PREFIX:
        return None
    try:
        return ChunkKey(parts[1], bytes.fromhex(parts[2]))
    except ValueError:
        return None


def failure_kind(exc: BaseException) -> tuple[str, bool]:
    """Stats label of a failed call and whether it says the backend is down (trips the breaker)."""
    if isinstance(exc, TimeoutError | rexc.TimeoutError):
        return "timeout", True
    if isinstance(exc, _CLUSTER_FAILURES):
        return "cluster", True
    if isinstance(exc, ServerReplyError | rexc.ResponseError | rexc.DataError):
        return "server_error", False  # the server answered: it is up, this one command failed
    if isinstance(exc, rexc.AuthenticationError | rexc.AuthorizationError):
        return "auth", True
    return "connection", True


def build_client(config: RedisConfig) -> RedisClient:
    """The redis.asyncio client for the config: a cluster client or a blocking-pool client."""
    common: dict[str, Any] = {
        "socket_timeout": config.timeout,
        "socket_connect_timeout": config.timeout,
        # The breaker is the retry policy: a client that retries would multiply the timeout.
        "retry": Retry(NoBackoff(), 0),
        # No CLIENT SETINFO: it costs every new connection a round trip before its first command
        # (often a lookup's EXISTS, on the request's path) for a label in CLIENT LIST.
        "lib_name": None,
        "lib_version": None,
    }
    max_conn = config.pool_size + _SPARE_CONNECTIONS
    url = client_url(config.url)
    if config.cluster:
        # The cluster client raises (rather than waits) when a node's pool is exhausted, which the
        # breaker would take for an outage: leave its per-node limit open; the tier's semaphore
        # bounds the large transfers and lookups take one connection per node each.
        return RedisCluster.from_url(url, **common)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_conn, timeout=config.timeout, **common)
    return Redis(connection_pool=pool)


class RawPool:
    """Up to ``size`` raw connections, each command run by a worker thread under a deadline."""

    def __init__(
        self, endpoint: RawEndpoint, size: int, timeout: float, executor: ThreadPoolExecutor
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.executor = executor  # borrowed from the tier, which shuts it down
        self._slots = asyncio.Semaphore(size)
        self._idle: list[RawConnection] = []

    async def run(self, op: Callable[[RawConnection, float], T]) -> T:
        """Run op(connection, deadline) in a thread; on timeout or cancel, abort it and wait for it."""
        async with self._slots:  # waiting for a connection is not part of the call's timeout
            conn = self._idle.pop() if self._idle else RawConnection(self.endpoint, self.timeout)
            deadline = time.monotonic() + self.timeout
            work = self.executor.submit(self._call, conn, op, deadline)
            try:
                async with asyncio.timeout(self.timeout):
                    result = await asyncio.wrap_future(work)
            except BaseException as exc:
                if not work.done():
                    conn.abort()  # the thread may be writing into the caller's buffer: stop it
                    await wait_done(work)
                if not isinstance(exc, ServerReplyError):
                    self.drop_idle()  # the server likely went away: its other sockets are dead too
                self._put_back(conn)
                raise
            self._put_back(conn)
            return result

    @staticmethod
    def _call(conn: RawConnection, op: Callable[[RawConnection, float], T], deadline: float) -> T:
        try:
            if conn.connected and conn.stale():
                conn.close()
            if not conn.connected:
                conn.connect(deadline)
            return op(conn, deadline)
        except ServerReplyError:
            raise  # the reply was read whole: the connection is still in sync
        except BaseException:
            conn.broken = True
            raise

    def _put_back(self, conn: RawConnection) -> None:
        if conn.broken or not conn.connected:
            conn.close()
        else:
            self._idle.append(conn)

    def drop_idle(self) -> None:
        """Close every idle connection (no thread holds an idle one)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        """Close idle connections (a running command's connection closes when it ends)."""
        self.drop_idle()


def _blob_bytes(key: ChunkKey, payload: memoryview) -> bytearray:
    """Header and payload joined, for clients that need the value as one buffer (one copy)."""
    header = codec.encode_header(key, payload)
    blob = bytearray(len(header) + payload.nbytes)
    blob[: len(header)] = header
    blob[len(header) :] = payload
    return blob


def _decode_into(value: bytes, key: ChunkKey, dest: memoryview) -> GetOutcome:
    """Verify a whole value fetched by redis.asyncio and copy its payload into dest."""
    try:
        header = codec.parse_header(value, key)
        if header.blob_size == len(value) and header.payload_len != dest.nbytes:
            return GetOutcome.LENGTH_MISMATCH
        payload = codec.decode(value, key)
    except BlobError:
        return GetOutcome.CORRUPT
    dest[:] = payload
    return GetOutcome.HIT


class RedisTier:
    """LowerTier over Redis or Redis Cluster; every failure is a counted miss, never an exception."""

    tier = Tier.REDIS

    def __init__(
        self,
        config: RedisConfig,
        *,
        client: RedisClient | None = None,
        breaker: CircuitBreaker | None = None,
        fast_path: bool = True,
    ) -> None:
        if not config.url and client is None:
            raise ValueError("RedisTier needs a server URL (setting redis_url, KVTIER_REDIS_URL)")
        self.url_for_logs = redact_url(config.url)
        self.timeout = config.timeout
        self.ttl = config.ttl
        self.is_cluster = config.cluster
        self.breaker = breaker or CircuitBreaker(config.breaker_period)
        self._owns_client = client is None
        self._client: RedisClient = client if client is not None else build_client(config)
        endpoint = None
        if fast_path and client is None and not self.is_cluster:
            endpoint = RawEndpoint.from_url(config.url)
        # Worker threads of the raw connections, and of checksums for the redis.asyncio path.
        self._threads = ThreadPoolExecutor(config.pool_size, thread_name_prefix="kvtier-redis")
        self._raw = RawPool(endpoint, config.pool_size, self.timeout, self._threads) if endpoint else None
        self._slots = asyncio.Semaphore(config.pool_size)  # big transfers via redis.asyncio
        self._book = PinBook()
        self._background: set[asyncio.Task[None]] = set()
        self._stats = TierStats()

    @property
    def fast_path(self) -> bool:
        """True when GET/SET use the raw connections."""
        return self._raw is not None

    # ------------------------------------------------------------------------------------------ guard
    async def _guarded(self, call: Callable[[], Awaitable[T]], default: T) -> T:
        """Run call under the breaker; a failure is counted and answered with default."""
        if not self.breaker.allow():
            self._stats.count_error("unavailable")
            return default
        try:
            result = await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            kind, backend_down = failure_kind(exc)
            self._stats.count_error(kind)
            if backend_down:
                opens = self.breaker.opens
                self.breaker.record_failure()
                if self.breaker.opens != opens:
                    log.warning(
                        "redis %s unavailable (%s: %s); skipping it for %.1fs",
                        self.url_for_logs,
                        kind,
                        type(exc).__name__,
                        self.breaker.period,
                    )
            else:
                self.breaker.record_success()
            return default
        self.breaker.record_success()
        return result

    async def _timed(self, awaitable: Awaitable[T]) -> T:
        async with asyncio.timeout(self.timeout):
            return await awaitable

    # ------------------------------------------------------------------------------------------ LowerTier
    async def start(self) -> None:
        """Check the server answers (and load the cluster's slot map); unhealthy if it does not."""

        async def ping() -> bool:
            if isinstance(self._client, RedisCluster):
                await self._timed(self._client.initialize())
            return bool(await self._timed(self._client.ping()))

        await self._guarded(ping, False)
        # TLS and cluster URLs take redis-py's path, which moves a chunk slower: say which one runs.
        path = "kvtier's raw connections" if self.fast_path else "redis-py"
        log.info("redis tier %s: GET and SET through %s", self.url_for_logs, path)

    async def contains_many(self, keys: list[ChunkKey]) -> list[bool]:
        """EXISTS for every key in one pipeline (one per shard, concurrently, on a cluster)."""
        if not keys:
            return []
        names = [redis_key(k) for k in keys]
        found = await self._guarded(lambda: self._exists(names), None)
        if found is None:
            return [False] * len(keys)
        return [bool(f) and not self._book.is_doomed(k) for f, k in zip(found, keys, strict=True)]

    async def _exists(self, names: list[str]) -> list[bool]:
        client = self._client
        if not isinstance(client, RedisCluster):
            return await self._timed(self._exists_batch(client, names))
        await self._timed(client.initialize())
        groups = self.shard_groups(names)
        answers = await self._timed(
            asyncio.gather(*(self._exists_batch(client, [names[i] for i in idx]) for idx in groups))
        )
        found = [False] * len(names)
        for idx, answer in zip(groups, answers, strict=True):
            for i, hit in zip(idx, answer, strict=True):
                found[i] = hit
        return found

    @staticmethod
    async def _exists_batch(client: RedisClient, names: list[str]) -> list[bool]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in await pipe.execute()]

    def shard_groups(self, names: list[str]) -> list[list[int]]:
        """Indices of names grouped by the cluster node that holds each (one group if no cluster)."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return [list(range(len(names)))]
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            node = client.get_node_from_key(name)
            groups.setdefault(node.name if node is not None else "", []).append(i)
        return list(groups.values())

    async def put(self, key: ChunkKey, payload: memoryview) -> bool:
        """One SET of header+payload (EX redis_ttl when > 0); False when it could not be stored."""
        payload = memoryview(payload).cast("B")
        ok = await self._guarded(lambda: self._put(key, payload), False)
        if ok:
            self._book.forget(key)
            self._stats.stores += 1
            self._stats.bytes_written += payload.nbytes
        return ok

    async def _put(self, key: ChunkKey, payload: memoryview) -> bool:
        name = redis_key(key)
        ttl = self.ttl
        if self._raw is not None:
            rkey = name.encode()
            await self._raw.run(lambda conn, deadline: conn.set(rkey, key, payload, ttl, deadline))
            return True
        async with self._slots:
            blob = await run_to_end(self._threads, _blob_bytes, key, payload)
            value = memoryview(blob)  # redis-py encodes bytes and memoryview, not bytearray
            await self._timed(self._client.set(name, value, ex=ttl if ttl > 0 else None))
        return True

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """GET key's blob, verify it and leave its payload in dest; False on miss or any failure."""
        dest = memoryview(dest).cast("B")
        outcome = await self._guarded(lambda: self._get(key, dest), None)
        if outcome is GetOutcome.HIT:
            self._stats.hits += 1
            self._stats.bytes_read += dest.nbytes
            return True
        self._stats.misses += 1
        if outcome is GetOutcome.CORRUPT:
            self._stats.count_error("corrupt")
            await self._guarded(lambda: self._timed(self._client.unlink(redis_key(key))), 0)
        elif outcome is GetOutcome.LENGTH_MISMATCH:
            self._stats.count_error("length_mismatch")
        return False

    async def _get(self, key: ChunkKey, dest: memoryview) -> GetOutcome:
        name = redis_key(key)
        if self._raw is not None:
            rkey = name.encode()
            return await self._raw.run(lambda conn, deadline: conn.get_into(rkey, key, dest, deadline))
        async with self._slots:
            value = await self._timed(self._client.get(name))
            if value is None:
                return GetOutcome.MISS
            return await run_to_end(self._threads, _decode_into, value, key, dest)

    async def delete(self, key: ChunkKey) -> None:
        """UNLINK key; a pinned key is hidden from lookups now and unlinked at its last unpin."""
        if self._book.pinned(key):
            self._book.doom(key)
            return
        self._book.forget(key)
        await self._guarded(lambda: self._timed(self._client.unlink(redis_key(key))), 0)

    async def _delete_if_doomed(self, key: ChunkKey) -> None:
        # A put since the delete revived the key; a new pin defers it again.
        if self._book.is_doomed(key) and not self._book.pinned(key):
            await self.delete(key)

    async def clear(self) -> int:
        """UNLINK every kvtier chunk in Redis but the pinned ones (ClearableTier); returns the count.

        Redis is shared: this drops the chunks of every kvtier instance using it, as `kvtier clear`
        asks. Each SCAN and UNLINK batch runs under the call timeout.
        """
        return await self._guarded(self._clear, 0)

    async def _clear(self) -> int:
        dropped = 0
        batch: list[str] = []
        async for raw in self._client.scan_iter(match=f"{REDIS_PREFIX}:*", count=1000):
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            key = _parse_redis_key(name)
            if key is not None and self._book.pinned(key):
                continue
            batch.append(name)
            if len(batch) >= _CLEAR_BATCH:
                dropped += int(await self._timed(self._client.unlink(*batch)))
                batch.clear()
        if batch:
            dropped += int(await self._timed(self._client.unlink(*batch)))
        return dropped

    def pin(self, keys: list[ChunkKey]) -> None:
        """Record a lease on keys (defers their deletion; Redis's own TTL still applies)."""
        self._book.pin(keys)

    def unpin(self, keys: list[ChunkKey]) -> None:
        """Release one pin of each key; a key deleted while pinned is unlinked at its last unpin."""
        for key in self._book.unpin(keys):
            self._spawn(key)

    def _spawn(self, key: ChunkKey) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop, no network: the key stays until its TTL; it is already hidden
        task = loop.create_task(self._delete_if_doomed(key))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stats(self) -> TierStats:
        """A snapshot of the counters; chunks and bytes are not tracked (Redis is shared)."""
        return self._stats.snapshot(chunks=0, bytes=0, capacity=0, healthy=self.breaker.closed)

    async def close(self) -> None:
        """Finish deferred deletes, close raw connections and threads, and the client we built."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._threads.shutdown, True)
        if self._raw is not None:
            self._raw.close()
        if self._owns_client:
            await self._client.aclose()
