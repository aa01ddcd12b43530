"""Redis tier: one value per chunk (blob header + payload, one SET), shared by every kvtier that can reach it.

Who owns what: the event loop owns the pins, stats, breakers, cluster router and idle-connection list;
worker threads own a raw connection only while running one command on it. The tier closes the clients
it builds; an injected client stays the caller's to close.
Design: docs/internals.md#redis-tier-redispy-redis_wirepy-redis_poolpy
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.exceptions as rexc
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.runtime.handoff import run_to_end
from kvtier.storage import codec
from kvtier.storage.base import BlobError, ChunkKey, Tier, TierListener, TierStats
from kvtier.storage.breaker import CircuitBreaker
from kvtier.storage.config import RedisConfig, redact_url
from kvtier.storage.keys import REDIS_PREFIX, redis_key
from kvtier.storage.signing import Signer
from kvtier.storage.tiers.pins import PinBook
from kvtier.storage.tiers.redis_pool import RawPool
from kvtier.storage.tiers.redis_wire import GetOutcome, RawEndpoint, ServerReplyError

log = logging.getLogger("kvtier.redis")
T = TypeVar("T")
RedisClient = Redis | RedisCluster
# Connections beyond the data-path pool, so lookups and deletes never queue behind large transfers.
_SPARE_CONNECTIONS = 4
_CLEAR_BATCH = 500
# Cluster errors that mean the cluster (not this one command) is being reconfigured.
_CLUSTER_FAILURES = (rexc.ClusterDownError, rexc.TryAgainError, rexc.MovedError, rexc.AskError)
# How often, at most, a cluster's slot map is checked while a node is down: CLUSTER SLOTS is cheap, and
# a promoted replica's slots are served again within this long of the cluster announcing it.
_MAP_CHECK_INTERVAL = 0.5


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
        # A node answered at once (no timeout to spare): the call is a miss, the slot map is checked.
        return "cluster", False
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


class ClusterRouter:
    """Where each key of a Redis Cluster lives, a breaker per node, and the slot map kept current.

    A node that times out or refuses connections is skipped for a breaker period (its keys answer as
    misses) while the other shards serve on. Calls refused or failed on a node mark the slot map
    stale; a stale map is checked against CLUSTER SLOTS (at most every _MAP_CHECK_INTERVAL, in the
    background) and reloaded when the cluster moved slots, as it does when it promotes a replica.
    Then the slots go to the new primary, whose breaker is its own, and the dead node's is dropped.

    Who owns what: the tier's event loop owns the breakers, the map check task and ``generation``;
    the client stays the tier's. Reloading the map closes every node's connections, so a call that
    fails across a reload (``generation`` moved on) says nothing about its node.
    """

    def __init__(self, client: RedisCluster, period: float, timeout: float) -> None:
        self.client = client
        self.period = period
        self.timeout = timeout
        self.generation = 0
        self._breakers: dict[str, CircuitBreaker] = {}
        self._stale = False
        self._next_check = 0.0
        self._check: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        """True when every node in the map takes calls."""
        return all(b.closed for b in self._breakers.values())

    def breaker(self, node: str) -> CircuitBreaker:
        """The breaker of node ``host:port``."""
        breaker = self._breakers.get(node)
        if breaker is None:
            breaker = self._breakers[node] = CircuitBreaker(self.period)
        return breaker

    async def route(self, names: list[str]) -> dict[str, list[int]]:
        """Indices of names grouped by the node that holds each (loads the map on first use)."""
        await self.client.initialize()  # a no-op once loaded
        now = time.monotonic()
        if self._stale and self._check is None and now >= self._next_check:
            self._stale = False
            self._next_check = now + _MAP_CHECK_INTERVAL
            self._check = asyncio.get_running_loop().create_task(self._check_map())
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            node = self.client.get_node_from_key(name)
            groups.setdefault(node.name if node is not None else "", []).append(i)
        return groups

    def mark_stale(self) -> None:
        """A call to a node failed or was refused: the cluster may have moved its slots."""
        self._stale = True

    async def _check_map(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                if await self._map_moved():
                    await self._reload()
        except Exception as exc:  # the next stale call checks again; the calls count their own failures
            log.debug("redis cluster slot map check failed: %s: %s", type(exc).__name__, exc)
            self._stale = True
        finally:
            self._check = None

    async def _map_moved(self) -> bool:
        """Whether a live node's CLUSTER SLOTS places some slot on another node than the client does."""
        primaries = self.client.get_primaries()
        ask = next((n for n in primaries if self.breaker(n.name).closed), None)
        if ask is None:
            return True  # every known primary is failing: ask the seed nodes afresh
        slots = await self.client.cluster_slots(target_nodes=ask)
        for (first, _), where in slots.items():
            host, port = where["primary"]
            current = self.client.nodes_manager.slots_cache.get(first)
            if not current or current[0].name != f"{host}:{port}":
                return True
        return False

    async def _reload(self) -> None:
        """Load the slot map afresh, from nodes whose breaker is closed where any is known."""
        self.generation += 1
        startup = self.client.nodes_manager.startup_nodes
        failing = {name for name, breaker in self._breakers.items() if not breaker.closed}
        if any(name not in failing for name in startup):
            for name in failing:
                startup.pop(name, None)  # as redis-py does with a node that failed a command
        await self.client.aclose()
        await self.client.initialize()
        known = {n.name for n in self.client.get_nodes()}
        self._breakers = {k: b for k, b in self._breakers.items() if k in known}
        log.info(
            "redis cluster slot map reloaded: primaries %s", [n.name for n in self.client.get_primaries()]
        )

    async def close(self) -> None:
        """Wait for a running map check."""
        if self._check is not None:
            await asyncio.gather(self._check, return_exceptions=True)


