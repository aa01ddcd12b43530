"""Big tiers, for `kvtier bench scale tiers`: what a lookup, a commit and an eviction cost per chunk,
and what the index keeps in memory per chunk, with 1k, 100k and 1M chunks stored.

Each tier is filled to the size under test, then measured ``repeats`` times:

- ``lookup_us``: a 64-chunk prompt (chunks committed together, as a prompt's are), all stored, one
  of 16 prompts at random places in the tier looked up round and round (the same working set of
  1,024 chunks at every size); ``lookup_spread_us``: the same over 1,024 prompts (65,536 chunks, or
  the whole tier when smaller), a working set larger than the CPU's caches. CPU: ``prefix`` then
  ``touch_entries`` (the index probe and the recency update a store's lookup makes); disk and object:
  ``contains_many`` / the index's ``find`` and ``touch``; Redis: ``contains_many`` (one pipeline of
  64 EXISTS on a real redis-server).
- ``commit_us``: 64-chunk commits of new chunks into free room (CPU: ``reserve_many`` +
  ``commit_many``; disk and Redis: 64 concurrent ``put`` of a small payload, files written and SETs
  sent); each batch is removed again untimed, so the tier stays at its size.
- ``commit_evict_us``: the same commits into a full tier, each evicting as many chunks (Redis:
  its own ``maxmemory`` LRU eviction, set to the memory used once the tier is full);
  ``evict_us`` is the difference.
- ``commit_loop_us``, ``commit_evict_loop_us``: the same commits' CPU time on the event loop's
  thread, per chunk: the index and the tier's own bookkeeping. Disk puts are mostly file writes on
  the tier's idle-priority writer threads, which the wall figures include and these do not; on a
  busy machine those threads wait for idle cores, so the wall figures measure the machine's load as
  much as the tier. ``loop_largest_over_smallest`` holds their ratios.
- ``index_bytes``: the Python memory the fill left allocated, per chunk (tracemalloc: every object
  the tier keeps, the chunk keys' hash bytes included, as a service decoding them off the wire would
  keep them). A resident-set delta is not used: memory a previous tier freed is reused by the next
  fill without growing the process. Redis: the server's ``used_memory`` growth per key beyond the
  value's bytes (the fill stores header-only values, so the value's own allocation is small).

``dict_floor`` is the floor of every in-memory index: a plain dict of the same hashes, probed and
filled the same way (no LRU, no eviction: its commit_evict is its commit).

What is real and what is not: the CPU tier is its index and slot allocator over a 16 KiB slot per
chunk, with no arena mapped (the tier never touches the bytes: workers and lower tiers do), so 1M
chunks is a 16 GiB CPU tier without 16 GiB of memory. The disk tier's index is filled in memory
without files (the files' bytes are not what is measured); its measured puts write real files, and
an eviction of a fill entry unlinks a path that is not there. Redis is filled with pipelined SETs of
header-only values under kvtier's key names; its measured puts go through the tier. The object
tier's index is measured alone (no object store).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from hashlib import blake2b
from itertools import repeat
from typing import Any, cast

from kvtier.bench.ports import free_port
from kvtier.storage import codec
from kvtier.storage.arena import SlotAllocator
from kvtier.storage.base import ChunkKey
from kvtier.storage.config import DiskConfig, RedisConfig
from kvtier.storage.keys import redis_key
from kvtier.storage.tiers.cpu import CpuTier
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.object_index import ObjectIndex
from kvtier.storage.tiers.redis import RedisTier

SIZES = (1_000, 100_000, 1_000_000)
QUICK_SIZES = (256, 2_048)
TIERS = ("dict_floor", "cpu", "disk", "redis", "object_index")
BATCH = 64  # chunks per lookup and per commit: a 16k-token prompt of 256-token chunks
NS = "5ca1e5ca1e5ca1e5"
CPU_SLOT = 16 << 10  # 1M chunks of this = a 16 GiB CPU tier
PAYLOAD = 1024  # the disk and Redis puts' payload
HOT_PROMPTS = 16  # prompts looked up over and over: a working set of 1,024 chunks at every size
SPREAD_PROMPTS = 1024  # prompts at random places over the whole tier: 65,536 chunks' worth
PHASE_S = 0.25  # seconds of lookups, and of commits, per repeat (at least)
COSTS = ("lookup_us", "lookup_spread_us", "commit_us", "commit_evict_us")  # largest_over_smallest
LOOP_COSTS = ("commit_loop_us", "commit_evict_loop_us")  # loop_largest_over_smallest


def hash_of(i: int) -> bytes:
    """Chunk i's 32-byte prefix hash (as vLLM's sha256 block hashes, and made again on demand)."""
    return blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def keys_of(start: int, count: int) -> list[ChunkKey]:
    """The keys of chunks start .. start+count-1."""
    return [ChunkKey(NS, hash_of(i)) for i in range(start, start + count)]


def traced_fill(fill: Callable[[], None], n: int) -> dict[str, float]:
    """Run fill() under tracemalloc: the bytes per chunk it left allocated."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fill()
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"index_bytes": kept / n}


