"""The tiered store: lookups and their leases over every tier, and the StoreAPI the service calls.

Who owns what: the service's event loop owns the store and everything in it; nothing here is touched
from another thread. The store owns the arena and the lower tiers it is given, and closes them.
Design: docs/internals.md#tiered-store-storepy-leasespy-reservationspy
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

from kvtier.storage.arena import Arena, SlotAllocator
from kvtier.storage.base import (
    ArenaError,
    ArenaInfo,
    ChunkKey,
    ClearableTier,
    LookupResult,
    LowerTier,
    NamespaceSpec,
    SlotList,
    SlotRef,
    StageResult,
    StorageError,
    StoreStats,
    Tier,
    TierListener,
    UnknownNamespaceError,
)
from kvtier.storage.config import StorageConfig, StoreConfig
from kvtier.storage.keys import chunk_keys, namespace_id
from kvtier.storage.leases import Lease, LeaseTable
from kvtier.storage.reservations import Reservations
from kvtier.storage.signing import Signer
from kvtier.storage.staging import Stager
from kvtier.storage.tiers.cpu import CpuTier, SlotId
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.writeback import WriteBack

log = logging.getLogger(__name__)

Clock = Callable[[], float]
_CPU = Tier.CPU  # an Enum member read through its class costs a Python-level lookup each time


class TieredStore:
    """StoreAPI over the arena (CPU tier), leases, the write-behind queue and the lower tiers."""

    def __init__(
        self,
        arena: Arena,
        lower: Sequence[LowerTier] = (),
        config: StoreConfig | None = None,
        clock: Clock = time.monotonic,
        listener: TierListener | None = None,
    ) -> None:
        cfg = config or StoreConfig()
        self._arena = arena
        # The lower tiers take their listener when built (the disk index loads from their start()).
        self._cpu = CpuTier(SlotAllocator(arena.size), listener, self._give_up_writes)
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
        self._chunk_bytes: dict[str, int] = {}  # registered namespace -> its chunk_bytes
        self._saves = Reservations(self._cpu, self._writeback, cfg.write_policy)
        self._stager = Stager(
            arena, self._cpu, self._leases, self._tier_of, self._chunk_bytes, self._unpin_lower
        )
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

    def register(self, spec: NamespaceSpec) -> str:
        """Register a namespace (idempotent) and return its id."""
        self._check_open()
        ns = namespace_id(spec)
        if self._cpu.allocator.extent(spec.chunk_bytes) > self._cpu.allocator.capacity:
            raise ArenaError(
                f"a chunk of {spec.chunk_bytes} bytes does not fit the arena of {self._arena.size}"
            )
        self._chunk_bytes[ns] = spec.chunk_bytes
        return ns

    def arena_info(self) -> ArenaInfo:
        """The arena file that clients map."""
        return self._arena.info()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the store is closed")

    def _chunk_bytes_of(self, namespace: str) -> int:
        """The chunk size of a registered namespace; raises when it is not, or the store is closed."""
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
    def lookup(
        self, namespace: str, hashes: list[bytes], lease_id: str, replaces: str = ""
    ) -> LookupResult | Coroutine[Any, Any, LookupResult]:
        """Count leading stored chunks, say which tier holds each, and lease them under lease_id;
        then end the lease replaces (when set and not lease_id), also when the lookup fails.
        The answer itself, or a coroutine for it when a lower tier must be asked (see StoreAPI)."""
        try:
            chunk_bytes = self._chunk_bytes_of(namespace)
            hits = self._cpu.prefix(namespace, hashes)
            if self._lower and len(hits) < len(hashes):
                return self._lookup_lower(namespace, hashes, lease_id, replaces)
            self._expire()
            return self._lease_cpu_prefix(chunk_bytes, lease_id, namespace, hashes, hits, replaces)
        except BaseException:
            self._end_replaced(lease_id, replaces)
            raise

    def _end_replaced(self, lease_id: str, replaces: str) -> None:
        """A lookup that failed still ends the lease it replaces: its caller has let go of it."""
        if replaces and replaces != lease_id and not self._closed:
            self.release(replaces)

    def _lease_cpu_prefix(
        self,
        chunk_bytes: int,
        lease_id: str,
        namespace: str,
        hashes: list[bytes],
        hits: list[SlotId],
        replaces: str,
    ) -> LookupResult:
        """Lease hits, the CPU chunks (slot ids) of the leading hashes of a lookup (no lower tier can
        extend them), ending the leases lease_id and replaces had; hits is a fresh list, which the
        lease keeps.

        The same books as the general path, batched: a lookup of a long prompt is the service's
        hottest call, so nothing here does Python work per chunk that C can do instead.
        """
        num_hit = len(hits)
        self._cpu.count_lookup(num_hit, num_hit * chunk_bytes, min(num_hit + 1, len(hashes)) - num_hit)
        olds = self._pop_leases(lease_id, replaces)
        if not num_hit:
            for old in olds:
                self._unpin_lease(old)
            return LookupResult(0, [], [])
        self._saves.persist_all(hits)
        slots = self._lease_entries(lease_id, hits, olds, chunk_bytes, namespace, hashes)
        return LookupResult(num_hit, [_CPU] * num_hit, slots)

    def _pop_leases(self, lease_id: str, replaces: str) -> list[Lease]:
        """Take the leases a lookup ends out of the table: lease_id's own and the one it replaces."""
        leases = self._leases
        olds = [old] if (old := leases.pop(lease_id)) is not None else []
        if replaces and replaces != lease_id and (gone := leases.pop(replaces)) is not None:
            olds.append(gone)
        return olds

    def _lease_entries(
        self,
        lease_id: str,
        hits: list[SlotId],
        olds: list[Lease],
        chunk_bytes: int,
        namespace: str,
        hashes: list[bytes],
    ) -> SlotList:
        """Lease these CPU chunks under lease_id, then unpin the leases it ends (olds); returns
        their slots.

        A lookup repeated while its request waits finds the same chunks that the lease it ends
        already pins: the pins move over to the new lease instead of being taken and dropped once
        per chunk (and its chunks' recency is renewed when the new lease ends, as it would be now),
        and so do its slots, which are the same.
        """
        pinned: list[SlotId | None]
        donor = next((o for o in olds if o.pinned == hits and not any(o.lower_pinned)), None)
        slots = None
        if donor is not None:
            pinned, keys, slots = donor.pinned, donor.keys, donor.slots
            donor.pinned, donor.lower_pinned = [], []  # it holds nothing now: no one can unpin twice
        else:
            self._cpu.pin_entries(hits)  # before the old leases let go: shared chunks stay pinned
            pinned = cast("list[SlotId | None]", hits)
            keys = chunk_keys(namespace, hashes[: len(hits)] if len(hits) < len(hashes) else hashes)
        if slots is None:
            # Packed offsets and one length, as the service sends them: a namespace's slots are all
            # chunk_bytes long.
            slots = SlotList.from_packed(self._cpu.packed(hits), chunk_bytes)
        n = len(hits)
        leases = self._leases
        leases.put(leases.new(lease_id, keys, [_CPU] * n, pinned, [False] * n, slots))
        for old in olds:
            if old is not donor:
                self._unpin_lease(old)
        return slots

    async def _lookup_lower(
        self, namespace: str, hashes: list[bytes], lease_id: str, replaces: str
    ) -> LookupResult:
        """lookup() when lower tiers may hold chunks the CPU tier lacks (run when awaited: the CPU
        tier is read again here, as it may have changed since lookup() returned)."""
        try:
            chunk_bytes = self._chunk_bytes_of(namespace)
            self._expire()
            entries = self._cpu.entries(namespace, hashes)
            if None not in entries:  # stored meanwhile: the CPU tier decides after all
                hits = cast("list[SlotId]", entries)
                return self._lease_cpu_prefix(chunk_bytes, lease_id, namespace, hashes, hits, replaces)
            return await self._lease_lower_prefix(
                chunk_bytes, chunk_keys(namespace, hashes), lease_id, entries, replaces
            )
        except BaseException:
            self._end_replaced(lease_id, replaces)
            raise

    async def _lease_lower_prefix(
        self,
        chunk_bytes: int,
        keys: list[ChunkKey],
        lease_id: str,
        entries: list[SlotId | None],
        replaces: str,
    ) -> LookupResult:
        """Ask the lower tiers for the keys the CPU tier lacks, then lease the stored prefix."""
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
        cpu_hits = hit_tiers.count(Tier.CPU)
        # The CPU tier answered for the prefix and for the key that ended it.
        self._cpu.count_lookup(cpu_hits, cpu_hits * chunk_bytes, min(num_hit + 1, len(keys)) - cpu_hits)
        for key, tier in zip(keys, hit_tiers, strict=False):  # keys may run past the prefix
            if tier is Tier.CPU:
                self._cpu.touch(key)
                self._saves.persist(self._cpu.entry(key))  # 'on_reuse' trigger; retries a dropped write
        lower_pinned = self._pin_lower(keys[:num_hit], hit_tiers)
        olds = self._pop_leases(lease_id, replaces)
        if num_hit:
            self._leases.put(self._leases.new(lease_id, keys[:num_hit], hit_tiers, hits, lower_pinned))
        for old in olds:
            self._unpin_lease(old)
        return LookupResult(num_hit, hit_tiers, SlotList.from_packed(self._cpu.packed(hits), chunk_bytes))

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

    # ------------------------------------------------------------------------------------ leases
    def release(self, lease_id: str) -> None:
        """End a lease (idempotent)."""
        self._check_open()
        lease = self._leases.pop(lease_id)
        if lease is not None:
            self._unpin_lease(lease)
        self._expire()

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
        held: list[SlotId] = list(filter(None, lease.pinned))  # slot ids are >= 1: C-level
        lease.pinned[:] = [None] * len(lease.pinned)
        self._cpu.unpin_entries(held)
        self._cpu.touch_entries(held)  # a bit set on a chunk no longer indexed is harmless
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

    async def stage(self, lease_id: str) -> StageResult:
        """Bring every chunk of the lease into an arena slot (promoting lower-tier hits)."""
        self._check_open()
        self._expire()
        lease = self._leases.get(lease_id)
        if lease is None:
            return StageResult([], [], [])
        return await self._stager.stage(lease)

    # ------------------------------------------------------------------------------------ saving
    def reserve(self, namespace: str, hashes: list[bytes]) -> list[SlotRef | None]:
        """A slot to fill for each key; None where the chunk is already stored or no space is left.

        Dedup: see storage.reservations. A None for lack of space is counted in reserve_dropped.
        """
        chunk_bytes = self._chunk_bytes_of(namespace)
        self._expire()  # the chunks of expired leases may make room
        return self._saves.reserve(namespace, hashes, chunk_bytes)

    def commit(
        self,
        namespace: str,
        hashes: list[bytes],
        slots: list[SlotRef],
        covered: Sequence[Sequence[bytes]] = (),
    ) -> None:
        """Publish filled slots into the CPU tier; queue them for lower tiers per write policy.
        covered: each chunk's vLLM block hashes, when known (kept with the chunk for KV events)."""
        self._chunk_bytes_of(namespace)
        self._saves.commit(namespace, hashes, slots, covered)

    def abort(self, slots: list[SlotRef]) -> None:
        """Give reserved slots back unfilled."""
        self._check_open()
        self._saves.abort(slots)

    def _write_done(self, key: ChunkKey, slot: SlotRef, written: bool) -> None:
        """A queued write ended, or never ran: its slot loses the pin Reservations.persist took."""
        self._cpu.unpin(slot, written=written)

    def _give_up_writes(self, need_bytes: int) -> int:
        """The CPU tier's last resort when every chunk is pinned: queued writes that have not started
        give way to a save, oldest first, when theirs is the only pin on the slot (their on_done
        unpins it); returns the bytes given up."""
        wb = self._writeback
        return 0 if wb is None else wb.give_up(need_bytes, self._cpu.unpin_frees)

    # ------------------------------------------------------------------------------------ removal
    async def disk_reads(
        self, namespace: str, hashes: list[bytes], nbytes: int, corrupt: list[bytes]
    ) -> None:
        """Count disk chunks a client read from their files itself: hits (nbytes in all), and
        corrupt ones, which are removed."""
        self._chunk_bytes_of(namespace)
        disk = next((t for t in self._lower if isinstance(t, DiskTier)), None)
        if disk is not None:
            await disk.read_elsewhere(chunk_keys(namespace, hashes), nbytes, chunk_keys(namespace, corrupt))

    async def delete(self, namespace: str, hashes: list[bytes]) -> int:
        """Remove these chunks from every tier (leased ones too); returns how many were found."""
        self._chunk_bytes_of(namespace)
        keys = chunk_keys(namespace, hashes)
        found = [self._cpu.remove(k) for k in keys]
        if self._writeback is not None:
            for key in keys:
                self._writeback.cancel(key)
        self._stager.forget(keys)
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

    async def held(self, namespace: str, hashes: list[bytes]) -> dict[Tier, list[bool]]:
        """Whether each tier holds each chunk of hashes, taking no lease and changing no recency
        (a router's question; the namespace need not be registered). A lower tier that cannot
        answer holds none."""
        self._check_open()
        out = {Tier.CPU: [e is not None for e in self._cpu.entries(namespace, hashes)]}
        keys = chunk_keys(namespace, hashes)
        for tier in self._lower:
            out[tier.tier] = await self._contains(tier, keys)
        return out

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
            namespaces=len(self._chunk_bytes),
            reserve_dropped=self._saves.dropped,
            writes_yielded=wb.yielded if wb else 0,
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
            await self._stager.settle(max(deadline - loop.time(), 0.0))
            for lease in self._leases.drain():
                self._unpin_lease(lease)
            for tier in self._lower:
                try:
                    await tier.close()
                except Exception:
                    log.exception("closing tier %s failed", tier.tier.label)
        finally:
            self._arena.close()


async def build_store(
    config: StorageConfig, clock: Clock = time.monotonic, listener: TierListener | None = None
) -> TieredStore:
    """The store the config describes: arena in shm_dir, disk, Redis and object tiers when configured;
    listener (KV events) is told of every chunk that enters or leaves any tier, the disk index's
    load included."""
    arena = Arena.create(config.shm_dir, config.cpu_size)
    signer = Signer(config.tier_keys) if config.tier_keys else None  # the shared tiers' MAC keys
    lower: list[Any] = []
    try:
        if config.disk is not None:
            from kvtier.storage.tiers.disk import DiskTier

            lower.append(DiskTier(config.disk, listener=listener))
            await lower[-1].start()
        if config.redis is not None:
            from kvtier.storage.tiers.redis import RedisTier

            lower.append(RedisTier(config.redis, listener=listener, signer=signer))
            await lower[-1].start()
        if config.object is not None:
            from kvtier.storage.tiers.object import ObjectTier

            lower.append(ObjectTier(config.object, listener=listener, signer=signer))
            await lower[-1].start()
        return TieredStore(arena, lower, config.store, clock, listener)
    except BaseException:
        for tier in lower:
            with contextlib.suppress(Exception):
                await tier.close()
        arena.close()
        raise
