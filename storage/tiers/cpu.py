"""CPU tier: the arena's committed slots, indexed by chunk key, evicted by CLOCK (second chance).

Who owns what: the service's event loop owns this object (no locks): the slot allocator, the index
key -> slot id, each slot's state (arrays by slot id: pins, flags, namespace, prefix hash) and the
clock. A pin belongs to whoever took it (a lease, a queued write); reserve() asks the reclaim hook
to end pins that may give way.
Design: docs/internals.md#cpu-tier-cpupy
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from operator import add, getitem, itemgetter, setitem
from typing import Any, TypeVar, cast

from kvtier.storage.arena import SlotAllocator
from kvtier.storage.base import NO_SLOT, ChunkKey, SlotRef, SlotStateError, Tier, TierListener, TierStats
from kvtier.storage.eviction import ClockPolicy

_T = TypeVar("_T")

# A committed chunk is named by its slot id (SlotAllocator's): an int >= 1, so always true.
SlotId = int

LIVE = 1  # _state bit: indexed (a lookup finds it)
PERSISTED = 2  # _state bit: queued for, or read from, the lower tiers: never queue it again

# C-level getters for map(): batches of chunks cost no Python frame per chunk.
_namespace_of = itemgetter(0)  # of a ChunkKey
_hash_of = itemgetter(1)  # of a ChunkKey
_length_of = itemgetter(1)  # of a SlotRef
_new_tuple = tuple.__new__  # a ChunkKey without its Python-level __new__
_SWAP = sys.byteorder != "little"  # packed offsets are little-endian int64


def _get(seq: Sequence[_T], ids: Sequence[int]) -> Sequence[_T]:
    """seq[i] for each id, in one C-level call (itemgetter) when there are several."""
    if len(ids) > 1:
        return cast("tuple[_T, ...]", itemgetter(*ids)(seq))
    return [seq[i] for i in ids]


def _put(seq: Any, ids: Iterable[int], values: Iterable[Any]) -> None:
    """seq[i] = value for each id and value, in one C-level pass."""
    deque(map(setitem, repeat(seq), ids, values), maxlen=0)


# Asked, when no unpinned chunk is left to evict, to end pins that may give way (queued writes)
# for at least this many bytes; returns the bytes whose pins it ended (0: none can).
ReclaimFn = Callable[[int], int]


class CpuTier:
    """Index of committed arena slots with CLOCK eviction; pinned chunks are never evicted."""

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
        self._index: dict[str, dict[bytes, SlotId]] = {}  # namespace -> prefix hash -> slot id
        self._names: list[str] = []  # namespace number -> namespace
        self._number: dict[str, int] = {}  # namespace -> its number
        # Per slot id, grown with the allocator's ids (see docs/internals.md#cpu-tier-cpupy).
        self._pins = array("i")
        self._state = bytearray()  # LIVE | PERSISTED
        self._ns = array("H")  # namespace number
        self._hash: list[bytes | None] = []  # prefix hash, while committed
        self._covered: dict[SlotId, Sequence[bytes]] = {}  # block hashes, when a commit named them
        self._by_slot: dict[int, list[int]] = {}  # offset -> [id, pins] of pins taken by slot
        self._clock = ClockPolicy()
        self._grow()
        self._count = 0
        self._stats = TierStats(capacity=allocator.capacity)
        self._bytes = 0

    def _grow(self) -> None:
        """Size the per-slot arrays to every id the allocator handed out."""
        have, limit = len(self._pins), self._alloc.id_limit
        if limit <= have:
            return
        n = limit - have
        self._pins.frombytes(bytes(n * self._pins.itemsize))
        self._state.extend(bytes(n))
        self._ns.frombytes(bytes(n * self._ns.itemsize))
        self._hash.extend(repeat(None, n))
        self._clock.grow(limit)

    # ------------------------------------------------------------------------------------ reading
    def entry(self, key: ChunkKey) -> SlotId | None:
        """The slot id of key's indexed chunk, or None."""
        chunks = self._index.get(key[0])
        return None if chunks is None else chunks.get(key[1])

    def entries(self, namespace: str, hashes: Sequence[bytes]) -> list[SlotId | None]:
        """The slot id of each chunk of namespace named by hashes, or None (no stats, no recency)."""
        chunks = self._index.get(namespace)
        if chunks is None:
            return [None] * len(hashes)
        try:
            return list(map(chunks.get, hashes))  # one C-level pass, no key object per chunk
        except TypeError:  # unhashable hashes (bytearray): keys hold bytes, and bytes() costs a call
            return list(map(chunks.get, map(bytes, hashes)))

    def prefix(self, namespace: str, hashes: Sequence[bytes]) -> list[SlotId]:
        """The slot ids of the leading chunks of namespace named by hashes, up to the first one not
        stored (a fresh list; no stats, no recency)."""
        chunks = self._index.get(namespace)
        if chunks is None:
            return []
        try:
            return list(map(chunks.__getitem__, hashes))  # all stored: no scan for the first miss
        except (KeyError, TypeError):  # one is missing (or unhashable: see entries)
            ids = self.entries(namespace, hashes)
            return cast("list[SlotId]", ids[: ids.index(None)] if None in ids else ids)

    def slot_of(self, sid: SlotId) -> SlotRef:
        """The slot of a committed chunk."""
        return self._alloc.slot_of(sid)

    def key_of(self, sid: SlotId) -> ChunkKey:
        """The key of a committed chunk."""
        return ChunkKey(self._names[self._ns[sid]], cast("bytes", self._hash[sid]))

    def pins_of(self, sid: SlotId) -> int:
        """How many holders pin a committed chunk."""
        return self._pins[sid]

    def covered_of(self, sid: SlotId) -> Sequence[bytes]:
        """The block hashes a committed chunk's commit named (or none)."""
        return self._covered.get(sid, ())

    def persisted(self, sid: SlotId) -> bool:
        """True once the chunk was queued for, or read from, the lower tiers."""
        return bool(self._state[sid] & PERSISTED)

    def all_persisted(self, ids: Sequence[SlotId]) -> bool:
        """persisted() of every one of these indexed chunks (one C-level pass)."""
        return list(_get(self._state, ids)).count(LIVE | PERSISTED) == len(ids)

    def set_persisted(self, sid: SlotId) -> None:
        """Mark a committed chunk queued for the lower tiers."""
        self._state[sid] |= PERSISTED

    def packed(self, ids: Sequence[SlotId | None]) -> bytes:
        """The slots' offsets packed as a lookup's SlotList holds them (NO_SLOT for None)."""
        offsets = self._alloc.offsets
        try:
            out = array("q", _get(offsets, cast("Sequence[SlotId]", ids)))  # C-level, no object each
        except TypeError:  # a None: a lower-tier hit has no slot
            out = array("q", [NO_SLOT if sid is None else offsets[sid] for sid in ids])
        if _SWAP:
            out.byteswap()
        return out.tobytes()

    def touch(self, key: ChunkKey) -> None:
        """Mark key used."""
        sid = self.entry(key)
        if sid is not None:
            self._clock.touch(sid)

    def touch_entries(self, ids: Sequence[SlotId]) -> None:
        """Mark these chunks used (a chunk no longer indexed is not evicted by its bit: harmless)."""
        self._clock.touch_many(ids)

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
        """A free slot of length bytes, evicting unpinned chunks by the clock, and when none is left,
        chunks whose pins the reclaim hook ends; None if impossible."""
        alloc = self._alloc
        if alloc.extent(length) > alloc.capacity:
            return None
        while True:
            slot = alloc.alloc(length)
            if slot is not None:
                return slot
            # Fragmentation can leave free bytes without a fitting hole: evict at least one chunk.
            need = max(alloc.extent(length) - alloc.free_bytes, 1)
            victims = self._victims(need, length)
            if not victims:
                # Each reclaim ends pins for good, so this loop ends. A removed chunk's slot is
                # freed by its unpin; an indexed one becomes a victim of the next pass.
                if self._reclaim is None or self._reclaim(need) <= 0:
                    return None
                continue
            self._unindex(victims, _get(alloc.lengths, victims))
            self._forget(victims)
            alloc.release(victims)

    def reserve_many(self, length: int, count: int) -> list[SlotRef | None]:
        """count slots as count reserve() calls would give them: those that cannot be had are None."""
        alloc = self._alloc
        need = alloc.extent(length)
        if need > alloc.capacity:
            return [None] * count
        out: list[SlotRef | None] = []
        short = count * need - alloc.free_bytes
        if short > 0:
            # Evict for the whole batch in one sweep of the clock: the victims reserve() would pick
            # one by one. A victim's slot of the very length wanted is handed on as it is, without
            # a round trip through the free extents. When the unpinned chunks cannot cover it all,
            # nothing goes here and the loop below evicts what it can per slot, as reserve() does.
            self._evict_for(self._victims(short, length), length, count, out)
        out += alloc.alloc_many(length, count - len(out))  # as alloc() slot by slot, in C passes
        for _ in range(count - len(out)):
            slot = self.reserve(length)  # fragmented or full
            if slot is None:  # nothing left to free for this length: the rest would fail too
                out += [None] * (count - len(out))
                break
            out.append(slot)
        return out

    def _victims(self, need_bytes: int, length: int) -> list[SlotId]:
        """The clock's victims for need_bytes of extents (length: the size being made room for)."""
        return self._clock.victims(need_bytes, self._alloc.extent(length), self._evictable, self._extents)

    def _evictable(self, ids: list[SlotId]) -> list[SlotId]:
        """Of ids, the indexed, unpinned ones (in order): C-level passes, the usual case all of them."""
        if not ids:
            return ids
        pins, states = _get(self._pins, ids), _get(self._state, ids)
        if pins.count(0) == len(ids) and 0 not in states and PERSISTED not in states:  # all LIVE
            return ids
        return [sid for sid, n, state in zip(ids, pins, states, strict=True) if not n and state & LIVE]

    def _extents(self, ids: list[SlotId]) -> list[int]:
        """The arena bytes each chunk's slot takes."""
        one = self._alloc.one_length
        if one is not None:  # no read needed
            return [self._alloc.extent(one)] * len(ids)
        lengths = list(_get(self._alloc.lengths, ids))
        if lengths.count(lengths[0]) == len(lengths):
            return [self._alloc.extent(lengths[0])] * len(lengths)
        return list(map(self._alloc.extent, lengths))

    def _evict_for(self, victims: list[SlotId], length: int, count: int, out: list[SlotRef | None]) -> None:
        """Evict unpinned victims, appending to out (up to count) the slots of length they free."""
        if not victims:
            return
        one = self._alloc.one_length
        lengths = [one] * len(victims) if one is not None else _get(self._alloc.lengths, victims)
        self._unindex(victims, lengths)
        room = count - len(out)
        if lengths.count(length) == len(lengths):  # the usual: one chunk size
            handed, spare = victims[:room], victims[room:]
        else:
            handed, spare = [], []
            for sid, size in zip(victims, lengths, strict=True):
                (handed if size == length and len(handed) < room else spare).append(sid)
        # Handed on as they are, without freeing them: their commit sets the rest of their state.
        _put(self._state, handed, repeat(0))
        out.extend(self._alloc.reopen(handed))
        self._forget(spare)
        self._alloc.release(spare)

    def _unindex(self, victims: list[SlotId], lengths: Sequence[int]) -> None:
        """Take unpinned indexed chunks (of these slot lengths) out of the index and the counters
        (they are evicted)."""
        hashes = cast("list[bytes]", list(_get(self._hash, victims)))  # indexed: each has its hash
        numbers = list(_get(self._ns, victims))
        names = self._names
        if numbers.count(numbers[0]) == len(numbers):  # the usual: one namespace, one index
            chunks = self._index[names[numbers[0]]]
            deque(map(chunks.__delitem__, hashes), maxlen=0)
        else:
            for number, prefix_hash in zip(numbers, hashes, strict=True):
                del self._index[names[number]][prefix_hash]
        self._count -= len(victims)
        self._bytes -= sum(lengths)
        self._stats.evictions += len(victims)
        if self.listener is not None:
            namespaces = list(map(names.__getitem__, numbers))
            keys = list(map(_new_tuple, repeat(ChunkKey), zip(namespaces, hashes, strict=True)))
            self.listener.removed(Tier.CPU, keys)

    def _forget(self, ids: list[SlotId]) -> None:
        """Clear the state of slots that leave the tier (their ids go back to the allocator)."""
        _put(self._state, ids, repeat(0))
        _put(self._hash, ids, repeat(None))
        if self._covered:
            deque(map(self._covered.pop, ids, repeat(None)), maxlen=0)

    def free(self, slot: SlotRef) -> None:
        """Give back a reserved, never committed slot."""
        if not self._alloc.is_allocated(slot):
            raise SlotStateError(f"{slot} is not a reserved slot; it cannot be freed as one")
        self._free_open(slot)

    def _free_open(self, slot: SlotRef) -> None:
        """Give an open slot back, clearing what its id kept of a chunk handed on from eviction."""
        sid = self._alloc.free(slot)
        if sid < len(self._hash):
            self._hash[sid] = None

    def commit(self, key: ChunkKey, slot: SlotRef, *, persisted: bool = False) -> SlotId:
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
    ) -> list[SlotId]:
        """commit() each key with its slot, in order; returns each key's slot id.

        checked: the caller has made sure every slot is reserved (the store's reservations are),
        so the batch may take the C-level path. covered: each chunk's block hashes (or nothing),
        kept with a new chunk.
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
    ) -> list[SlotId] | None:
        """commit_many() of reserved slots in C-level passes, when the keys are of one namespace,
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
        ids = self._alloc.claim(slots, length)  # raises, having done nothing, if one is not reserved
        self._grow()
        self._index.setdefault(namespace, {}).update(zip(hashes, ids, strict=True))
        _put(self._hash, ids, hashes)
        _put(self._ns, ids, repeat(self._number_of(namespace)))
        _put(self._state, ids, repeat(LIVE | PERSISTED if persisted else LIVE))
        if covered:
            self._covered.update(compress(zip(ids, covered, strict=True), covered))  # named only
        self._publish(ids, keys, covered, length)
        return ids

    def _commit_each(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[SlotRef],
        persisted: bool,
        covered: Sequence[Sequence[bytes]],
    ) -> list[SlotId]:
        """commit_many(), chunk by chunk: checks every slot, and handles keys held already."""
        alloc = self._alloc
        out: list[SlotId] = []
        fresh: list[tuple[SlotId, ChunkKey, Sequence[bytes]]] = []  # new chunks of one length, told together
        for at, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            if not alloc.is_allocated(slot):
                self._publish_each(fresh, bool(covered))
                raise SlotStateError(f"{slot} is not a reserved slot")
            existing = self.entry(key)
            if existing is not None:
                self._free_open(slot)
                self._clock.touch(existing)
                out.append(existing)
                continue
            if fresh and alloc.lengths[fresh[0][0]] != slot.length:
                self._publish_each(fresh, bool(covered))
            (sid,) = alloc.claim([slot])
            self._grow()
            self._index.setdefault(key.namespace, {})[key.prefix_hash] = sid
            self._hash[sid] = key.prefix_hash
            self._ns[sid] = self._number_of(key.namespace)
            self._state[sid] = LIVE | PERSISTED if persisted else LIVE
            hashes_of = covered[at] if covered else ()
            if hashes_of:
                self._covered[sid] = hashes_of
            fresh.append((sid, key, hashes_of))
            out.append(sid)
        self._publish_each(fresh, bool(covered))
        return out

    def _publish_each(self, fresh: list[tuple[SlotId, ChunkKey, Sequence[bytes]]], covered: bool) -> None:
        """_publish() chunks committed one by one (of one length); empties fresh."""
        if fresh:
            ids, keys, hashes = (list(t) for t in zip(*fresh, strict=True))
            self._publish(ids, keys, hashes if covered else (), self._alloc.lengths[ids[0]])
            fresh.clear()

    def _number_of(self, namespace: str) -> int:
        """The namespace's number (given on its first chunk)."""
        number = self._number.get(namespace)
        if number is None:
            if len(self._names) > 0xFFFF:  # _ns holds 16-bit numbers
                raise ValueError(f"namespace {namespace!r} is past the 65,536 the CPU tier can number")
            number = self._number[namespace] = len(self._names)
            self._names.append(namespace)
        return number

    def _publish(
        self, ids: list[SlotId], keys: Sequence[ChunkKey], covered: Sequence[Sequence[bytes]], length: int
    ) -> None:
        """Put new indexed chunks of one slot length on the clock and in the counters."""
        n = len(ids)
        self._clock.add_new(ids)
        self._count += n
        self._bytes += n * length
        self._stats.stores += n
        self._stats.bytes_written += n * length
        if self.listener is not None:
            self.listener.stored(Tier.CPU, list(keys), list(covered) if covered else [()] * n)

    # ------------------------------------------------------------------------------------ pins
    def pin_entries(self, ids: Iterable[SlotId]) -> None:
        """Pin each chunk (indexed ones, as entries() gives them) against eviction and slot reuse
        until unpin_entries(); an id named twice is pinned twice."""
        pins = self._pins
        ids = ids if isinstance(ids, list) else list(ids)
        _put(pins, ids, map(add, map(getitem, repeat(pins), ids), repeat(1)))  # lazy: twice is twice

    def unpin_entries(self, ids: Iterable[SlotId]) -> None:
        """Undo one pin_entries() of each chunk (indexed or not); a removed chunk's slot is freed with
        its last pin."""
        pins, state = self._pins, self._state
        for sid in ids:
            n = pins[sid]
            if n > 1:
                pins[sid] = n - 1
            elif n == 1:
                pins[sid] = 0
                if not state[sid] & LIVE:
                    self._forget([sid])
                    self._alloc.release((sid,))
            else:
                raise SlotStateError(f"{self._alloc.slot_of(sid)} is not pinned")

    def pin_slot(self, sid: SlotId) -> SlotRef:
        """Pin an indexed chunk for a holder that names it by its slot (a queued write), until
        unpin(slot); returns the slot."""
        if not 0 < sid < len(self._state) or not self._state[sid] & LIVE:
            raise SlotStateError(f"slot id {sid} holds no indexed chunk")
        slot = self._alloc.slot_of(sid)
        held = self._by_slot.get(slot.offset)
        if held is None:
            self._by_slot[slot.offset] = [sid, 1]
        else:
            held[1] += 1
        self._pins[sid] += 1
        return slot

    def _slot_pinned(self, slot: SlotRef) -> list[int] | None:
        """[id, pins] of the chunk pinned by slot (pin_slot), or None."""
        held = self._by_slot.get(slot.offset)
        if held is None or self._alloc.lengths[held[0]] != slot.length:
            return None
        return held

    def unpin_frees(self, slot: SlotRef) -> int:
        """The arena bytes that ending one pin_slot() of slot's chunk frees for reuse: the slot's
        extent when that pin is its only one, else 0."""
        held = self._slot_pinned(slot)
        if held is None or self._pins[held[0]] != 1:
            return 0
        return self._alloc.extent(slot.length)

    def unpin(self, slot: SlotRef, *, written: bool = True) -> None:
        """Undo one pin_slot(); a removed chunk's slot is freed with its last pin. written=False: the
        pin was a lower-tier write's that never happened, so the chunk may be queued again."""
        held = self._slot_pinned(slot)
        if held is None:
            raise SlotStateError(f"{slot} is not pinned by its slot")
        sid = held[0]
        held[1] -= 1
        if not held[1]:
            del self._by_slot[slot.offset]
        if not written:
            self._state[sid] &= ~PERSISTED
        self.unpin_entries((sid,))

    # ------------------------------------------------------------------------------------ removal
    def remove(self, key: ChunkKey) -> bool:
        """Drop key from the index now (pinned or not); its slot is freed when no longer pinned."""
        sid = self.entry(key)
        if sid is None:
            return False
        self._drop(sid)
        return True

    def _drop(self, sid: SlotId) -> None:
        """Take an indexed chunk out; its slot is freed once unpinned."""
        key = self.key_of(sid)
        del self._index[key.namespace][key.prefix_hash]
        self._count -= 1
        self._bytes -= self._alloc.lengths[sid]
        self._state[sid] &= ~LIVE
        if self._pins[sid] == 0:
            self._forget([sid])
            self._alloc.release((sid,))
        if self.listener is not None:
            self.listener.removed(Tier.CPU, [key])

    def clear(self) -> int:
        """Drop every unpinned chunk; returns how many were dropped."""
        pins = self._pins
        unpinned = [sid for chunks in self._index.values() for sid in chunks.values() if not pins[sid]]
        for sid in unpinned:
            self._drop(sid)
        return len(unpinned)

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