# ------------------------------------------------------------------------------------------ drivers
class Driver:
    """One tier under test: fill it, look prompts up, commit and remove batches."""

    name = ""
    evicts = True

    def __init__(self, n: int, room: int) -> None:
        self.n, self.room = n, room  # chunks stored, and room for this many more

    def fill(self) -> None:
        """Store chunks 0 .. n-1."""
        raise NotImplementedError

    async def lookup(self, keys: list[ChunkKey]) -> int:
        """Look a prompt up; how many of its chunks were found."""
        raise NotImplementedError

    async def commit(self, keys: list[ChunkKey]) -> None:
        """Store new chunks."""
        raise NotImplementedError

    async def remove(self, keys: list[ChunkKey]) -> None:
        """Remove stored chunks."""
        raise NotImplementedError

    async def make_full(self) -> None:
        """From now on, every commit evicts (the room is taken, or the backend's limit set)."""

    def extra(self) -> dict[str, Any]:
        """Tier-specific figures of the filled tier."""
        return {}

    async def close(self) -> None:
        """Release what the driver holds."""


class DictFloorDriver(Driver):
    """The floor of every in-memory index: a plain dict of the same hashes (no eviction, no LRU)."""

    name = "dict_floor"
    evicts = False

    def __init__(self, n: int, room: int) -> None:
        super().__init__(n, room)
        self.index: dict[bytes, bool] = {}

    def fill(self) -> None:
        """One entry per chunk."""
        for i in range(self.n):
            self.index[hash_of(i)] = True

    async def lookup(self, keys: list[ChunkKey]) -> int:
        """One C-level pass of get over the prompt's hashes."""
        return sum(map(bool, map(self.index.get, [k.prefix_hash for k in keys])))

    async def commit(self, keys: list[ChunkKey]) -> None:
        """Insert the hashes (nothing is evicted: commit_evict is the same insert)."""
        self.index.update(zip([k.prefix_hash for k in keys], repeat(True)))

    async def remove(self, keys: list[ChunkKey]) -> None:
        """Delete the hashes."""
        for key in keys:
            del self.index[key.prefix_hash]


class CpuDriver(Driver):
    """The CPU tier: index and slot allocator over 16 KiB slots, no arena mapped."""

    name = "cpu"

    def __init__(self, n: int, room: int) -> None:
        super().__init__(n, room)
        self.tier = CpuTier(SlotAllocator((n + room) * CPU_SLOT))

    def fill(self) -> None:
        """Commit the chunks in 64-chunk batches, as saves do."""
        for start in range(0, self.n, BATCH):
            self._commit(keys_of(start, min(BATCH, self.n - start)))

    def _commit(self, keys: list[ChunkKey]) -> None:
        slots = self.tier.reserve_many(CPU_SLOT, len(keys))
        if None in slots:
            raise RuntimeError("the CPU tier under test ran out of slots")
        self.tier.commit_many(keys, slots, checked=True)  # type: ignore[arg-type]

    async def lookup(self, keys: list[ChunkKey]) -> int:
        """prefix + touch_entries, as the store's lookup."""
        entries = self.tier.prefix(NS, [k.prefix_hash for k in keys])
        self.tier.touch_entries(entries)
        return len(entries)

    async def commit(self, keys: list[ChunkKey]) -> None:
        """reserve_many + commit_many."""
        self._commit(keys)

    async def remove(self, keys: list[ChunkKey]) -> None:
        """Drop from the index, slots back to the allocator."""
        for key in keys:
            self.tier.remove(key)

    async def make_full(self) -> None:
        """Take the room: the next commits evict."""
        free = self.tier.allocator.free_bytes // CPU_SLOT
        for start in range(0, free, BATCH):
            self._commit(keys_of(self.n + (1 << 40) + start, min(BATCH, free - start)))

    def extra(self) -> dict[str, Any]:
        """The tier's capacity."""
        return {"capacity_bytes": self.tier.allocator.capacity, "slot_bytes": CPU_SLOT}


