"""Every interface and value type of kvtier's storage layer, in one place.

storage/ knows nothing of vLLM or torch. Misses and tier failures are values on the hot path;
exceptions are for programmer errors, bad configuration and the typed errors below.
Design: docs/internals.md#interfaces-and-value-types-basepy
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple, Protocol, overload, runtime_checkable

import msgspec

# 2: the payload checksum is taken over segments (codec.SEGMENT), so readers verify on several threads.
# 3: a trailer after the payload names the vLLM block hashes the chunk covers (KV events after a restart).
BLOB_FORMAT_VERSION = 3


class Tier(enum.IntEnum):
    """Where a chunk was found; lower value = faster."""

    CPU = 0
    DISK = 1
    REDIS = 2
    OBJECT = 3  # object storage through the S3 API: the fleet's shared bulk tier

    @property
    def label(self) -> str:
        """Lower-case name used in stats and metrics."""
        return self.name.lower()


# ---------------------------------------------------------------------------------------------- errors
class StorageError(Exception):
    """Base of storage errors."""


class BlobError(StorageError):
    """A blob at rest failed verification: bad magic, version, key echo, length or checksum."""


class BlobFormatError(BlobError):
    """An intact blob header of another format version (written by an older or newer kvtier)."""


class ArenaError(StorageError):
    """The shared-memory arena could not be created, mapped or sized as asked."""


class ArenaFullError(ArenaError):
    """No slot can be had: every slot is reserved, leased or queued for a write."""


class UnknownNamespaceError(StorageError):
    """A call named a namespace that was never registered with the store."""


class SlotStateError(StorageError):
    """A slot was committed, aborted or freed that is not in a state allowing it (a caller bug)."""


# ---------------------------------------------------------------------------------------------- keys
@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """Everything that makes KV bytes incompatible between two engines."""

    model: str
    kv_dtype: str
    kv_layout: str
    block_size: int  # tokens per vLLM block
    chunk_size: int  # tokens per chunk, a multiple of block_size
    num_layers: int
    page_bytes: int  # bytes of one block of one layer
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    hash_algo: str = "sha256"
    format_version: int = BLOB_FORMAT_VERSION

    @property
    def blocks_per_chunk(self) -> int:
        """vLLM blocks in one chunk."""
        return self.chunk_size // self.block_size

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk: every layer's pages for the chunk's blocks."""
        return self.num_layers * self.blocks_per_chunk * self.page_bytes


class ChunkKey(NamedTuple):
    """A stored chunk's identity: namespace id (hex digest) and the prefix hash of its last block.

    A NamedTuple, not a dataclass: keys are hashed in every index on the hot path, and tuple hashing
    and equality run in C.
    """

    namespace: str
    prefix_hash: bytes


# ---------------------------------------------------------------------------------------------- arena
class SlotRef(NamedTuple):
    """A byte range of the shared-memory arena holding one chunk's payload (a NamedTuple: hot path)."""

    offset: int
    length: int


NO_SLOT = -1  # a packed offset that names no slot (a lower-tier hit)
PACKED_OFFSET = struct.Struct("<q")  # one offset of SlotList.packed
NO_SLOT_PACKED = PACKED_OFFSET.pack(NO_SLOT)


