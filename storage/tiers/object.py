"""Object tier: one object per chunk under ``<prefix>/<namespace>/<hash hex>`` in kvtier's blob format,
on any store of the S3 API, shared by every node of a fleet; below Redis.

Lookups never wait on the store: ``contains_many`` reads the index (``object_index``), loaded by a
LIST at start and refreshed by one every ``refresh_period`` (how stale it may be: there); the
objects a LIST finds are announced to the listener with what their trailers say they cover, read in
the background (``object_announce``). Loads (``get_into``) stream the object and verify header and
checksum while copying the payload into the caller's slot, piece by piece as it arrives
(``object_read``; with tier keys, the MAC too: codec.py, "Signed blobs"; a forged object is counted
'forged' and logged at WARNING); a missing, corrupt, forged, truncated or foreign object is a
counted miss, unindexed, and (but for a missing one) deleted. Writes (``put``) never hold a save:
the blob (header, payload, trailer) is copied out of the slot on a thread and uploaded in the
background, so the slot is free again at once; ``write_bytes`` bounds the bytes of uploads in
flight, and a put beyond it is dropped and counted ('slow'), as is a put while the breaker is open.
A chunk the index already holds (written by this node or listed from another) is not uploaded again.

Failures: every call runs under ``timeout`` (obstore's retries of 5xx, SlowDown and dropped
connections, with backoff, inside it); a timeout or an unreachable store trips the circuit breaker,
which refuses calls (counted 'unavailable', answered as misses; lookups answer misses too) until
``breaker_period`` passes and one call (the next refresh, load or upload) succeeds. A denied call
(403) is counted 'denied' and leaves the breaker closed: reads may still be allowed.

Capacity: the index's bytes (this node's objects and those listed) are kept within ``capacity`` by
deleting objects the index knows of by CLOCK (``DiskIndex``), never a pinned or uploading one;
capacity 0 leaves it to the bucket's lifecycle rule (docs/architecture.md, "The object tier").

Who owns what: the event loop owns the index, pins, uploads in flight, stats and breaker, and runs
the loads' copies; the threads only build blobs for uploads and sort listings. The tier owns its
client, threads and background tasks, and ends them in close(), which lets uploads in flight finish
within their timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.runtime.handoff import run_to_end
from kvtier.storage import codec
from kvtier.storage.base import ChunkKey, Tier, TierListener, TierStats
from kvtier.storage.breaker import CircuitBreaker
from kvtier.storage.config import ObjectConfig
from kvtier.storage.signing import Signer
from kvtier.storage.tiers.object_announce import ListedAnnouncer
from kvtier.storage.tiers.object_client import Buffer, ObjectClient, failure_kind, is_missing
from kvtier.storage.tiers.object_index import ObjectIndex, object_path, order, parse_path
from kvtier.storage.tiers.object_read import BlobSink, Outcome
from kvtier.storage.tiers.pins import PinBook

log = logging.getLogger("kvtier.object")
T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]
_THREADS = 2
_SLACK_SHIFT = 10  # eviction frees capacity >> this beyond its need, so it runs once per many puts
_MERGE_STEP = 4096  # listed objects parsed between two turns of the loop
# A load takes the object's bytes in pieces of at least this size: small enough that copying and
# hashing one holds the loop for a fraction of a millisecond and most of an object's are verified
# before its last byte arrives, large enough that each piece is one turn of the loop, not many.
_PIECE = 1 << 20
# A blob's buffer is kept for the next put once its upload succeeded: a fresh buffer of 32 MiB or
# more is a fresh mapping whose pages fault in as the blob is written, a sizeable share of a put
# (docs/performance.md, "Object tier throughput"). At most write_bytes >> _SPARE_SHIFT bytes are
# kept; a buffer up to _SPARE_SLACK larger than a blob fits it.
_SPARE_SHIFT = 2
_SPARE_SLACK = 64 << 10


def build_blob(
    key: ChunkKey,
    payload: memoryview,
    covered: Sequence[bytes],
    signer: Signer | None = None,
    spare: bytearray | None = None,
) -> memoryview:
    """Header (signed with signer), payload and trailer in one buffer (one copy of the payload and
    the MAC, on a thread): the first bytes of spare when it is large enough, else a new buffer (the
    view's ``obj``)."""
    trailer = codec.encode_trailer(covered) if covered else b""
    header = codec.encode_for(signer, key, payload, trailer)
    total = len(header) + payload.nbytes + len(trailer)
    blob = memoryview(spare if spare is not None and len(spare) >= total else bytearray(total))[:total]
    blob[: len(header)] = header
    end = len(header) + payload.nbytes
    blob[len(header) : end] = payload
    blob[end:] = trailer
    return blob


async def _absent_as_none(call: Awaitable[T]) -> T | None:
    """The call's result, or None when the store says the object is not there."""
    try:
        return await call
    except FileNotFoundError as exc:
        if is_missing(exc):
            return None
        raise


class ObjectTier:
    """LowerTier over an S3 bucket and prefix; every failure is a counted miss, never an exception."""

    tier = Tier.OBJECT

    def __init__(
        self,
        config: ObjectConfig,
        *,
        client: ObjectClient | None = None,
        breaker: CircuitBreaker | None = None,
        listener: TierListener | None = None,
        sleep: Sleep = asyncio.sleep,
        signer: Signer | None = None,
    ) -> None:
        self.config = config
        self.signer = signer  # tier keys: objects are signed and verified; None = unsigned
        self.client = client if client is not None else ObjectClient(config)
        self.where = f"s3://{self.client.bucket}/{self.client.prefix}"
        self.breaker = breaker or CircuitBreaker(config.breaker_period)
        self.listener = listener  # told of objects written, deleted, evicted, listed or found gone
        self.index = ObjectIndex()
        self._sleep = sleep
        self._book = PinBook()
        self._uploads: dict[ChunkKey, asyncio.Task[None]] = {}
        self._inflight = 0  # bytes of uploads in flight
        self._spares: list[bytearray] = []  # buffers of finished uploads, for the next blobs
        self._background: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._listed = asyncio.Event()  # set once a LIST of the whole prefix has been reconciled
        self._stats = TierStats(capacity=config.capacity, loading=True)
        self._announcer = ListedAnnouncer(
            self.index, self._fetch_range, self._announce_listed, self._stats, signer
        )
        self._threads = ThreadPoolExecutor(_THREADS, thread_name_prefix="kvtier-object")

    # ------------------------------------------------------------------------------------------ guard
    async def _call(self, call: Callable[[], Awaitable[T]], default: Any, admitted: bool = False) -> T:
        """Run one store call under the breaker (unless the caller was admitted already) and the
        timeout; a failure is counted, answered with default, and trips the breaker when it says the
        store is down."""
        if not admitted and not self.breaker.allow():
            self._stats.count_error("unavailable")
            return default
        try:
            async with asyncio.timeout(self.config.timeout):
                result = await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc)
            return default
        self.breaker.record_success()
        return result

    def _failed(self, exc: BaseException) -> None:
        kind, down = failure_kind(exc)
        self._stats.count_error(kind)
        if not down:
            self.breaker.record_success()  # the store answered
            return
        opens = self.breaker.opens
        self.breaker.record_failure()
        if self.breaker.opens != opens:
            log.warning(
                "object store %s unavailable (%s: %s); skipping it for %.1fs",
                self.where, kind, _brief(exc), self.breaker.period,
            )  # fmt: skip

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------------------------------ start
    async def start(self) -> None:
        """Check bucket, credentials and endpoint with one LIST (an error names the setting and the
        tier is unhealthy meanwhile), then load and refresh the index in the background."""
        try:
            async with asyncio.timeout(self.config.timeout):
                await self.client.probe()
        except Exception as exc:
            kind, _ = failure_kind(exc)
            self._stats.count_error(kind)
            self.breaker.record_failure()
            log.error("object tier %s unusable: %s", self.where, _explain(kind, self.config, exc))
        self._refresher = asyncio.get_running_loop().create_task(
            self._refresh_loop(), name="kvtier-object-list"
        )

    async def wait_listed(self) -> None:
        """Wait until a LIST of the whole prefix has been reconciled into the index."""
        await self._listed.wait()

    async def _refresh_loop(self) -> None:
        while True:
            if self.breaker.allow():
                await self.refresh()
            await self._sleep(self.config.refresh_period)

    async def refresh(self) -> bool:
        """LIST the prefix and reconcile the index with it; False when the LIST failed."""
        refresh = self.index.begin()
        listed: list[tuple[float, bytes, int]] = []
        foreign = 0
        try:
            async with asyncio.timeout(max(self.config.timeout, self.config.refresh_period)):
                async for page in self.client.pages():
                    for at in range(0, len(page), _MERGE_STEP):
                        for obj in page[at : at + _MERGE_STEP]:
                            key = parse_path(obj.path)
                            if key is None:
                                foreign += 1
                                continue
                            listed.append((obj.mtime, self.index.ids.compact(key), obj.size))
                        await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.index.abandon(refresh)
            raise
        except Exception as exc:
            self.index.abandon(refresh)
            self._failed(exc)
            return False
        self.breaker.record_success()
        ordered = await run_to_end(self._threads, order, listed)
        done = self.index.reconcile(refresh, ordered)
        self._announce(done.added, done.gone)
        if foreign:
            self._stats.errors["foreign"] = foreign  # objects under the prefix that are not chunks
        self._stats.loading = False
        self._listed.set()
        await self._fit()
        return True

    def _announce(self, added: list[bytes], gone: list[bytes]) -> None:
        """Announce the keys a LIST found gone now, and those it found new once their trailers are
        read (object_announce: in the background, never in a lookup's way)."""
        if self.listener is None:
            return
        if gone:
            self.listener.removed(Tier.OBJECT, [self.index.ids.key_of(c) for c in gone])
        if added:
            self._announcer.add(added)

    def _announce_listed(self, key: ChunkKey, covered: Sequence[bytes]) -> None:
        if self.listener is not None:
            self.listener.stored(Tier.OBJECT, [key], [covered])

    @property
    def announcing(self) -> int:
        """Objects a LIST found whose announcement waits for their trailer's read."""
        return self._announcer.pending

    # ------------------------------------------------------------------------------------------ lookups
    async def contains_many(self, keys: list[ChunkKey]) -> list[bool]:
        """Whether the index holds each key (no request to the store); all misses while it is down."""
        if not self.breaker.closed:
            return [False] * len(keys)
        find, doomed = self.index.find, self._book.is_doomed
        return [find(k) is not None and not doomed(k) for k in keys]

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """Fetch key's object, verify it and leave its payload in dest; False on miss or any failure."""
        dest = memoryview(dest).cast("B")
        outcome: Outcome | bool | None = await self._call(lambda: self._load(key, dest), False)
        if not isinstance(outcome, Outcome):  # False: the call failed (counted)
            self._stats.misses += 1
            if outcome is None:  # listed or written once, gone now (deleted elsewhere, a lifecycle rule)
                self._stats.count_error("gone")
                self._unindex(key)
            return False
        if outcome is Outcome.HIT:
            self._stats.hits += 1
            self._stats.bytes_read += dest.nbytes
            compact = self.index.find(key)
            if compact is not None:
                self.index.touch(compact)
            return True
        self._stats.misses += 1
        self._stats.count_error(outcome.value)
        if outcome is Outcome.FORGED:
            log.warning("object tier %s: %s failed its MAC check (forged); deleted", self.where, key)
        if outcome is not Outcome.LENGTH_MISMATCH:  # corrupt or forged
            self._unindex(key)
            if not self._book.pinned(key):  # a pinned key's lease keeps it until it lets go
                await self._call(lambda: self._delete_paths([object_path(key)]), False)
        return False

    async def _load(self, key: ChunkKey, dest: memoryview) -> Outcome | None:
        """Stream key's object into dest, verified piece by piece on this loop as it arrives (each
        piece's copy and hash take well under a millisecond); None when it is not there."""
        got = await _absent_as_none(self.client.get_stream(object_path(key), _PIECE))
        if got is None:
            return None
        size, pieces = got
        sink = BlobSink(key, dest, size, self.signer)
        async for piece in pieces:
            decided = sink.feed(piece)
            if decided is not None:  # no later byte makes it a hit: the GET ends with its iterator
                return decided
        return sink.finish()

    async def _fetch_range(self, path: str, start: int, end: int) -> Buffer | bool | None:
        """One ranged GET under the breaker and timeout: the bytes, None when gone, False on failure."""
        return await self._call(lambda: _absent_as_none(self.client.get_range(path, start, end)), False)

    async def _delete_paths(self, paths: list[str]) -> bool:
        await self.client.delete(paths)
        return True

    def _unindex(self, key: ChunkKey) -> None:
        if self.index.drop(key) and self.listener is not None:
            self.listener.removed(Tier.OBJECT, [key])

    # ------------------------------------------------------------------------------------------ writes
    async def put(self, key: ChunkKey, payload: memoryview, covered: Sequence[bytes] = ()) -> bool:
        """Accept the chunk for upload (copied out of payload before this returns); False when it
        is dropped: the store is down or too slow (write_bytes in flight), or the copy failed."""
        compact = self.index.find(key)
        if compact is not None and not self._book.is_doomed(key):
            self.index.touch(compact)  # already there, from this node or another
            return True
        if key in self._uploads:
            return True
        if not self.breaker.allow():
            self._stats.count_error("unavailable")
            return False
        payload = memoryview(payload).cast("B")
        size = codec.header_size(key, signed=self.signer is not None) + payload.nbytes
        if self._inflight and self._inflight + size > self.config.write_bytes:
            self._stats.count_error("slow")
            return False
        self._inflight += size
        spare = self._take_spare(size)
        try:
            blob = await run_to_end(self._threads, build_blob, key, payload, covered, self.signer, spare)
        except Exception as exc:
            self._inflight -= size
            self._keep_spare(spare)
            log.error("object tier: building the blob of %s failed: %r", key, exc)
            self._stats.count_error("encode")
            return False
        task = asyncio.get_running_loop().create_task(self._upload(key, blob, size, covered))
        self._uploads[key] = task
        return True

    async def _upload(self, key: ChunkKey, blob: memoryview, size: int, covered: Sequence[bytes]) -> None:
        ok = False
        try:
            ok = await self._call(lambda: self._put_blob(key, blob), False, admitted=True)
        finally:
            self._inflight -= size
            del self._uploads[key]
        if not ok:  # a call cut short may still be read by the client: its buffer is not reused
            return
        self._keep_spare(blob.obj)
        self._book.forget(key)
        self.index.stored(key, blob.nbytes)
        self._stats.stores += 1
        self._stats.bytes_written += blob.nbytes
        if self.listener is not None:
            self.listener.stored(Tier.OBJECT, [key], [covered])
        await self._fit()

    async def _put_blob(self, key: ChunkKey, blob: memoryview) -> bool:
        await self.client.put(object_path(key), blob)
        return True

    def _take_spare(self, size: int) -> bytearray | None:
        """A kept buffer for a blob of at least size bytes (header and payload), or None."""
        for i, spare in enumerate(self._spares):
            if size <= len(spare) <= size + _SPARE_SLACK:
                return self._spares.pop(i)
        return None

    def _keep_spare(self, buffer: object) -> None:
        """Keep a blob's buffer for a later put, within write_bytes >> _SPARE_SHIFT bytes."""
        if not isinstance(buffer, bytearray):
            return
        kept = sum(len(b) for b in self._spares)
        if kept + len(buffer) <= self.config.write_bytes >> _SPARE_SHIFT:
            self._spares.append(buffer)
        elif self._spares:  # the newest size wins: the chunk size may have changed
            self._spares.pop(0)

    async def _fit(self) -> None:
        """Delete objects the clock picks (not pinned, not uploading) until the index fits capacity,
        and the slack too where they can."""
        capacity = self.config.capacity
        if not capacity or self.index.used <= capacity:
            return
        excess = self.index.used - capacity
        key_of, uploads, pinned = self.index.ids.key_of, self._uploads, self._book.pinned

        def held(compact: bytes) -> bool:
            key = key_of(compact)
            return key in uploads or pinned(key)

        victims = [key_of(c) for c in self.index.victims(excess, held, capacity >> _SLACK_SHIFT)]
        for key in victims:
            self._unindex(key)
        self._stats.evictions += len(victims)
        if victims:
            await self._call(lambda: self._delete_paths([object_path(k) for k in victims]), False)

    # ------------------------------------------------------------------------------------------ removal
    async def delete(self, key: ChunkKey) -> None:
        """Delete key's object; a pinned key is hidden now and deleted at its last unpin, an upload
        in flight once it ends."""
        self._unindex(key)
        upload = self._uploads.get(key)
        if self._book.pinned(key) or upload is not None:
            self._book.doom(key)
            if upload is not None:
                upload.add_done_callback(
                    lambda _t: self._spawn(self._delete_if_doomed(key), "kvtier-object-del")
                )
            return
        self._book.forget(key)
        await self._call(lambda: self._delete_paths([object_path(key)]), False)

    async def _delete_if_doomed(self, key: ChunkKey) -> None:
        if self._book.is_doomed(key) and not self._book.pinned(key) and key not in self._uploads:
            await self.delete(key)

    async def clear(self) -> int:
        """Delete every chunk object under the prefix but the pinned ones (ClearableTier); returns
        how many. The bucket is shared: this clears it for every node, as `kvtier clear` asks."""
        names: list[str] = []
        pinned = self._book.pinned

        async def collect() -> bool:
            async for page in self.client.pages():
                for obj in page:
                    key = parse_path(obj.path)
                    if key is not None and not pinned(key):
                        names.append(obj.path)
                        self._unindex(key)
            return True

        if not await self._call(collect, False):
            return 0
        if names and not await self._call(lambda: self._delete_paths(names), False):
            return 0
        return len(names)

    def pin(self, keys: list[ChunkKey]) -> None:
        """Record a lease on keys (kept from eviction; deletion deferred to the last unpin)."""
        self._book.pin(keys)

    def unpin(self, keys: list[ChunkKey]) -> None:
        """Release one pin of each key; a key deleted while pinned is deleted at its last unpin."""
        for key in self._book.unpin(keys):
            self._spawn(self._delete_if_doomed(key), "kvtier-object-del")

    # ------------------------------------------------------------------------------------------ stats
    def stats(self) -> TierStats:
        """A snapshot of the counters; chunks and bytes are those the index knows of."""
        return self._stats.snapshot(
            chunks=len(self.index), bytes=self.index.used, healthy=self.breaker.closed
        )

    @property
    def uploads_in_flight(self) -> int:
        """Uploads accepted and not ended."""
        return len(self._uploads)

    async def settle(self) -> None:
        """Wait for the uploads in flight and background deletes to end (tests, shutdown)."""
        while self._uploads or self._background:
            await asyncio.gather(*self._uploads.values(), *self._background, return_exceptions=True)

    async def close(self) -> None:
        """Stop refreshing, let uploads and deletes in flight end (each within its timeout), and
        release the threads."""
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        await self._announcer.close()
        await self.settle()
        await asyncio.get_running_loop().run_in_executor(None, self._threads.shutdown, True)


def _brief(exc: BaseException) -> str:
    """The first line of an error, without obstore's debug dump."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _explain(kind: str, config: ObjectConfig, exc: BaseException) -> str:
    """An operator's sentence for a failed start: which setting or credential to look at."""
    if kind == "no_bucket":
        return f"the bucket of object_url (KVTIER_OBJECT_URL={config.url}) does not exist"
    if kind == "denied":
        return (
            "the store refused kvtier's credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
            f"AWS_PROFILE or ~/.aws/credentials) for object_url {config.url}: {_brief(exc)}"
        )
    endpoint = config.endpoint or "AWS"
    return (
        f"the store at object_endpoint (KVTIER_OBJECT_ENDPOINT={endpoint}) does not answer "
        f"({kind}: {_brief(exc)}); the other tiers serve, this one is retried every "
        f"{config.breaker_period:.0f}s"
    )