class DiskDriver(Driver):
    """The disk tier: index filled in memory, measured puts written to files."""

    name = "disk"

    def __init__(self, n: int, room: int, root: str) -> None:
        super().__init__(n, room)
        self.size = codec.header_size(ChunkKey(NS, hash_of(0))) + PAYLOAD
        self.tier = DiskTier(DiskConfig(root, (n + room) * self.size))
        self.payload = memoryview(random.Random(7).randbytes(PAYLOAD))

    async def start(self) -> None:
        """Start the tier on its empty directory and wait for its (empty) index."""
        await self.tier.start()
        await self.tier.wait_loaded()

    def fill(self) -> None:
        """Index n chunks of the put size without files (the index alone is measured)."""
        index = self.tier._index  # the tier's own index: what a scan or n puts would have filled
        compact = index.ids.compact
        for i in range(self.n):
            index.put(compact(ChunkKey(NS, hash_of(i))), self.size)

    async def lookup(self, keys: list[ChunkKey]) -> int:
        """contains_many."""
        return sum(await self.tier.contains_many(keys))

    async def commit(self, keys: list[ChunkKey]) -> None:
        """Concurrent puts (files written on the tier's threads)."""
        done = await asyncio.gather(*(self.tier.put(k, self.payload) for k in keys))
        if not all(done):
            raise RuntimeError(f"disk puts failed: {self.tier.stats().errors}")

    async def remove(self, keys: list[ChunkKey]) -> None:
        """delete each (files unlinked)."""
        await asyncio.gather(*(self.tier.delete(k) for k in keys))

    async def make_full(self) -> None:
        """Take the room: the next puts evict."""
        await self.commit_all(keys_of(self.n + (1 << 40), self.room))

    async def commit_all(self, keys: list[ChunkKey]) -> None:
        """commit() in batches."""
        for start in range(0, len(keys), BATCH):
            await self.commit(keys[start : start + BATCH])

    async def close(self) -> None:
        """Stop the tier's threads and remove its files."""
        await self.tier.close()
        shutil.rmtree(self.tier.root, ignore_errors=True)


class RedisDriver(Driver):
    """The Redis tier against a real redis-server."""

    name = "redis"

    def __init__(self, n: int, room: int, url: str) -> None:
        super().__init__(n, room)
        import redis

        self.sync = redis.Redis.from_url(url)
        self.sync.flushall()
        self.tier = RedisTier(RedisConfig(url, ttl=0, timeout=10.0))
        self.payload = memoryview(random.Random(7).randbytes(PAYLOAD))
        self.used0 = 0
        self.value = b""

    def info(self, section: str, field: str) -> int:
        """One integer field of the server's INFO section."""
        return int(cast("dict[str, Any]", self.sync.info(section))[field])

    def fill(self) -> None:
        """Pipelined SETs of header-only values under kvtier's key names."""
        key0 = ChunkKey(NS, hash_of(0))
        self.value = codec.encode_header(key0, b"")
        self.sync.config_set("maxmemory", 0)
        self.used0 = self.info("memory", "used_memory")
        for start in range(0, self.n, 4096):
            pipe = self.sync.pipeline(transaction=False)
            for key in keys_of(start, min(4096, self.n - start)):
                pipe.set(redis_key(key), self.value)
            pipe.execute()

    def extra(self) -> dict[str, Any]:
        """The server's used_memory growth per key, and beyond the value's bytes."""
        used = self.info("memory", "used_memory") - self.used0
        per_key = used / self.n
        return {"server_bytes_per_key": per_key, "server_index_bytes": per_key - len(self.value)}

    async def lookup(self, keys: list[ChunkKey]) -> int:
        """contains_many: one pipeline of EXISTS."""
        return sum(await self.tier.contains_many(keys))

    async def commit(self, keys: list[ChunkKey]) -> None:
        """Concurrent puts (SETs on the tier's raw connections)."""
        done = await asyncio.gather(*(self.tier.put(k, self.payload) for k in keys))
        if not all(done):
            raise RuntimeError(f"redis puts failed: {self.tier.stats().errors}")

    async def remove(self, keys: list[ChunkKey]) -> None:
        """UNLINK each."""
        await asyncio.gather(*(self.tier.delete(k) for k in keys))

    async def make_full(self) -> None:
        """Redis evicts by its own policy: maxmemory at what it uses now, allkeys-lru."""
        self.sync.config_set("maxmemory-policy", "allkeys-lru")
        self.sync.config_set("maxmemory", self.info("memory", "used_memory"))

    def evicted(self) -> int:
        """Keys Redis evicted so far."""
        return self.info("stats", "evicted_keys")

    async def close(self) -> None:
        """Close the tier and the filling client."""
        await self.tier.close()
        self.sync.close()