def _blob_bytes(key: ChunkKey, payload: memoryview, signer: Signer | None) -> bytearray:
    """Header and payload joined, for clients that need the value as one buffer (one copy)."""
    header = codec.encode_for(signer, key, payload)
    blob = bytearray(len(header) + payload.nbytes)
    blob[: len(header)] = header
    blob[len(header) :] = payload
    return blob


def _decode_into(value: bytes, key: ChunkKey, dest: memoryview, signer: Signer | None) -> GetOutcome:
    """Verify a whole value fetched by redis.asyncio (its MAC too, with signer) and copy its payload
    into dest."""
    try:
        header = codec.parse_header(value, key)
        if header.blob_size == len(value) and header.payload_len != dest.nbytes:
            codec.payload_mac(signer, header)  # an unsigned value is forged whatever its length
            return GetOutcome.LENGTH_MISMATCH
        payload = codec.decode(value, key, signer)
    except codec.BlobForgedError:
        return GetOutcome.FORGED
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
        listener: TierListener | None = None,
        signer: Signer | None = None,
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
        self.signer = signer  # tier keys: values are signed and verified; None = unsigned
        self._raw = (
            RawPool(endpoint, config.pool_size, self.timeout, self._threads, signer) if endpoint else None
        )
        self._slots = asyncio.Semaphore(config.pool_size)  # big transfers via redis.asyncio
        self._router = (
            ClusterRouter(self._client, config.breaker_period, self.timeout)
            if isinstance(self._client, RedisCluster)
            else None
        )
        self._book = PinBook()
        self._background: set[asyncio.Task[None]] = set()
        self._stats = TierStats()
        self.listener = listener  # told of the chunks this tier sets, deletes or finds gone (KV events)

    @property
    def fast_path(self) -> bool:
        """True when GET/SET use the raw connections."""
        return self._raw is not None

    # ------------------------------------------------------------------------------------------ guard
    async def _guarded(self, call: Callable[[], Awaitable[T]], default: T, node: str | None = None) -> T:
        """Run call under the tier's breaker (or that of cluster node ``node``); a failure is
        counted and answered with default."""
        router = self._router
        breaker = self.breaker if node is None or router is None else router.breaker(node)
        if not breaker.allow():
            self._stats.count_error("unavailable")
            if node is not None and router is not None:
                router.mark_stale()
            return default
        generation = router.generation if router is not None else 0
        try:
            result = await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            kind, backend_down = failure_kind(exc)
            self._stats.count_error(kind)
            if router is not None:
                if backend_down or kind == "cluster":
                    router.mark_stale()
                if router.generation != generation:
                    return default  # the map was reloaded under this call, closing its connection
            if backend_down:
                self._trip(breaker, kind, exc, node)
            else:
                breaker.record_success()
            return default
        breaker.record_success()
        return result

    def _trip(self, breaker: CircuitBreaker, kind: str, exc: Exception, node: str | None) -> None:
        opens = breaker.opens
        breaker.record_failure()
        if breaker.opens != opens:
            where = self.url_for_logs if node is None else f"{self.url_for_logs} node {node}"
            log.warning(
                "redis %s unavailable (%s: %s); skipping it for %.1fs",
                where,
                kind,
                type(exc).__name__,
                breaker.period,
            )

    async def _keyed(self, name: str, call: Callable[[], Awaitable[T]], default: T) -> T:
        """Run call, which reads or writes key ``name``, under the breaker of the node holding it."""
        router = self._router
        if router is None:
            return await self._guarded(call, default)
        groups = await self._guarded(lambda: self._timed(router.route([name])), None)
        if groups is None:
            return default
        return await self._guarded(call, default, next(iter(groups)))

    async def _one(self, add: Callable[[Any], Any]) -> Any:
        """Run one command: ``add(client)`` on one server; on a cluster ``add(pipeline)`` in a
        pipeline of one, which fails without redis-py closing every node's connections."""
        if self._router is None:
            return await add(self._client)
        pipe = self._client.pipeline(transaction=False)
        add(pipe)
        return (await pipe.execute())[0]

    async def _timed(self, awaitable: Awaitable[T]) -> T:
        async with asyncio.timeout(self.timeout):
            return await awaitable

    # ------------------------------------------------------------------------------------------ LowerTier
    async def start(self) -> None:
        """Check the server answers (and load the cluster's slot map); unhealthy if it does not."""

        async def ping() -> bool:
            if isinstance(self._client, RedisCluster):
                await self._timed(self._client.initialize())
            # redis-py 7 types ping() as "Awaitable[bool] | bool" (its sync and async clients share it).
            pong = self._client.ping()
            return bool(await self._timed(pong) if inspect.isawaitable(pong) else pong)

        await self._guarded(ping, False)
        # TLS and cluster URLs take redis-py's path, which moves a chunk slower: say which one runs.
        path = "kvtier's raw connections" if self.fast_path else "redis-py"
        log.info("redis tier %s: GET and SET through %s", self.url_for_logs, path)

    async def contains_many(self, keys: list[ChunkKey]) -> list[bool]:
        """EXISTS for every key in one pipeline (one per shard, concurrently, on a cluster)."""
        if not keys:
            return []
        names = [redis_key(k) for k in keys]
        if self._router is None:
            found = await self._guarded(lambda: self._timed(self._exists_batch(self._client, names)), None)
        else:
            found = await self._exists_per_node(self._router, names)
        if found is None:
            return [False] * len(keys)
        if self.listener is not None and self._router is None and not all(found):
            # Expired or evicted by Redis itself: announced once a lookup finds it gone. (A cluster's
            # failed node answers False too, so only a single server's answer is proof.)
            self.listener.removed(Tier.REDIS, [k for f, k in zip(found, keys, strict=True) if not f])
        return [bool(f) and not self._book.is_doomed(k) for f, k in zip(found, keys, strict=True)]

    async def _exists_per_node(self, router: ClusterRouter, names: list[str]) -> list[bool] | None:
        """One EXISTS pipeline per node, concurrently; a failed or skipped node's keys are misses."""
        groups = await self._guarded(lambda: self._timed(router.route(names)), None)
        if groups is None:
            return None
        client = self._client

        async def node_batch(node: str, idx: list[int]) -> list[bool] | None:
            batch = [names[i] for i in idx]
            return await self._guarded(lambda: self._timed(self._exists_batch(client, batch)), None, node)

        answers = await asyncio.gather(*(node_batch(node, idx) for node, idx in groups.items()))
        found = [False] * len(names)
        for idx, answer in zip(groups.values(), answers, strict=True):
            for i, hit in zip(idx, answer or (), strict=False):
                found[i] = hit
        return found

    @staticmethod
    async def _exists_batch(client: RedisClient, names: list[str]) -> list[bool]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in await pipe.execute()]

    async def shard_groups(self, names: list[str]) -> dict[str, list[int]]:
        """Indices of names grouped by the cluster node that holds each (one group if no cluster)."""
        if self._router is None:
            return {self.url_for_logs: list(range(len(names)))}
        return await self._timed(self._router.route(names))

    async def put(self, key: ChunkKey, payload: memoryview, covered: Sequence[bytes] = ()) -> bool:
        """One SET of header+payload (EX redis_ttl when > 0); False when it could not be stored.
        covered goes to the listener only: nothing reads a Redis value's block hashes back."""
        payload = memoryview(payload).cast("B")
        ok = await self._keyed(redis_key(key), lambda: self._put(key, payload), False)
        if ok:
            self._book.forget(key)
            self._stats.stores += 1
            self._stats.bytes_written += payload.nbytes
            if self.listener is not None:
                self.listener.stored(Tier.REDIS, [key], [covered])
        return ok

    async def _put(self, key: ChunkKey, payload: memoryview) -> bool:
        name = redis_key(key)
        ttl = self.ttl
        if self._raw is not None:
            rkey = name.encode()
            await self._raw.run(lambda conn, deadline: conn.set(rkey, key, payload, ttl, deadline))
            return True
        async with self._slots:
            blob = await run_to_end(self._threads, _blob_bytes, key, payload, self.signer)
            value = memoryview(blob)  # redis-py encodes bytes and memoryview, not bytearray
            await self._timed(self._one(lambda c: c.set(name, value, ex=ttl if ttl > 0 else None)))
        return True

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """GET key's blob, verify it and leave its payload in dest; False on miss or any failure."""
        dest = memoryview(dest).cast("B")
        name = redis_key(key)
        outcome = await self._keyed(name, lambda: self._get(key, dest), None)
        if outcome is GetOutcome.HIT:
            self._stats.hits += 1
            self._stats.bytes_read += dest.nbytes
            return True
        self._stats.misses += 1
        if outcome is GetOutcome.CORRUPT or outcome is GetOutcome.FORGED:
            self._stats.count_error(outcome.value)
            if outcome is GetOutcome.FORGED:
                log.warning("redis %s: %s failed its MAC check (forged); deleted", self.url_for_logs, key)
            if self.listener is not None:
                self.listener.removed(Tier.REDIS, [key])
            await self._unlink(name)
        elif outcome is GetOutcome.MISS and self.listener is not None:
            self.listener.removed(Tier.REDIS, [key])  # expired or evicted by Redis itself
        elif outcome is GetOutcome.LENGTH_MISMATCH:
            self._stats.count_error("length_mismatch")
        return False

    async def _get(self, key: ChunkKey, dest: memoryview) -> GetOutcome:
        name = redis_key(key)
        if self._raw is not None:
            rkey = name.encode()
            return await self._raw.run(lambda conn, deadline: conn.get_into(rkey, key, dest, deadline))
        async with self._slots:
            value = await self._timed(self._one(lambda c: c.get(name)))
            if value is None:
                return GetOutcome.MISS
            return await run_to_end(self._threads, _decode_into, value, key, dest, self.signer)

    async def delete(self, key: ChunkKey) -> None:
        """UNLINK key; a pinned key is hidden from lookups now and unlinked at its last unpin."""
        if self.listener is not None:
            self.listener.removed(Tier.REDIS, [key])  # hidden from lookups now, unlinked now or later
        if self._book.pinned(key):
            self._book.doom(key)
            return
        self._book.forget(key)
        await self._unlink(redis_key(key))

    async def _unlink(self, name: str) -> None:
        # execute_command: a cluster pipeline's unlink() is a coroutine of its transaction mode.
        await self._keyed(
            name, lambda: self._timed(self._one(lambda c: c.execute_command("UNLINK", name))), 0
        )

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
            if key is not None and self.listener is not None:
                self.listener.removed(Tier.REDIS, [key])
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
        healthy = self.breaker.closed and (self._router is None or self._router.healthy)
        return self._stats.snapshot(chunks=0, bytes=0, capacity=0, healthy=healthy)

    async def close(self) -> None:
        """Finish deferred deletes, close raw connections and threads, and the client we built."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._router is not None:
            await self._router.close()
        await asyncio.get_running_loop().run_in_executor(None, self._threads.shutdown, True)
        if self._raw is not None:
            self._raw.close()
        if self._owns_client:
            await self._client.aclose()
