"""Announcing the objects a LIST found with what each one covers: block hashes and description.

A LIST names objects, not the tokens behind them, and a token-keyed router (docs/events.md) drops a
chunk announced without them. So after a refresh the tier hands the keys it newly indexed to a
``ListedAnnouncer``; one background task reads each object's header, then its trailer, with two
ranged GETs (``READERS`` objects at a time, each GET under the tier's timeout and breaker), and
announces the chunk with the trailer's ``Covered``, as the tier announces its own uploads. A read
that fails, a damaged or foreign header or trailer, or a signed tier's object signed by none of its
keys is announced by its key alone (as before trailers) and counted 'undescribed' (the failed GET
is counted under its own kind too); an object gone meanwhile is not announced. At most
``MOST_WAITING`` keys wait to be read; a refresh that finds more announces the excess by key alone,
counted. Lookups and loads never wait on any of this: the keys are indexed before they are read.

Only the header and trailer checksums are checked: with tier keys the MAC covers the payload too,
so only a load verifies it; nothing read here is loaded as KV (a forged description can mislead a
router, never a load, which fails its MAC check).

Who owns what: the tier's event loop owns the backlog and the task; ``close`` cancels the task.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from kvtier.storage import codec
from kvtier.storage.base import BlobError, ChunkKey, TierStats
from kvtier.storage.signing import Signer
from kvtier.storage.tiers.object_client import Buffer
from kvtier.storage.tiers.object_index import ObjectIndex, object_path

log = logging.getLogger("kvtier.object")
READERS = 4  # objects read at a time (two small ranged GETs each)
MOST_WAITING = 1 << 17  # keys waiting to be read (a few MiB); beyond, announced by key alone
# A ranged GET: the bytes, None when the object is gone, False when the call failed (counted).
FetchRange = Callable[[str, int, int], Awaitable[Buffer | bool | None]]
Announce = Callable[[ChunkKey, Sequence[bytes]], None]


class Unreadable(Exception):
    """The object's header or trailer could not be read or trusted (it is announced by key alone)."""


class ListedAnnouncer:
    """Reads the trailers of listed objects in the background and announces each chunk in full."""

    def __init__(
        self,
        index: ObjectIndex,
        fetch: FetchRange,
        announce: Announce,
        stats: TierStats,
        signer: Signer | None = None,
    ) -> None:
        self._index = index
        self._fetch = fetch
        self._announce = announce
        self._stats = stats
        self._signer = signer
        self._waiting: deque[bytes] = deque()  # compact keys listed and not yet announced
        self._task: asyncio.Task[None] | None = None
        self._reading = 0  # objects being read now

    @property
    def pending(self) -> int:
        """Listed objects not announced yet (waiting or being read)."""
        return len(self._waiting) + self._reading

    def add(self, compacts: list[bytes]) -> None:
        """Announce these newly indexed keys once their trailers are read (in the background)."""
        room = max(0, MOST_WAITING - len(self._waiting))
        for compact in compacts[room:]:
            self._stats.count_error("undescribed")
            self._announce(self._index.ids.key_of(compact), ())
        self._waiting.extend(compacts[:room])
        if self._waiting and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="kvtier-object-announce")

    async def close(self) -> None:
        """Stop reading; keys still waiting are not announced."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._waiting.clear()

    async def _drain(self) -> None:
        try:
            while self._waiting:  # keys added after the readers ended, before this task resumed
                await asyncio.gather(*(self._reader() for _ in range(READERS)))
        finally:
            self._task = None

    async def _reader(self) -> None:
        while self._waiting:
            compact = self._waiting.popleft()
            size = self._index.entries.size_of(compact)
            if size is None:  # unindexed meanwhile (gone, evicted, deleted): nothing to announce
                continue
            key = self._index.ids.key_of(compact)
            self._reading += 1
            try:
                covered = await self._covered(key, size)
            except Unreadable as exc:
                log.debug("object tier: announcing %s by its key alone: %s", key, exc)
                self._stats.count_error("undescribed")
                covered = codec.Covered(())
            finally:
                self._reading -= 1
            if covered is not None and compact in self._index.entries:
                self._announce(key, covered)

    async def _covered(self, key: ChunkKey, size: int) -> codec.Covered | None:
        """What key's object of size bytes covers, from its trailer; None when it is gone."""
        path = object_path(key)
        head = await self._get(path, 0, min(size, codec.header_size(key, signed=True)))
        if head is None:
            return None
        try:
            header = codec.parse_header(head, key)
            if header.blob_size != size:
                raise BlobError(f"header says {header.blob_size} bytes, the LIST {size}")
            codec.payload_mac(self._signer, header)  # with tier keys: signed by one of them
        except BlobError as exc:
            raise Unreadable(str(exc)) from exc
        if not header.trailer_len:
            return codec.Covered(())
        tail = await self._get(path, size - header.trailer_len, size)
        if tail is None:
            return None
        try:
            return codec.decode_trailer(tail)
        except BlobError as exc:
            raise Unreadable(str(exc)) from exc

    async def _get(self, path: str, start: int, end: int) -> Buffer | None:
        if end - start < 1:
            raise Unreadable("an empty object")
        data = await self._fetch(path, start, end)
        if data is False:
            raise Unreadable("the ranged GET failed")
        if data is None or data is True:
            return None
        if memoryview(data).nbytes != end - start:
            raise Unreadable(f"a ranged GET of {end - start} bytes returned {memoryview(data).nbytes}")
        return data