class ObjectIndexDriver(Driver):
    """The object tier's index alone."""

    name = "object_index"

    def __init__(self, n: int, room: int) -> None:
        super().__init__(n, room)
        self.index = ObjectIndex()
        self.size = PAYLOAD

    def fill(self) -> None:
        """stored() each chunk."""
        for i in range(self.n):
            self.index.stored(ChunkKey(NS, hash_of(i)), self.size)

    async def lookup(self, keys: list[ChunkKey]) -> int:
        """find + touch, as the tier's contains_many and hit."""
        found = [self.index.find(k) for k in keys]
        for compact in found:
            if compact is not None:
                self.index.touch(compact)
        return sum(c is not None for c in found)

    async def commit(self, keys: list[ChunkKey]) -> None:
        """stored() each, evicting what the clock picks beyond n + room as the tier does (up to
        capacity >> 10 more, so that the clock sweeps once per many puts)."""
        capacity = (self.n + self.room) * self.size
        excess = (len(self.index) + len(keys)) * self.size - capacity
        if excess > 0:
            for compact in self.index.victims(excess, None, capacity >> 10):
                self.index.drop(self.index.ids.key_of(compact))
        for key in keys:
            self.index.stored(key, self.size)

    async def remove(self, keys: list[ChunkKey]) -> None:
        """drop() each."""
        for key in keys:
            self.index.drop(key)

    async def make_full(self) -> None:
        """Take the room."""
        await self.commit(keys_of(self.n + (1 << 40), self.room))


# ------------------------------------------------------------------------------------------ timing
def median_of(runs: list[float]) -> dict[str, Any]:
    """A figure's median over its runs, with the runs."""
    return {"median": statistics.median(runs), "runs": runs}


async def _time_lookups(driver: Driver, prompts: list[list[ChunkKey]], seconds: float) -> float:
    """Microseconds per chunk of lookups of the prompts, round and round, for seconds at least."""
    chunks, took, at = 0, 0.0, 0
    while took < seconds or chunks < 8 * BATCH:
        keys = prompts[at % len(prompts)]
        at += 1
        t0 = time.perf_counter()
        found = await driver.lookup(keys)
        took += time.perf_counter() - t0
        if found != len(keys):
            raise RuntimeError(f"{driver.name}: a stored prompt was found {found}/{len(keys)}")
        chunks += len(keys)
    return took / chunks * 1e6


async def _time_commits(
    driver: Driver, fresh: Iterator[int], remove: bool, seconds: float
) -> tuple[float, float]:
    """Microseconds per chunk of 64-chunk commits of new chunks, for seconds at least: wall time,
    and the CPU time of this thread (the event loop's: the index and the tier's bookkeeping, not
    the disk tier's file writes on its writer threads); each batch removed again (untimed) when
    remove is set."""
    chunks, took, cpu = 0, 0.0, 0.0
    while took < seconds or chunks < 4 * BATCH:
        keys = keys_of(next(fresh) * BATCH, BATCH)
        c0, t0 = time.thread_time(), time.perf_counter()
        await driver.commit(keys)
        took += time.perf_counter() - t0
        cpu += time.thread_time() - c0
        chunks += len(keys)
        if remove:
            await driver.remove(keys)
    return took / chunks * 1e6, cpu / chunks * 1e6


