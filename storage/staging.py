"""Staging: bringing a lease's lower-tier hits into arena slots (promotion into the CPU tier).

Who owns what: the store's event loop owns the promotions in flight (one read per key, however
many leases wait for it) and runs each as a Task. A promotion owns the slot it reads into until
its read ends: then the slot becomes the CPU tier's copy of the chunk, or goes back. The leases
it hands the result to belong to the store's lease table: a lease released or replaced meanwhile
gets nothing, and the promoted chunk stays unpinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvtier.storage.arena import Arena
from kvtier.storage.base import ChunkKey, LowerTier, SlotRef, StageResult, Tier
from kvtier.storage.leases import Lease, LeaseTable
from kvtier.storage.tiers.cpu import CpuTier, SlotId

log = logging.getLogger(__name__)

UnpinLower = Callable[[Tier, list[ChunkKey]], None]


@dataclass(slots=True, eq=False)
class _Promotion:
    """One chunk being read from a lower tier, and the (lease, index) pairs waiting for it."""

    key: ChunkKey
    tier: Tier
    chunk_bytes: int
    waiters: list[tuple[Lease, int]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    deleted: bool = False  # delete() ran during the read: do not publish it


class Stager:
    """stage(lease_id) over the CPU tier, the lease table and the lower tiers."""

    def __init__(
        self,
        arena: Arena,
        cpu: CpuTier,
        leases: LeaseTable,
        tier_of: dict[Tier, LowerTier],
        chunk_bytes: Mapping[str, int],
        unpin_lower: UnpinLower,
    ) -> None:
        self._arena = arena
        self._chunk_bytes = chunk_bytes  # namespace -> chunk size, the store's (grows as it registers)
        self._cpu = cpu
        self._leases = leases
        self._tier_of = tier_of
        self._unpin_lower = unpin_lower
        self._promotions: dict[ChunkKey, _Promotion] = {}

    async def stage(self, lease: Lease) -> StageResult:
        """Bring every chunk of a live lease into an arena slot."""
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
                promo = _Promotion(key, lease.tiers[i], self._chunk_bytes[key.namespace])
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
        slots = [None if e is None else self._cpu.slot_of(e) for e in lease.pinned]
        return StageResult(slots, list(lease.tiers), sorted(lease.failed))

    def forget(self, keys: list[ChunkKey]) -> None:
        """These keys were deleted: a read of one in flight must not publish it."""
        for key in keys:
            promo = self._promotions.get(key)
            if promo is not None:
                promo.deleted = True

    async def settle(self, budget_s: float) -> None:
        """Let the reads in flight end within budget_s, then cancel the rest (shutdown)."""
        tasks = [p.task for p in self._promotions.values() if p.task is not None]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=budget_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _promote(self, promo: _Promotion) -> None:
        """Read one chunk from its lower tier into a fresh slot and make it a CPU chunk."""
        key = promo.key
        slot: SlotRef | None = None
        ok = False
        try:
            slot = self._cpu.reserve(promo.chunk_bytes)
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

    def _adopt(self, lease: Lease, i: int, sid: SlotId) -> None:
        """Chunk i of lease now lives in a CPU slot: the lease pins it there instead of below."""
        if not self._leases.is_current(lease):
            return  # released meanwhile: its pins are gone, the promoted chunk stays unpinned
        self._cpu.pin_entries([sid])
        lease.pinned[i] = sid
        self._let_go_below(lease, i)

    def _fail(self, lease: Lease, i: int) -> None:
        if not self._leases.is_current(lease):
            return
        lease.failed.add(i)
        self._let_go_below(lease, i)

    def _let_go_below(self, lease: Lease, i: int) -> None:
        """Drop the lease's pin of chunk i in its lower tier, if it holds one."""
        if lease.lower_pinned[i]:
            lease.lower_pinned[i] = False
            self._unpin_lower(lease.tiers[i], [lease.keys[i]])