class SlotList(Sequence[SlotRef | None]):
    """Slots as offsets (None for no slot) and their one length or one length each, each SlotRef
    made when asked for: how lookups hand out slots, which are mostly passed on, rarely read.

    The offsets are kept as a list, as packed bytes (one little-endian int64 per slot, NO_SLOT for
    none: how a lookup's reply carries them), or both; each form is made from the other once, when
    first asked for. A client that only counts a lookup's hits never unpacks them.
    """

    __slots__ = ("_lengths", "_offsets", "_packed")

    def __init__(self, offsets: list[int | None], lengths: list[int] | int) -> None:
        if isinstance(lengths, list) and len(lengths) != len(offsets):
            raise ValueError(f"{len(offsets)} slot offsets but {len(lengths)} lengths")
        self._offsets: list[int | None] | None = offsets
        self._packed: bytes | None = None
        self._lengths = lengths

    @classmethod
    def from_packed(cls, packed: bytes, lengths: list[int] | int) -> SlotList:
        """Slots from packed offsets (see the class docstring)."""
        count, rest = divmod(len(packed), 8)
        if rest:
            raise ValueError(f"packed slot offsets of {len(packed)} bytes: not a multiple of 8")
        if isinstance(lengths, list) and len(lengths) != count:
            raise ValueError(f"{count} slot offsets but {len(lengths)} lengths")
        slots = cls.__new__(cls)
        slots._offsets, slots._packed, slots._lengths = None, packed, lengths
        return slots

    @property
    def offsets(self) -> list[int | None]:
        """Each slot's offset, None where there is no slot."""
        offsets = self._offsets
        if offsets is None:
            packed = self._packed
            assert packed is not None
            values = struct.unpack(f"<{len(packed) // 8}q", packed)
            offsets = self._offsets = [None if o == NO_SLOT else o for o in values]
        return offsets

    @property
    def packed(self) -> bytes:
        """The offsets packed: one little-endian int64 per slot, NO_SLOT where there is none."""
        packed = self._packed
        if packed is None:
            offsets = self.offsets
            packed = self._packed = struct.pack(
                f"<{len(offsets)}q", *(NO_SLOT if o is None else o for o in offsets)
            )
        return packed

    @property
    def lengths(self) -> list[int] | int:
        """The slots' one length, or each slot's."""
        return self._lengths

    def __len__(self) -> int:
        offsets = self._offsets
        return len(offsets) if offsets is not None else len(self._packed or b"") // 8

    @overload
    def __getitem__(self, index: int) -> SlotRef | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[SlotRef | None]: ...

    def __getitem__(self, index: int | slice) -> SlotRef | list[SlotRef | None] | None:
        if isinstance(index, slice):
            return list(self)[index]
        offsets = self._offsets
        if offsets is not None:
            offset = offsets[index]
        else:  # one slot of a packed reply: no need to unpack them all
            packed = self._packed or b""
            at = range(len(packed) // 8)[index]  # IndexError out of range, as a list's
            offset = PACKED_OFFSET.unpack_from(packed, at * 8)[0]
            if offset == NO_SLOT:
                offset = None
        if offset is None:
            return None
        lengths = self._lengths
        return SlotRef(offset, lengths if isinstance(lengths, int) else lengths[index])

    def __iter__(self) -> Iterator[SlotRef | None]:
        lengths = self._lengths
        each = repeat(lengths) if isinstance(lengths, int) else iter(lengths)
        for offset, length in zip(self.offsets, each, strict=False):  # each may repeat forever
            yield None if offset is None else SlotRef(offset, length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SlotList | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list: unhashable like one

    def __repr__(self) -> str:
        return f"SlotList({list(self)!r})"


# ---------------------------------------------------------------------------------------------- results
class LookupResult(msgspec.Struct, frozen=True):
    """Answer of TieredStore.lookup: how many leading keys are stored, and where each one is.

    ``slots`` holds the arena slot of every hit already in the CPU tier (None for lower-tier hits), so a
    caller whose hits are all in memory can copy without a stage() round trip. (A frozen msgspec
    Struct, not a frozen dataclass: made in C, and a client makes one per lookup.)
    """

    num_hit: int
    tiers: list[Tier]
    slots: Sequence[SlotRef | None]


class StageResult(msgspec.Struct, frozen=True):
    """Answer of TieredStore.stage: a slot per leased chunk, or None where it turned out missing.

    ``failed`` lists the indices (into the leased keys) that could not be staged: missing, corrupt or a
    tier error. Chunks after the first failure are still reported as staged when they were.
    An unknown or expired lease stages nothing: every list is empty.
    """

    slots: list[SlotRef | None]
    tiers: list[Tier]
    failed: list[int]


@dataclass(slots=True)
class TierStats:
    """Counters of one tier; errors are split by kind (e.g. 'timeout', 'corrupt', 'enospc')."""

    chunks: int = 0
    bytes: int = 0
    capacity: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    healthy: bool = True
    loading: bool = False  # the tier's index is still loading (disk): hits arrive as it fills

    def count_error(self, kind: str) -> None:
        """Add one error of this kind."""
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def snapshot(self, **overrides: object) -> TierStats:
        """A copy safe to hand out (its own errors dict), with some fields replaced."""
        return dataclasses.replace(self, errors=dict(self.errors), **overrides)  # type: ignore[arg-type]

    @property
    def error_total(self) -> int:
        """All errors of every kind."""
        return sum(self.errors.values())


@dataclass(slots=True)
class StoreStats:
    """Snapshot of the whole store, for `kvtier stats`, /stats and /metrics."""

    tiers: dict[str, TierStats]
    leases_active: int
    slots_in_use: int
    slots_total_bytes: int
    write_queue_depth: int
    writes_dropped: int
    namespaces: int
    reserve_dropped: int = 0  # reserve() answers of None because no arena space could be freed
    writes_yielded: int = 0  # queued lower-tier writes given up so that a reserve found a slot


# ---------------------------------------------------------------------------------------------- tiers
@runtime_checkable
class LowerTier(Protocol):
    """A tier below the CPU arena (disk, Redis, object storage); every method returns misses and
    failures as values.

    Contract: no method raises for an I/O failure, a missing key or a corrupt blob; each is counted in
    ``stats()`` and reported as False. Payload buffers are borrowed for the call only.
    """

    tier: Tier

    async def start(self) -> None:
        """Open connections or scan the index; a tier that cannot start is marked unhealthy."""

    async def contains_many(self, keys: list[ChunkKey]) -> list[bool]:
        """Whether each key is stored (batched: one round trip per shard or one index pass)."""

    async def put(self, key: ChunkKey, payload: memoryview, covered: Sequence[bytes] = ()) -> bool:
        """Store the payload under key (header added by the tier); False when it could not.
        covered: the vLLM block hashes of the chunk, in order, when known (told to the listener)."""

    async def get_into(self, key: ChunkKey, dest: memoryview) -> bool:
        """Read the payload of key into dest (exact length) and verify it; False on miss or error."""

    async def delete(self, key: ChunkKey) -> None:
        """Remove key if present."""

    def pin(self, keys: list[ChunkKey]) -> None:
        """Keep keys from this tier's eviction until unpinned (leases of lower-tier hits)."""

    def unpin(self, keys: list[ChunkKey]) -> None:
        """Undo one pin() of each key."""

    def stats(self) -> TierStats:
        """Current counters."""

    async def close(self) -> None:
        """Release connections, threads and files."""


class TierListener(Protocol):
    """Told of every chunk that enters or leaves a tier (the service's KV events), on the event loop.

    A tier holding no listener (None, the default) pays nothing. ``covered`` holds, per key, the vLLM
    block hashes the chunk covers in order, or an empty sequence where the tier does not know them
    (the listener then names them from an earlier call for the same key). A listener must not raise,
    and may be told of a key it already knows as stored or removed (it keeps the state, not the calls).
    """

    def stored(self, tier: Tier, keys: Sequence[ChunkKey], covered: Sequence[Sequence[bytes]]) -> None:
        """These chunks are now held by tier."""

    def removed(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        """These chunks are no longer held by tier (a key it did not hold is ignored)."""

    def cleared(self, tier: Tier) -> None:
        """tier holds nothing now."""


@runtime_checkable
class ClearableTier(Protocol):
    """A lower tier that can drop everything it holds (optional; used by TieredStore.clear)."""

    async def clear(self) -> int:
        """Drop every unpinned chunk; returns how many were dropped."""


# ---------------------------------------------------------------------------------------------- store
@dataclass(frozen=True, slots=True)
class ArenaInfo:
    """Where other processes map the arena: a file on tmpfs of ``size`` bytes."""

    path: str
    size: int


class StoreAPI(Protocol):
    """What the service calls on the tiered store. Runs on the service's event loop, never blocks it.

    One method per operation, and its type says whether it waits. A plain method (register,
    release, reserve, commit, abort) never waits for I/O and returns its answer. A coroutine method
    (stage, delete, clear, close) may wait for the lower tiers. ``lookup`` is the one call that is
    either: it returns its LookupResult at once when the CPU tier decides it (every chunk asked for
    is there, or no lower tier exists), else a coroutine that asks the lower tiers and returns it.
    That coroutine has changed nothing until it runs; the caller awaits it in a Task (tier calls use
    ``asyncio.timeout``). So a lookup answered from memory costs no Task; tell the two apart with
    ``type(answer) is LookupResult``.

    Leases: ``lookup(..., lease_id)`` takes or replaces the lease ``lease_id`` on the hit chunks, which
    keeps them from eviction in every tier until ``release(lease_id)``, or until ``lease_ttl`` passes.
    Slots: ``reserve`` hands out slots the caller fills; each one ends in exactly one ``commit`` or
    ``abort``. Committing does not copy: the slot becomes the CPU tier's copy of the chunk.
    """

    def register(self, spec: NamespaceSpec) -> str:
        """Register a namespace (idempotent) and return its id."""

    def arena_info(self) -> ArenaInfo:
        """The arena file that clients map."""

    def lookup(
        self, namespace: str, hashes: list[bytes], lease_id: str, replaces: str = ""
    ) -> LookupResult | Coroutine[Any, Any, LookupResult]:
        """Count leading stored chunks, say which tier holds each, and lease them under lease_id;
        then end the lease replaces (when set and not lease_id), also when the lookup fails.
        The answer itself, or a coroutine for it when a lower tier must be asked (see the class)."""

    async def stage(self, lease_id: str) -> StageResult:
        """Bring every chunk of the lease into an arena slot (promoting lower-tier hits)."""

    def release(self, lease_id: str) -> None:
        """End a lease (idempotent)."""

    def reserve(self, namespace: str, hashes: list[bytes]) -> list[SlotRef | None]:
        """A slot to fill for each key; None where the chunk is already stored or no space is left."""

    def commit(
        self,
        namespace: str,
        hashes: list[bytes],
        slots: list[SlotRef],
        covered: Sequence[Sequence[bytes]] = (),
    ) -> None:
        """Publish filled slots into the CPU tier and queue them for lower tiers by the write policy;
        covered: each chunk's vLLM block hashes when known (kept with the chunk for KV events)."""

    def abort(self, slots: list[SlotRef]) -> None:
        """Give reserved slots back unfilled."""

    async def delete(self, namespace: str, hashes: list[bytes]) -> int:
        """Remove these chunks from every tier (leased ones too); returns how many were found."""

    async def disk_reads(
        self, namespace: str, hashes: list[bytes], nbytes: int, corrupt: list[bytes]
    ) -> None:
        """Count disk chunks a client read from their files itself: hits (nbytes in all), and
        corrupt ones, which are removed."""

    async def clear(self, tiers: list[Tier]) -> int:
        """Drop every unleased chunk from the named tiers; returns how many were dropped."""

    async def held(self, namespace: str, hashes: list[bytes]) -> dict[Tier, list[bool]]:
        """Whether each tier holds each chunk; no lease, no recency (the routers' lookup)."""

    def stats(self) -> StoreStats:
        """Counters of every tier, leases and slots."""

    async def close(self, drain_timeout: float = 5.0) -> None:
        """Drain queued writes within the timeout, then release tiers and the arena."""
