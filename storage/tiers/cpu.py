"""CPU tier: the arena's committed slots, indexed by chunk key, evicted LRU by bytes.

Who owns what: the service's event loop owns this object (no locks): the slot allocator, the index
key -> entry, the LRU order and the pin counts (per slot, not per key). A pin belongs to whoever took
it (a lease, a queued write); reserve() asks the reclaim hook to end pins that may give way.
Design: docs/internals.md#cpu-tier-cpupy
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import cast

import msgspec

from kvtier.storage.arena import SlotAllocator
from kvtier.storage.base import (
    PACKED_OFFSET,
    ChunkKey,
    SlotRef,
    SlotStateError,
    Tier,
    TierListener,
    TierStats,
)
from kvtier.storage.eviction import LRUPolicy


# One slot's state: compared and hashed by identity, cheaply. A msgspec Struct, not a dataclass:
# its __init__ runs in C (a 64-chunk commit makes 64 of them), and gc=False since it refers to no
# container that could lead back to it.
class CpuEntry(msgspec.Struct, eq=False, gc=False):
    """A committed chunk: its slot, how many holders pin it, and whether lower tiers have it."""

    key: ChunkKey
    slot: SlotRef
    packed: bytes  # slot.offset as a lookup's SlotList packs it (pack_offset), made once
    pins: int = 0
    persisted: bool = False  # queued for, or read from, the lower tiers: never queue it again
    indexed: bool = True  # False once deleted or replaced while still pinned
    covered: Sequence[bytes] = ()  # the chunk's vLLM block hashes, when its commit named them


# C-level getters for map(): batches of chunks cost no Python frame per chunk.
pack_offset = PACKED_OFFSET.pack  # an offset as SlotList.packed holds it
_pins_of = attrgetter("pins")  # true (non-zero) for a pinned entry: the LRU's victim predicate
_namespace_of = itemgetter(0)  # of a ChunkKey
_hash_of = itemgetter(1)  # of a ChunkKey
_offset_of = itemgetter(0)  # of a SlotRef
_length_of = itemgetter(1)  # of a SlotRef

# Asked, when no unpinned chunk is left to evict, to end pins that may give way (queued writes)
# for at least this many bytes; returns the bytes whose pins it ended (0: none can).
ReclaimFn = Callable[[int], int]


class CpuTier:
    """Index of committed arena slots with LRU eviction; pinned chunks are never evicted."""

    tier = Tier.CPU

    def __init__(
        self,
        allocator: SlotAllocator,
        listener: TierListener | None = None,
        reclaim: ReclaimFn | None = None,
    ) -> None:
        self._alloc = allocator
        self.listener = listener  # told of every chunk indexed or unindexed (KV events)
        self._reclaim = reclaim
        self._index: dict[str, dict[bytes, CpuEntry]] = {}  # namespace -> prefix hash -> entry
        self._count = 0
        self._by_offset: dict[int, CpuEntry] = {}
        self._lru: LRUPolicy[CpuEntry] = LRUPolicy()
        self._stats = TierStats(capacity=allocator.capacity)
        self._bytes = 0

    # ------------------------------------------------------------------------------------ reading
    def entry(self, key: ChunkKey) -> CpuEntry | None:
        """The indexed entry of key, or None."""
        chunks = self._index.get(key[0])
        return None if chunks is None else chunks.get(key[1])

    def entries(self, namespace: str, hashes: Sequence[bytes]) -> list[CpuEntry | None]:
        """The indexed entry of each chunk of namespace named by hashes, or None (no stats, no LRU)."""
        chunks = self._index.get(namespace)
        if chunks is None:
            return [None] * len(hashes)
        try:
            return list(map(chunks.get, hashes))  # one C-level pass, no key object per chunk
        except TypeError:  # unhashable hashes (bytearray): keys hold bytes, and bytes() costs a call
            return list(map(chunks.get, map(bytes, hashes)))

    def prefix(self, namespace: str, hashes: Sequence[bytes]) -> list[CpuEntry]:
        """The indexed entries of the leading chunks of namespace named by hashes, up to the first
        one not stored (a fresh list; no stats, no LRU)."""
        chunks = self._index.get(namespace)
        if chunks is None:
            return []
        try:
            return list(map(chunks.__getitem__, hashes))  # all stored: no scan for the first miss
        except (KeyError, TypeError):  # one is missing (or unhashable: see entries)
            entries = self.entries(namespace, hashes)
            return cast("list[CpuEntry]", entries[: entries.index(None)] if None in entries else entries)

    def touch(self, key: ChunkKey) -> None:
        """Mark key most recently used."""
        entry = self.entry(key)
        if entry is not None:
            self._lru.touch(entry)

    def touch_entries(self, entries: Sequence[CpuEntry]) -> None:
        """Mark these entries most recently used, in order (those no longer indexed are skipped)."""
        self._lru.touch_many(entries)

    def count_lookup(self, hits: int, hit_bytes: int, misses: int) -> None:
        """Add one lookup's hits and misses of this tier."""
        stats = self._stats
        stats.hits += hits
        stats.bytes_read += hit_bytes
        stats.misses += misses

    @property
    def allocator(self) -> SlotAllocator:
        """The arena's slot allocator."""
        return self._alloc

    # ------------------------------------------------------------------------------------ slots
    def reserve(self, length: int) -> SlotRef | None:
        """A free slot of length bytes, evicting unpinned chunks LRU-first, and when none is left,
        chunks whose pins the reclaim hook ends; None if impossible."""
        if self._alloc.extent(length) > self._alloc.capacity:
            return None
        while True:
            slot = self._alloc.alloc(length)
            if slot is not None:
                return slot
            # Fragmentation can leave free bytes without a fitting hole: evict at least one chunk.
            need = max(self._alloc.extent(length) - self._alloc.free_bytes, 1)
            victims = self._lru.victims(need, _pins_of)
            if not victims:
                # Each reclaim ends pins for good, so this loop ends. A removed chunk's slot is
                # freed by its unpin; an indexed one becomes a victim of the next pass.
                if self._reclaim is None or self._reclaim(need) <= 0:
                    return None
                continue
            for entry in victims:
                self._evict(entry)

    def reserve_many(self, length: int, count: int) -> list[SlotRef | None]:
        """count slots as count reserve() calls would give them: those that cannot be had are None."""
        alloc = self._alloc
        need = alloc.extent(length)
        if need > alloc.capacity:
            return [None] * count
        out: list[SlotRef | None] = []
        short = count * need - alloc.free_bytes
        if short > 0:
            # Evict for the whole batch in one LRU scan: the victims reserve() would pick one by one.
            # A victim's slot of the very length wanted is handed on as it is, without a round trip
            # through the allocator. When the unpinned chunks cannot cover it all, nothing goes here
            # and the loop below evicts what it can per slot, as reserve() does.
            self._evict_for(self._lru.victims(short, _pins_of), length, count, out)
        for _ in range(count - len(out)):
            slot = alloc.alloc(length)
            if slot is None:
                slot = self.reserve(length)  # fragmented or full
                if slot is None:  # nothing left to free for this length: the rest would fail too
                    out += [None] * (count - len(out))
                    break
            out.append(slot)
        return out

    def _evict_for(self, victims: list[CpuEntry], length: int, count: int, out: list[SlotRef | None]) -> None:
        """Evict unpinned victims, appending to out (up to count) the slots of length they free."""
        if not victims:
            return
        self._lru.remove_many(victims)
        slots = [e.slot for e in victims]  # comprehensions: 3.11 reads slot attributes fastest inline
        keys = [e.key for e in victims]
        self._unindex(keys, slots)
        if self.listener is not None:
            self.listener.removed(Tier.CPU, keys)
        for entry in victims:
            entry.indexed = False
        room = count - len(out)
        if list(map(_length_of, slots)).count(length) == len(slots):  # the usual: one chunk size
            out.extend(slots[:room])  # handed on as they are, without a round trip through the allocator
            spare = slots[room:]
        else:
            spare = []
            for slot in slots:
                if slot.length == length and len(out) < count:
                    out.append(slot)
                else:
                    spare.append(slot)
        for slot in spare:
            self._alloc.free(slot)
        self._count -= len(victims)
        self._bytes -= sum(map(_length_of, slots))
        self._stats.evictions += len(victims)

    def _unindex(self, keys: list[ChunkKey], slots: list[SlotRef]) -> None:
        """Take evicted chunks out of both indexes (every key is indexed, with its slot)."""
        by_offset = self._by_offset
        deque(map(by_offset.__delitem__, map(_offset_of, slots)), maxlen=0)
        namespaces = set(map(_namespace_of, keys))
        if len(namespaces) == 1:  # the usual: one namespace, one index to delete from
            chunks = self._index[namespaces.pop()]
            deque(map(chunks.__delitem__, map(_hash_of, keys)), maxlen=0)
            return
        for key in keys:
            del self._index[key.namespace][key.prefix_hash]

    def free(self, slot: SlotRef) -> None:
        """Give back a reserved, never committed slot."""
        if slot.offset in self._by_offset:
            raise SlotStateError(f"{slot} is committed; it cannot be freed as a reservation")
        self._alloc.free(slot)

    def commit(self, key: ChunkKey, slot: SlotRef, *, persisted: bool = False) -> CpuEntry:
        """Publish a filled reserved slot as key's chunk; if key is already held, slot is freed."""
        return self.commit_many([key], [slot], persisted=persisted)[0]

    def commit_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[SlotRef],
        *,
        persisted: bool = False,
        checked: bool = False,
        covered: Sequence[Sequence[bytes]] = (),
    ) -> list[CpuEntry]:
        """commit() each key with its slot, in order; returns each key's entry.

        checked: the caller has made sure every slot is allocated and not committed (the store's
        reservations are), so it is not checked again chunk by chunk. covered: each chunk's block
        hashes (or nothing), kept with a new entry.
        """
        if len(keys) != len(slots) or (covered and len(covered) != len(keys)):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots and {len(covered)} hash lists")
        fresh = self._commit_fresh(keys, slots, persisted, covered) if checked else None
        return fresh if fresh is not None else self._commit_each(keys, slots, persisted, covered)

    def _commit_fresh(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[SlotRef],
        persisted: bool,
        covered: Sequence[Sequence[bytes]],
    ) -> list[CpuEntry] | None:
        """commit_many() of checked slots in C-level passes, when the keys are of one namespace,
        each new and once, and the slots of one length (a save); None, having done nothing, else."""
        if not keys:
            return []
        namespace, length = keys[0][0], slots[0][1]
        hashes = list(map(_hash_of, keys))
        chunks = self._index.get(namespace)
        if (
            list(map(_namespace_of, keys)).count(namespace) != len(keys)
            or list(map(_length_of, slots)).count(length) != len(slots)
            or len(set(hashes)) != len(hashes)
            or (chunks is not None and not chunks.keys().isdisjoint(hashes))
        ):
            return None
        offsets = list(map(_offset_of, slots))
        fresh = list(map(CpuEntry, keys, slots, map(pack_offset, offsets), repeat(0), repeat(persisted)))
        for entry, hashes_of in zip(fresh, covered, strict=False):  # nothing to do without them
            entry.covered = hashes_of
        self._index.setdefault(namespace, {}).update(zip(hashes, fresh, strict=True))
        self._by_offset.update(zip(offsets, fresh, strict=True))
        self._publish(fresh[:])  # _publish empties the list it is given
        return fresh

    def _commit_each(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[SlotRef],
        persisted: bool,
        covered: Sequence[Sequence[bytes]],
    ) -> list[CpuEntry]:
        """commit_many(), chunk by chunk: checks every slot, and handles keys held already."""
        alloc, by_offset = self._alloc, self._by_offset
        out: list[CpuEntry] = []
        fresh: list[CpuEntry] = []  # new entries of one length, put in the LRU order together
        length = -1
        namespace, chunks = None, {}  # a batch has one namespace: look its index up once
        for at, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            if not alloc.is_allocated(slot) or slot.offset in by_offset:
                self._publish(fresh)
                raise SlotStateError(f"{slot} is not a reserved slot")
            if key.namespace != namespace:
                namespace, chunks = key.namespace, self._index.setdefault(key.namespace, {})
            existing = chunks.get(key.prefix_hash)
            if existing is not None:
                alloc.free(slot)
                self._publish(fresh)  # first: the LRU order is that of one commit() after another
                self._lru.touch(existing)
                out.append(existing)
                continue
            if slot.length != length:
                self._publish(fresh)
                length = slot.length
            entry = CpuEntry(key, slot, pack_offset(slot.offset), 0, persisted)
            if covered:
                entry.covered = covered[at]
            chunks[key.prefix_hash] = entry
            by_offset[slot.offset] = entry
            fresh.append(entry)
            out.append(entry)
        self._publish(fresh)
        return out

    def _publish(self, fresh: list[CpuEntry]) -> None:
        """Put indexed entries of one slot length in the LRU order and the counters; empties fresh."""
        if not fresh:
            return
        n, length = len(fresh), fresh[0].slot.length
        self._lru.add_new(fresh, self._alloc.extent(length))
        self._count += n
        self._bytes += n * length
        self._stats.stores += n
        self._stats.bytes_written += n * length
        if self.listener is not None:
            self.listener.stored(Tier.CPU, [e.key for e in fresh], [e.covered for e in fresh])
        fresh.clear()

    def pin(self, slot: SlotRef) -> None:
        """Keep the chunk in slot from eviction and its slot from reuse until unpin()."""
        entry = self._by_offset.get(slot.offset)
        if entry is None or entry.slot != slot:
            raise SlotStateError(f"{slot} holds no committed chunk")
        entry.pins += 1

    def unpin_frees(self, slot: SlotRef) -> int:
        """The arena bytes that ending one pin of slot's chunk frees for reuse: the slot's extent when
        that pin is its only one, else 0."""
        entry = self._by_offset.get(slot.offset)
        if entry is None or entry.slot != slot or entry.pins != 1:
            return 0
        return self._alloc.extent(slot.length)

    def pin_entries(self, entries: Iterable[CpuEntry]) -> None:
        """pin() the slot of each entry (indexed entries, as entries() gives them)."""
        for entry in entries:
            entry.pins += 1

    def unpin(self, slot: SlotRef, *, written: bool = True) -> None:
        """Undo one pin(); a removed chunk's slot is freed with its last pin. written=False: the pin
        was a lower-tier write's that never happened, so the chunk may be queued again."""
        entry = self._by_offset.get(slot.offset)
        if entry is None or entry.slot != slot:
            raise SlotStateError(f"{slot} is not pinned")
        if not written:
            entry.persisted = False
        self.unpin_entries((entry,))

    def unpin_entries(self, entries: Iterable[CpuEntry]) -> None:
        """unpin() the slot of each entry (entries pinned before, indexed or not)."""
        # The field is read once per entry: every lease that ends unpins each chunk of its prompt.
        for entry in entries:
            pins = entry.pins
            if pins > 1:
                entry.pins = pins - 1
            elif pins == 1:
                entry.pins = 0
                if not entry.indexed:
                    del self._by_offset[entry.slot.offset]
                    self._alloc.free(entry.slot)
            else:
                raise SlotStateError(f"{entry.slot} is not pinned")

    # ------------------------------------------------------------------------------------ removal
    def remove(self, key: ChunkKey) -> bool:
        """Drop key from the index now (pinned or not); its slot is freed when no longer pinned."""
        entry = self.entry(key)
        if entry is None:
            return False
        self._drop(entry)
        return True

    def _drop(self, entry: CpuEntry) -> None:
        """Take an indexed entry out; its slot is freed once unpinned."""
        del self._index[entry.key.namespace][entry.key.prefix_hash]
        self._count -= 1
        self._lru.remove(entry)
        self._bytes -= entry.slot.length
        entry.indexed = False
        if entry.pins == 0:
            del self._by_offset[entry.slot.offset]
            self._alloc.free(entry.slot)
        if self.listener is not None:
            self.listener.removed(Tier.CPU, [entry.key])

    def clear(self) -> int:
        """Drop every unpinned chunk; returns how many were dropped."""
        unpinned = [e for chunks in self._index.values() for e in chunks.values() if e.pins == 0]
        for entry in unpinned:
            self._drop(entry)
        return len(unpinned)

    def _evict(self, entry: CpuEntry) -> None:
        self._drop(entry)
        self._stats.evictions += 1

    # ------------------------------------------------------------------------------------ stats
    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""
        snap = dataclasses.replace(self._stats, errors=dict(self._stats.errors))
        snap.chunks = self._count
        snap.bytes = self._bytes
        return snap

    def count_error(self, kind: str) -> None:
        """Add one error of this kind."""
        self._stats.count_error(kind)