async def measure_driver(driver: Driver, repeats: int, seed: int, seconds: float = PHASE_S) -> dict[str, Any]:
    """Fill the driver's tier (memory traced), then time lookups, commits and evicting commits."""
    t0 = time.perf_counter()
    memory = traced_fill(driver.fill, driver.n)
    fill_s = time.perf_counter() - t0
    rng = random.Random(seed)
    starts = [rng.randrange(0, max(driver.n - BATCH, 0) + 1) for _ in range(SPREAD_PROMPTS)]
    prompts = [keys_of(s, min(BATCH, driver.n)) for s in starts]
    fresh = iter(range(1 << 30, 1 << 31))  # batch numbers of new chunks, far from the fill's
    out: dict[str, Any] = {"chunks": driver.n, "fill_s": round(fill_s, 3), **memory, **driver.extra()}
    # The same few hot prompts at every size, then prompts spread over the whole tier.
    lookups = [await _time_lookups(driver, prompts[:HOT_PROMPTS], seconds) for _ in range(repeats)]
    spread = [await _time_lookups(driver, prompts, seconds) for _ in range(repeats)]
    timed = [await _time_commits(driver, fresh, True, seconds) for _ in range(repeats)]
    commits, commits_loop = [wall for wall, _ in timed], [loop for _, loop in timed]
    await driver.make_full()
    evicted0 = driver.evicted() if isinstance(driver, RedisDriver) else 0
    timed = [await _time_commits(driver, fresh, not driver.evicts, seconds) for _ in range(repeats)]
    evicting, evicting_loop = [wall for wall, _ in timed], [loop for _, loop in timed]
    if isinstance(driver, RedisDriver):
        out["redis_evicted_keys"] = driver.evicted() - evicted0
    out["lookup_us"] = median_of(lookups)
    out["lookup_spread_us"] = median_of(spread)
    out["commit_us"] = median_of(commits)
    out["commit_evict_us"] = median_of(evicting)
    out["evict_us"] = median_of([e - c for e, c in zip(evicting, commits, strict=True)])
    out["commit_loop_us"] = median_of(commits_loop)
    out["commit_evict_loop_us"] = median_of(evicting_loop)
    return out


# ------------------------------------------------------------------------------------------ redis
@contextlib.contextmanager
def redis_server(workdir: str) -> Iterator[str | None]:
    """A throwaway redis-server on a free loopback port (no persistence); None if none is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    import redis

    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*argv, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 30
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server at {url} did not start") from None
                    time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


# ------------------------------------------------------------------------------------------ runs
async def _run_tier(
    name: str, n: int, repeats: int, seconds: float, workdir: str, redis_url: str | None
) -> dict[str, Any]:
    """Build one tier at size n, measure it, close it."""
    driver: Driver
    if name == "dict_floor":
        driver = DictFloorDriver(n, BATCH)
    elif name == "cpu":
        driver = CpuDriver(n, BATCH)
    elif name == "disk":
        root = tempfile.mkdtemp(prefix="disk-", dir=workdir)
        driver = DiskDriver(n, BATCH, root)
        await driver.start()
    elif name == "redis":
        if redis_url is None:
            return {"skipped": "redis-server is not installed"}
        driver = RedisDriver(n, BATCH, redis_url)
    elif name == "object_index":
        driver = ObjectIndexDriver(n, BATCH)
    else:
        raise ValueError(f"unknown tier {name!r}: one of {', '.join(TIERS)}")
    try:
        return await measure_driver(driver, repeats, n, seconds)
    finally:
        await driver.close()


def _ratios(
    per_size: dict[str, dict[str, Any]], sizes: tuple[int, ...], figures: tuple[str, ...] = COSTS
) -> dict[str, float]:
    """Each cost at the largest size over the same cost at the smallest."""
    small, large = per_size.get(str(sizes[0]), {}), per_size.get(str(sizes[-1]), {})
    out: dict[str, float] = {}
    for figure in figures:
        if figure in small and figure in large and small[figure]["median"] > 0:
            out[figure] = round(large[figure]["median"] / small[figure]["median"], 3)
    return out


def measure(
    sizes: tuple[int, ...] = SIZES, tiers: tuple[str, ...] = TIERS, repeats: int = 3, seconds: float = PHASE_S
) -> dict[str, Any]:
    """Every tier at every size (see the module docstring); the figures as a JSON-ready dict."""
    if repeats < 1 or not sizes or min(sizes) < 1:
        raise ValueError(f"repeats must be >= 1 and sizes positive, not {repeats} and {sizes}")
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        raise ValueError(f"unknown tiers {unknown}: choose from {', '.join(TIERS)}")
    result: dict[str, Any] = {"sizes": list(sizes), "repeats": repeats, "batch_chunks": BATCH, "tiers": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-scale-") as workdir:
        server = redis_server(workdir) if "redis" in tiers else contextlib.nullcontext(None)
        with server as redis_url:
            for name in tiers:
                per_size: dict[str, dict[str, Any]] = {}
                for n in sizes:
                    per_size[str(n)] = asyncio.run(_run_tier(name, n, repeats, seconds, workdir, redis_url))
                    gc.collect()
                result["tiers"][name] = {
                    "by_chunks": per_size,
                    "largest_over_smallest": _ratios(per_size, sizes),
                    "loop_largest_over_smallest": _ratios(per_size, sizes, LOOP_COSTS),
                }
    return result
