"""The tiered store: lookup with leases, staging (promotion), reserve/commit, and the write policy.

Who owns what: the service's event loop owns the store and everything in it (namespaces,
reservations, CPU index, leases, write queue); nothing here is touched from another thread. The
store owns the arena and the lower tiers it is given and closes them in ``close()``. Lower tiers do
their own I/O off the loop; the store moves no payload bytes itself.

Pins: a CPU chunk is pinned (never evicted, its slot never reused) by every lease that holds it and
by its queued lower-tier write. A lower-tier hit is pinned in its tier by the lease until it is
staged (then the lease pins the promoted CPU copy instead), released, replaced or expired.

Recency: a leased chunk is in use until its lease lets go of it (released, replaced by a lookup
that no longer finds it, expired), and only then can it be evicted, so that is when it becomes the
most recently used chunk; a lookup itself does not reorder the LRU. Repeated lookups of a waiting
request then cost no per-chunk LRU work, and the order is that of last use.

Deduplication (``reserve``): a key gets no slot when it is in the CPU index, already reserved, or in
the write queue. Lower tiers are not asked: that would put a round trip on every save, and a chunk
that is being saved again while a lower tier holds it is rare (the connector only saves what lookup
missed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any, cast

from kvtier.storage.arena import Arena, SlotAllocator
from kvtier.storage.base import (
    NO_SLOT_PACKED,
    ArenaError,
    ArenaInfo,
    ChunkKey,
    ClearableTier,
    LookupResult,
    LowerTier,
    NamespaceSpec,
    SlotList,
    SlotRef,
    SlotStateError,
    StageResult,
    StorageError,
    StoreStats,
    Tier,
    UnknownNamespaceError,
)
from kvtier.storage.config import StorageConfig, StoreConfig
from kvtier.storage.keys import chunk_keys, namespace_id
from kvtier.storage.leases import Lease, LeaseTable
from kvtier.storage.tiers.cpu import CpuEntry, CpuTier
from kvtier.storage.writeback import WriteBack

log = logging.getLogger(__name__)

Clock = Callable[[], float]
# Builds a ChunkKey in C: its own __new__ is Python code, which a 64-chunk call would run 64 times.
_new_tuple = tuple.__new__
_CPU = Tier.CPU  # an Enum member read through its class costs a Python-level lookup each time
# C-level getters for map() over tuples: no bytecode per chunk.
_first = itemgetter(0)  # a reservation's key, a ChunkKey's namespace, a SlotRef's offset
_second = itemgetter(1)  # a reservation's slot, a ChunkKey's prefix hash


_Reservation = tuple[ChunkKey, SlotRef]  # a plain tuple: zip() builds them in C, 64 at a time


@dataclass(slots=True, eq=False)
class _Promotion:
    """One chunk being read from a lower tier, and the (lease, index) pairs waiting for it."""

    key: ChunkKey
    tier: Tier
    waiters: list[tuple[Lease, int]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    deleted: bool = False  # delete() ran during the read: do not publish it


class TieredStore:
    """StoreAPI over the arena (CPU tier), leases, the write-behind queue and the lower tiers."""

    def __init__(
        self,
        arena: Arena,
        lower: Sequence[LowerTier] = (),
        config: StoreConfig | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        cfg = config or StoreConfig()
        self._arena = arena
        self._cfg = cfg
        self._cpu = CpuTier(SlotAllocator(arena.size))
        self._lower = sorted(lower, key=lambda t: t.tier)
        self._tier_of: dict[Tier, LowerTier] = {t.tier: t for t in self._lower}
        if len(self._tier_of) != len(self._lower) or Tier.CPU in self._tier_of:
            raise ValueError("lower tiers must be distinct and below the CPU tier")
        self._leases = LeaseTable(cfg.lease_ttl, clock)
        self._writeback: WriteBack | None = None
        if self._lower:
            self._writeback = WriteBack(
                self._lower, arena.view, self._write_done, cfg.write_queue_size, cfg.write_workers
            )
        self._namespaces: dict[str, NamespaceSpec] = {}
        self._chunk_bytes: dict[str, int] = {}  # namespace -> chunk_bytes (a computed property)
        self._reserved: dict[int, _Reservation] = {}  # slot offset -> (key, slot)
        self._reserving: dict[ChunkKey, int] = {}  # key -> offset of its reserved slot
        self._promotions: dict[ChunkKey, _Promotion] = {}  # reads from lower tiers in flight
        self._reserve_dropped = 0
        self._closed = False

    # ------------------------------------------------------------------------------------ basics
    @property
    def cpu(self) -> CpuTier:
        """The CPU tier (for stats and tests)."""
        return self._cpu

    @property
    def lower(self) -> list[LowerTier]:
        """Lower tiers, fastest first."""
        return list(self._lower)

    async def __aenter__(self) -> TieredStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register(self, spec: NamespaceSpec) -> str:
        """Register a namespace (idempotent) and return its id."""
        self._check_open()
        ns = namespace_id(spec)
        if self._cpu.allocator.extent(spec.chunk_bytes) > self._cpu.allocator.capacity:
            raise ArenaError(
                f"a chunk of {spec.chunk_bytes} bytes does not fit the arena of {self._arena.size}"
            )
        self._namespaces[ns] = spec
        self._chunk_bytes[ns] = spec.chunk_bytes
        return ns

    def arena_info(self) -> ArenaInfo:
        """The arena file that clients map."""
        return self._arena.info()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the store is closed")

    def _spec(self, namespace: str) -> NamespaceSpec:
        self._check_open()
        spec = self._namespaces.get(namespace)
        if spec is None:
            raise UnknownNamespaceError(f"namespace {namespace!r} is not registered")
        return spec

    def _chunk_bytes_of(self, namespace: str) -> int:
        """The chunk size of a registered namespace (_spec() for the hot path)."""
        if self._closed:
            raise StorageError("the store is closed")
        size = self._chunk_bytes.get(namespace)
        if size is None:
            raise UnknownNamespaceError(f"namespace {namespace!r} is not registered")
        return size

    def _expire(self) -> None:
        for lease in self._leases.sweep():
            self._unpin_lease(lease)

    # ------------------------------------------------------------------------------------ lookup
    async def lookup(
        self, namespace: str, hashes: list[bytes], lease_id: str, replaces: str = ""
    ) -> LookupResult:
        """Count leading stored chunks, say which tier holds each, and lease them under lease_id;
        then end the lease replaces (when set), as release(replaces) would."""
        chunk_bytes = self._chunk_bytes_of(namespace)
        self._expire()
        if not self._lower:
            return self._lease_cpu_prefix(
                chunk_bytes, lease_id, self._cpu.prefix(namespace, hashes), len(hashes), replaces
            )
        entries = self._cpu.entries(namespace, hashes)
        if None not in entries:
            hits = cast("list[CpuEntry]", entries)
            return self._lease_cpu_prefix(chunk_bytes, lease_id, hits, len(hashes), replaces)
        return await self._lookup_lower(namespace, hashes, lease_id, entries, replaces)

    def lookup_now(
        self, namespace: str, hashes: list[bytes], lease_id: str, replaces: str = ""
    ) -> LookupResult | None:
        """lookup() in one step when the CPU tier alone decides it; None (nothing changed) otherwise."""
        chunk_bytes = self._chunk_bytes_of(namespace)
        hits = self._cpu.prefix(namespace, hashes)
        if self._lower and len(hits) < len(hashes):
            return None  # a lower tier must be asked: only lookup() can wait for it
        self._expire()
        return self._lease_cpu_prefix(chunk_bytes, lease_id, hits, len(hashes), replaces)

    def _lease_cpu_prefix(
        self, chunk_bytes: int, lease_id: str, hits: list[CpuEntry], asked: int, replaces: str
    ) -> LookupResult:
        """Lease hits, the CPU entries of the leading chunks of a lookup of asked chunks (no lower
        tier can extend them), ending the leases lease_id and replaces had; hits is a fresh list,
        which the lease keeps.

        The same books as the general path, batched: a lookup of a long prompt is the service's
        hottest call, so nothing here does Python work per chunk that C can do instead.
        """
        num_hit = len(hits)
        self._cpu.count_lookup(num_hit, num_hit * chunk_bytes, min(num_hit + 1, asked) - num_hit)
        olds = self._pop_leases(lease_id, replaces)
        if not num_hit:
            for old in olds:
                self._unpin_lease(old)
            return LookupResult(0, [], [])
        if self._writeback is not None:
            for entry in hits:
                self._persist(entry)  # 'on_reuse' trigger; retries a dropped write
        slots = self._lease_entries(lease_id, hits, olds, chunk_bytes)
        return LookupResult(num_hit, [_CPU] * num_hit, slots)

    def _pop_leases(self, lease_id: str, replaces: str) -> list[Lease]:
        """Take the leases a lookup ends out of the table: lease_id's own and the one it replaces."""
        leases = self._leases
        olds = [old] if (old := leases.pop(lease_id)) is not None else []
        if replaces and replaces != lease_id and (gone := leases.pop(replaces)) is not None:
            olds.append(gone)
        return olds

    def _lease_entries(
        self, lease_id: str, hits: list[CpuEntry], olds: list[Lease], chunk_bytes: int
    ) -> SlotList:
        """Lease these CPU chunks under lease_id, then unpin the leases it ends (olds); returns
        their slots.

        A lookup repeated while its request waits finds the same chunks that the lease it ends
        already pins: the pins move over to the new lease instead of being taken and dropped once
        per chunk (and its chunks' recency is renewed when the new lease ends, as it would be now),
        and so do its slots, which are the same.
        """
        pinned: list[CpuEntry | None]
        donor = next((o for o in olds if o.pinned == hits and not any(o.lower_pinned)), None)
        slots = None
        if donor is not None:
            pinned, keys, slots = donor.pinned, donor.keys, donor.slots
            donor.pinned, donor.lower_pinned = [], []  # it holds nothing now: no one can unpin twice
        else:
            self._cpu.pin_entries(hits)  # before the old leases let go: shared chunks stay pinned
            pinned, keys = cast("list[CpuEntry | None]", hits), [e.key for e in hits]
        if slots is None:
            # Packed offsets and one length, as the service sends them (here and in
            # _lookup_lower): the slots of a namespace's chunks are all chunk_bytes long (reserved
            # so, and committed only into their own namespace). A comprehension, not
            # map(attrgetter): 3.11 reads a struct field faster inline.
            slots = SlotList.from_packed(b"".join([e.packed for e in hits]), chunk_bytes)
        n = len(hits)
        leases = self._leases
        leases.put(leases.new(lease_id, keys, [_CPU] * n, pinned, [False] * n, slots))
        for old in olds:
            if old is not donor:
                self._unpin_lease(old)
        return slots

    async def _lookup_lower(
        self,
        namespace: str,
        hashes: list[bytes],
        lease_id: str,
        entries: list[CpuEntry | None],
        replaces: str,
    ) -> LookupResult:
        """lookup() when lower tiers may hold chunks the CPU tier lacks."""
        keys = _chunk_keys(namespace, hashes)
        tiers: list[Tier | None] = [None if e is None else Tier.CPU for e in entries]
        held = [e for e in entries if e is not None]
        self._cpu.pin_entries(held)  # held across the lower-tier awaits, trimmed below
        try:
            await self._probe_lower(keys, tiers)
        except BaseException:
            self._cpu.unpin_entries(held)
            raise
        num_hit = next((i for i, t in enumerate(tiers) if t is None), len(keys))
        self._cpu.unpin_entries(e for e in entries[num_hit:] if e is not None)
        hit_tiers = [t for t in tiers[:num_hit] if t is not None]
        hits = entries[:num_hit]
        self._count_cpu_lookup(keys, hit_tiers, len(keys))
        for key, tier in zip(keys, hit_tiers, strict=False):  # keys may run past the prefix
            if tier is Tier.CPU:
                self._cpu.touch(key)
                self._persist(self._cpu.entry(key))  # 'on_reuse' trigger; retries a dropped write
        lower_pinned = self._pin_lower(keys[:num_hit], hit_tiers)
        olds = self._pop_leases(lease_id, replaces)
        if num_hit:
            self._leases.put(self._leases.new(lease_id, keys[:num_hit], hit_tiers, hits, lower_pinned))
        for old in olds:
            self._unpin_lease(old)
        packed = b"".join([NO_SLOT_PACKED if e is None else e.packed for e in hits])
        return LookupResult(num_hit, hit_tiers, SlotList.from_packed(packed, self._chunk_bytes_of(namespace)))

    async def _probe_lower(self, keys: list[ChunkKey], tiers: list[Tier | None]) -> None:
        """Fill tiers[i] for keys missing so far, one batched contains_many per lower tier."""
        for tier in self._lower:
            missing = [i for i, t in enumerate(tiers) if t is None]
            if not missing:
                return
            try:
                found = await tier.contains_many([keys[i] for i in missing])
            except Exception:  # a tier broke its never-raise contract: a miss, not an outage
                log.exception("contains_many of tier %s raised", tier.tier.label)
                continue
            for i, present in zip(missing, found, strict=False):
                if present:
                    tiers[i] = tier.tier

    def _count_cpu_lookup(self, keys: list[ChunkKey], hit_tiers: list[Tier], n: int) -> None:
        # The CPU tier answered for the prefix and for the key that ended it.
        hits = sum(1 for t in hit_tiers if t is Tier.CPU)
        hit_bytes = sum(
            self._namespaces[k.namespace].chunk_bytes
            for k, t in zip(keys, hit_tiers, strict=False)
            if t is Tier.CPU
        )
        asked = min(len(hit_tiers) + 1, n)
        self._cpu.count_lookup(hits, hit_bytes, asked - hits)

    def _pin_lower(self, keys: list[ChunkKey], tiers: list[Tier]) -> list[bool]:
        pinned = [False] * len(keys)
        for tier in self._lower:
            idx = [i for i, t in enumerate(tiers) if t is tier.tier]
            if not idx:
                continue
            try:
                tier.pin([keys[i] for i in idx])
            except Exception:
                log.exception("pin on tier %s raised", tier.tier.label)
                continue
            for i in idx:
                pinned[i] = True
        return pinned

    def _unpin_lease(self, lease: Lease) -> None:
        """Drop every pin lease holds, its chunks becoming the most recently used (see Recency in
        the module docstring); clears its books so a second call does nothing."""
        held: list[CpuEntry] = list(filter(None, lease.pinned))  # entries are always true: C-level
        lease.pinned[:] = [None] * len(lease.pinned)
        self._cpu.unpin_entries(held)
        self._cpu.touch_entries(held)  # those no longer indexed are skipped
        if not any(lease.lower_pinned):  # the usual lease: CPU hits only
            return
        by_tier: dict[Tier, list[ChunkKey]] = {}
        for i, key in enumerate(lease.keys):
            if lease.lower_pinned[i]:
                lease.lower_pinned[i] = False
                by_tier.setdefault(lease.tiers[i], []).append(key)
        for tier_id, keys in by_tier.items():
            self._unpin_lower(tier_id, keys)

    def _unpin_lower(self, tier_id: Tier, keys: list[ChunkKey]) -> None:
        try:
            self._tier_of[tier_id].unpin(keys)
        except Exception:
            log.exception("unpin on tier %s raised", tier_id.label)

    async def release(self, lease_id: str) -> None:
        """End a lease (idempotent)."""
        self.release_now(lease_id)

    def release_now(self, lease_id: str) -> None:
        """release() in one step."""
        self._check_open()
        lease = self._leases.pop(lease_id)
        if lease is not None:
            self._unpin_lease(lease)
        self._expire()

    # ------------------------------------------------------------------------------------ stage
    async def stage(self, lease_id: str) -> StageResult:
        """Bring every chunk of the lease into an arena slot (promoting lower-tier hits)."""
        self._check_open()
        self._expire()
        lease = self._leases.get(lease_id)
        if lease is None:
            return StageResult([], [], [])
        self._leases.renew(lease)
        tasks: set[asyncio.Task[None]] = set()
        for i in range(len(lease)):
            if lease.pinned[i] is not None or i in lease.failed:
                continue
            key = lease.keys[i]
            existing = self._cpu.entry(key)
            if existing is not None:  # saved or promoted by someone else since the lookup
                self._adopt(lease, i, existing)
                continue
            promo = self._promotions.get(key)
            if promo is None:  # one read per key, however many leases wait for it
                promo = _Promotion(key, lease.tiers[i])
                self._promotions[key] = promo
                promo.task = asyncio.create_task(self._promote(promo), name="kvtier-promote")
            if not any(w is lease and j == i for w, j in promo.waiters):
                promo.waiters.append((lease, i))
            if promo.task is not None:
                tasks.add(promo.task)
        if tasks:
            # Not cancelled with this call: each promotion publishes or frees its slot when its read
            # ends, and hands the result to every lease still waiting for it at that moment.
            await asyncio.wait(tasks)
        if not self._leases.is_current(lease):
            return StageResult([], [], [])  # released or replaced meanwhile: its slots are not held
        slots = [None if e is None else e.slot for e in lease.pinned]
        return StageResult(slots, list(lease.tiers), sorted(lease.failed))

    async def _promote(self, promo: _Promotion) -> None:
        """Read one chunk from its lower tier into a fresh slot and make it a CPU chunk."""
        key = promo.key
        slot: SlotRef | None = None
        ok = False
        try:
            slot = self._cpu.reserve(self._namespaces[key.namespace].chunk_bytes)
            if slot is None:
                self._cpu.count_error("full")
                return
            ok = await self._read_into(self._tier_of[promo.tier], key, slot)
        finally:
            del self._promotions[key]
            if slot is not None and ok and not promo.deleted:
                self._cpu.commit(key, slot, persisted=True)  # frees slot if key arrived meanwhile
            elif slot is not None:
                self._cpu.free(slot)
            held = self._cpu.entry(key)
            for lease, i in promo.waiters:
                if held is not None:
                    self._adopt(lease, i, held)
                else:
                    self._fail(lease, i)

    async def _read_into(self, tier: LowerTier, key: ChunkKey, slot: SlotRef) -> bool:
        view = self._arena.view(slot)
        try:
            return await tier.get_into(key, view) is True
        except Exception:
            log.exception("get_into of tier %s raised", tier.tier.label)
            return False
        finally:
            with contextlib.suppress(BufferError):
                view.release()

    def _adopt(self, lease: Lease, i: int, entry: CpuEntry) -> None:
        """Chunk i of lease now lives in a CPU slot: the lease pins it there instead of below."""
        if not self._leases.is_current(lease):
            return  # released meanwhile: its pins are gone, the promoted chunk stays unpinned
        self._cpu.pin_entries((entry,))
        lease.pinned[i] = entry
        if lease.lower_pinned[i]:
            lease.lower_pinned[i] = False
            self._unpin_lower(lease.tiers[i], [lease.keys[i]])

    def _fail(self, lease: Lease, i: int) -> None:
        if not self._leases.is_current(lease):
            return
        lease.failed.add(i)
        if lease.lower_pinned[i]:
            lease.lower_pinned[i] = False
            self._unpin_lower(lease.tiers[i], [lease.keys[i]])

    # ------------------------------------------------------------------------------------ saving
    async def reserve(self, namespace: str, hashes: list[bytes]) -> list[SlotRef | None]:
        """A slot to fill for each key; None where the chunk is already stored or no space is left.

        Dedup: see the module docstring. A None for lack of space is counted in reserve_dropped.
        """
        return self.reserve_now(namespace, hashes)

    def reserve_now(self, namespace: str, hashes: list[bytes]) -> list[SlotRef | None]:
        """reserve() in one step."""
        chunk_bytes = self._chunk_bytes_of(namespace)
        self._expire()
        keys = _chunk_keys(namespace, hashes)
        stored = self._cpu.entries(namespace, hashes)
        if self._all_new(keys, stored):
            return self._reserve_all(keys, chunk_bytes)
        reserving, reserved = self._reserving, self._reserved
        queued = self._writeback.pending if self._writeback is not None else None
        out: list[SlotRef | None] = [None] * len(keys)
        wanted: dict[ChunkKey, int] = {}  # key -> index of its first occurrence in this call
        again: list[ChunkKey] = []  # later occurrences: they get a slot only if the first did not
        for i, key in enumerate(keys):
            if key in wanted:
                again.append(key)
            elif stored[i] is None and key not in reserving and (queued is None or not queued(key)):
                wanted[key] = i
        slots = self._cpu.reserve_many(chunk_bytes, len(wanted))
        for (key, i), slot in zip(wanted.items(), slots, strict=True):
            if slot is None:
                self._reserve_dropped += 1
                continue
            reserved[slot.offset] = (key, slot)
            reserving[key] = slot.offset
            out[i] = slot
        # A repeat of a key whose first occurrence found no space would have found none either.
        self._reserve_dropped += sum(1 for key in again if out[wanted[key]] is None)
        return out

    def _all_new(self, keys: list[ChunkKey], stored: list[CpuEntry | None]) -> bool:
        """True when no key is stored, reserved, queued for a write or asked for twice (a save)."""
        if stored.count(None) != len(keys) or len(set(keys)) != len(keys):
            return False
        if not self._reserving.keys().isdisjoint(keys):
            return False
        return self._writeback is None or not any(map(self._writeback.pending, keys))

    def _reserve_all(self, keys: list[ChunkKey], chunk_bytes: int) -> list[SlotRef | None]:
        """reserve_now() for keys that are all new, in C-level passes while every key gets a slot."""
        slots = self._cpu.reserve_many(chunk_bytes, len(keys))
        granted = list(filter(None, slots))  # a SlotRef is a non-empty tuple: always true
        if len(granted) != len(slots):  # out of space for some: record those that got one
            self._reserve_dropped += len(slots) - len(granted)
            pairs = [(k, s) for k, s in zip(keys, slots, strict=True) if s is not None]
            keys = list(map(_first, pairs))
        else:
            pairs = list(zip(keys, granted, strict=True))
        offsets = list(map(_first, granted))
        self._reserved.update(zip(offsets, pairs, strict=True))
        self._reserving.update(zip(keys, offsets, strict=True))
        return slots

    async def commit(self, namespace: str, hashes: list[bytes], slots: list[SlotRef]) -> None:
        """Publish filled slots into the CPU tier; queue them for lower tiers per write policy."""
        self.commit_now(namespace, hashes, slots)

    def commit_now(self, namespace: str, hashes: list[bytes], slots: list[SlotRef]) -> None:
        """commit() in one step."""
        self._chunk_bytes_of(namespace)
        if len(hashes) != len(slots):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots")
        keys = self._check_reserved(slots, namespace, hashes)
        self._unreserve(slots)
        entries = self._cpu.commit_many(keys, slots, checked=True)  # reserved: allocated, uncommitted
        if self._cfg.write_policy == "through" and self._writeback is not None:
            for entry in entries:
                self._persist(entry)

    async def abort(self, slots: list[SlotRef]) -> None:
        """Give reserved slots back unfilled."""
        self.abort_now(slots)

    def abort_now(self, slots: list[SlotRef]) -> None:
        """abort() in one step."""
        self._check_open()
        self._check_reserved(slots)
        self._unreserve(slots)
        for slot in slots:
            self._cpu.free(slot)

    def _check_reserved(
        self, slots: list[SlotRef], namespace: str = "", hashes: list[bytes] | None = None
    ) -> list[ChunkKey]:
        """The keys slots are reserved for (each for its hash, when given); raises before changing
        anything when one is not."""
        offsets = list(map(_first, slots))
        found: list[Any] = list(map(self._reserved.get, offsets))
        try:
            keys: list[ChunkKey] = list(map(_first, found))
        except TypeError:  # a None: some slot is not reserved; see which below
            return self._check_each_reserved(slots, namespace, hashes)
        # Whole lists compared in C; the reservations' own keys: no new key object per chunk.
        if (
            list(map(_second, found)) != list(slots)
            or len(set(offsets)) != len(offsets)
            or (hashes is not None and not _keys_match(keys, namespace, hashes))
        ):
            return self._check_each_reserved(slots, namespace, hashes)
        return keys

    def _check_each_reserved(
        self, slots: list[SlotRef], namespace: str, hashes: list[bytes] | None
    ) -> list[ChunkKey]:
        """_check_reserved(), slot by slot: raises for the first slot that is not reserved."""
        reserved = self._reserved
        keys: list[ChunkKey] = []
        seen: set[int] = set()
        for i, slot in enumerate(slots):
            res = reserved.get(slot.offset)
            if res is None or res[1] != slot or slot.offset in seen:
                raise SlotStateError(f"{slot} is not a reserved slot")
            if hashes is not None and res[0] != (namespace, hashes[i]):
                raise SlotStateError(f"{slot} was reserved for another chunk")
            seen.add(slot.offset)
            keys.append(res[0])
        return keys

    def _unreserve(self, slots: list[SlotRef]) -> None:
        """Forget the reservations of these (checked) slots."""
        found = list(map(self._reserved.pop, map(_first, slots)))
        deque(map(self._reserving.__delitem__, map(_first, found)), maxlen=0)

    def _persist(self, entry: CpuEntry | None) -> None:
        """Queue a CPU chunk for the lower tiers once; its slot stays pinned until written."""
        if entry is None or entry.persisted or self._writeback is None:
            return
        self._cpu.pin(entry.slot)
        if self._writeback.offer(entry.key, entry.slot):
            entry.persisted = True
        else:
            self._cpu.unpin(entry.slot)

    def _write_done(self, key: ChunkKey, slot: SlotRef) -> None:
        self._cpu.unpin(slot)

    # ------------------------------------------------------------------------------------ removal
    async def delete(self, namespace: str, hashes: list[bytes]) -> int:
        """Remove these chunks from every tier (leased ones too); returns how many were found."""
        self._spec(namespace)
        keys = chunk_keys(namespace, hashes)
        found = [self._cpu.remove(k) for k in keys]
        for key in keys:
            if self._writeback is not None:
                self._writeback.cancel(key)
            promo = self._promotions.get(key)
            if promo is not None:
                promo.deleted = True
        for tier in self._lower:
            present = await self._contains(tier, keys)
            found = [a or b for a, b in zip(found, present, strict=True)]
            # Delete every key, not only those found: a tier in trouble may have answered "absent".
            await asyncio.gather(*(tier.delete(k) for k in keys), return_exceptions=True)
        return sum(found)

    async def _contains(self, tier: LowerTier, keys: list[ChunkKey]) -> list[bool]:
        try:
            answer = list(await tier.contains_many(keys))
        except Exception:
            log.exception("contains_many of tier %s raised", tier.tier.label)
            return [False] * len(keys)
        return (answer + [False] * len(keys))[: len(keys)]

    async def clear(self, tiers: list[Tier]) -> int:
        """Drop every unleased chunk from the named tiers; returns how many were dropped."""
        self._check_open()
        self._expire()
        dropped = self._cpu.clear() if Tier.CPU in tiers else 0
        for tier in self._lower:
            if tier.tier not in tiers:
                continue
            if isinstance(tier, ClearableTier):
                dropped += await tier.clear()
            else:
                log.warning("tier %s cannot be cleared", tier.tier.label)
        return dropped

    async def flush(self, timeout: float = 5.0) -> bool:  # noqa: ASYNC109 (a wait budget)
        """Wait until every queued lower-tier write finished; False when timeout passed first."""
        self._check_open()
        return self._writeback is None or await self._writeback.drain(timeout)

    # -------------------------------------------------------------------------------- stats, close
    def stats(self) -> StoreStats:
        """Counters of every tier, leases and slots."""
        if not self._closed:
            self._expire()
        tiers = {"cpu": self._cpu.stats()}
        for tier in self._lower:
            tiers[tier.tier.label] = tier.stats()
        alloc = self._cpu.allocator
        wb = self._writeback
        return StoreStats(
            tiers=tiers,
            leases_active=len(self._leases),
            slots_in_use=alloc.slots_in_use,
            slots_total_bytes=alloc.used_bytes,
            write_queue_depth=wb.depth if wb else 0,
            writes_dropped=wb.dropped if wb else 0,
            namespaces=len(self._namespaces),
            reserve_dropped=self._reserve_dropped,
        )

    async def close(self, drain_timeout: float = 5.0) -> None:
        """Drain queued writes within the timeout, then release tiers and the arena."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        try:
            if self._writeback is not None:
                await self._writeback.close(drain_timeout)
            await self._settle_promotions(max(deadline - loop.time(), 0.0))
            for lease in self._leases.drain():
                self._unpin_lease(lease)
            for tier in self._lower:
                try:
                    await tier.close()
                except Exception:
                    log.exception("closing tier %s failed", tier.tier.label)
        finally:
            self._arena.close()

    async def _settle_promotions(self, budget_s: float) -> None:
        tasks = [p.task for p in self._promotions.values() if p.task is not None]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=budget_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _keys_match(keys: list[ChunkKey], namespace: str, hashes: list[bytes]) -> bool:
    """True when keys are namespace's keys of hashes, in order (compared in C)."""
    return list(map(_first, keys)).count(namespace) == len(keys) and list(map(_second, keys)) == list(hashes)


