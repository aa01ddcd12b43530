"""CPU tier: the arena's committed slots, indexed by chunk key, evicted LRU by bytes.

Who owns what: the service's event loop owns this object (no locks). It owns the slot allocator, the
index key -> entry, the LRU order and the pin counts. Pins are counted per slot, not per key,
because a deleted or replaced chunk's slot must stay untouched while a lease or a queued write still
uses it: such a slot leaves the index at once and goes back to the allocator when its last pin goes.

Zero copy: ``commit`` publishes the slot a worker filled; no byte is moved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from storage.arena import SlotAllocator
from storage.base import ChunkKey, SlotRef, SlotStateError, Tier, TierStats
from storage.eviction import LRUPolicy


@dataclass(slots=True)
class CpuEntry:
    """A committed chunk: its slot, how many holders pin it, and whether lower tiers have it."""

    key: ChunkKey
    slot: SlotRef
    pins: int = 0
    persisted: bool = False  # queued for, or read from, the lower tiers: never queue it again
    indexed: bool = True  # False once deleted or replaced while still pinned


class CpuTier:
    """Index of committed arena slots with LRU eviction; pinned chunks are never evicted."""

    tier = Tier.CPU

    def __init__(self, allocator: SlotAllocator) -> None:
        self._alloc = allocator
        self._index: dict[ChunkKey, CpuEntry] = {}
        self._by_offset: dict[int, CpuEntry] = {}
        self._lru: LRUPolicy[ChunkKey] = LRUPolicy()
        self._stats = TierStats(capacity=allocator.capacity)
        self._bytes = 0

    # ------------------------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def entry(self, key: ChunkKey) -> CpuEntry | None:
        """The indexed entry of key, or None."""
        return self._index.get(key)

    def get(self, key: ChunkKey) -> SlotRef | None:
        """The slot of key, or None (no stats, no LRU change)."""
        entry = self._index.get(key)
        return entry.slot if entry is not None else None

    def touch(self, key: ChunkKey) -> None:
        """Mark key most recently used."""
        self._lru.touch(key)

    def count_lookup(self, hits: int, hit_bytes: int, misses: int) -> None:
        """Add one lookup's hits and misses of this tier."""
        self._stats.hits += hits
        self._stats.bytes_read += hit_bytes
        self._stats.misses += misses

    @property
    def allocator(self) -> SlotAllocator:
        """The arena's slot allocator."""
        return self._alloc

    # ------------------------------------------------------------------------------------ slots
    def reserve(self, length: int) -> SlotRef | None:
        """A free slot of length bytes, evicting unpinned chunks LRU-first; None if impossible."""
        if self._alloc.extent(length) > self._alloc.capacity:
            return None
        while True:
            slot = self._alloc.alloc(length)
            if slot is not None:
                return slot
            # Fragmentation can leave free bytes without a fitting hole: evict at least one chunk.
            need = max(self._alloc.extent(length) - self._alloc.free_bytes, 1)
            victims = self._lru.victims(need, self._is_pinned)
            if not victims:
                return None
            for key in victims:
                self._evict(key)

    def free(self, slot: SlotRef) -> None:
        """Give back a reserved, never committed slot."""
        if slot.offset in self._by_offset:
            raise SlotStateError(f"{slot} is committed; it cannot be freed as a reservation")
        self._alloc.free(slot)

    def commit(self, key: ChunkKey, slot: SlotRef, *, persisted: bool = False) -> CpuEntry:
        """Publish a filled reserved slot as key's chunk; if key is already held, slot is freed."""
        if not self._alloc.is_allocated(slot) or slot.offset in self._by_offset:
            raise SlotStateError(f"{slot} is not a reserved slot")
        existing = self._index.get(key)
        if existing is not None:
            self._alloc.free(slot)
            self._lru.touch(key)
            return existing
        entry = CpuEntry(key, slot, persisted=persisted)
        self._index[key] = entry
        self._by_offset[slot.offset] = entry
        self._lru.add(key, self._alloc.extent(slot.length))
        self._bytes += slot.length
        self._stats.stores += 1
        self._stats.bytes_written += slot.length
        return entry

    def pin(self, slot: SlotRef) -> None:
        """Keep the chunk in slot from eviction and its slot from reuse until unpin()."""
        entry = self._by_offset.get(slot.offset)
        if entry is None or entry.slot != slot:
            raise SlotStateError(f"{slot} holds no committed chunk")
        entry.pins += 1

    def unpin(self, slot: SlotRef) -> None:
        """Undo one pin(); a removed chunk's slot is freed with its last pin."""
        entry = self._by_offset.get(slot.offset)
        if entry is None or entry.slot != slot or entry.pins <= 0:
            raise SlotStateError(f"{slot} is not pinned")
        entry.pins -= 1
        if entry.pins == 0 and not entry.indexed:
            del self._by_offset[slot.offset]
            self._alloc.free(slot)

    # ------------------------------------------------------------------------------------ removal
    def remove(self, key: ChunkKey) -> bool:
        """Drop key from the index now (pinned or not); its slot is freed when no longer pinned."""
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._lru.remove(key)
        self._bytes -= entry.slot.length
        entry.indexed = False
        if entry.pins == 0:
            del self._by_offset[entry.slot.offset]
            self._alloc.free(entry.slot)
        return True

    def clear(self) -> int:
        """Drop every unpinned chunk; returns how many were dropped."""
        keys = [k for k, e in self._index.items() if e.pins == 0]
        for key in keys:
            self.remove(key)
        return len(keys)

    def _is_pinned(self, key: ChunkKey) -> bool:
        return self._index[key].pins > 0

    def _evict(self, key: ChunkKey) -> None:
        self.remove(key)
        self._stats.evictions += 1

    # ------------------------------------------------------------------------------------ stats
    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""
        snap = dataclasses.replace(self._stats, errors=dict(self._stats.errors))
        snap.chunks = len(self._index)
        snap.bytes = self._bytes
        return snap

    def count_error(self, kind: str) -> None:
        """Add one error of this kind."""
        self._stats.count_error(kind)

    @property
    def pinned_chunks(self) -> int:
        """Slots held by at least one pin (indexed or not)."""
        return sum(1 for e in self._by_offset.values() if e.pins > 0)