def _chunk_keys(namespace: str, hashes: list[bytes]) -> list[ChunkKey]:
    """chunk_keys(), built in C when every hash is bytes already (as the service decodes them).

    A NamedTuple's own __new__ is Python code: a 64-chunk reserve spent more time building its
    keys than using them. tuple.__new__ builds the same ChunkKey without it (see _new_tuple).
    """
    if set(map(type, hashes)) <= {bytes}:
        return cast("list[ChunkKey]", list(map(_new_tuple, repeat(ChunkKey), zip(repeat(namespace), hashes))))
    return chunk_keys(namespace, hashes)


async def build_store(config: StorageConfig, clock: Clock = time.monotonic) -> TieredStore:
    """The store the config describes: arena in shm_dir, disk and Redis tiers when configured."""
    arena = Arena.create(config.shm_dir, config.cpu_size)
    lower: list[Any] = []
    try:
        if config.disk is not None:
            from kvtier.storage.tiers.disk import DiskTier

            lower.append(DiskTier(config.disk))
            await lower[-1].start()
        if config.redis is not None:
            from kvtier.storage.tiers.redis import RedisTier

            lower.append(RedisTier(config.redis))
            await lower[-1].start()
        return TieredStore(arena, lower, config.store, clock)
    except BaseException:
        for tier in lower:
            with contextlib.suppress(Exception):
                await tier.close()
        arena.close()
        raise
