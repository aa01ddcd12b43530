"""CPU tier: zero-copy commit, CLOCK eviction by bytes, pins, removal of pinned chunks, stats, and its
index of per-slot arrays (slot ids reused, mixed lengths)."""

from __future__ import annotations

import pytest

from kvtier.storage.arena import PAGE, SlotAllocator
from kvtier.storage.base import ChunkKey, SlotRef, SlotStateError
from kvtier.storage.tiers.cpu import CpuTier

CHUNK = 4 * PAGE


def key(i: int, ns: str = "ns") -> ChunkKey:
    return ChunkKey(ns, i.to_bytes(8, "big"))


def make(chunks: int = 4) -> CpuTier:
    return CpuTier(SlotAllocator(chunks * CHUNK))


def held(tier: CpuTier, i: int) -> bool:
    return tier.entry(key(i)) is not None


def slot_of(tier: CpuTier, i: int) -> SlotRef | None:
    sid = tier.entry(key(i))
    return None if sid is None else tier.slot_of(sid)


def pin(tier: CpuTier, i: int) -> SlotRef:
    """Pin chunk i by its slot, as a queued write does."""
    sid = tier.entry(key(i))
    assert sid is not None
    return tier.pin_slot(sid)


def put(tier: CpuTier, i: int, length: int = CHUNK) -> SlotRef:
    slot = tier.reserve(length)
    assert slot is not None
    sid = tier.commit(key(i), slot)
    assert tier.slot_of(sid) == slot  # zero copy: the filled slot itself is published
    return slot


def test_commit_publishes_the_reserved_slot() -> None:
    tier = make()
    slot = put(tier, 1)
    assert slot_of(tier, 1) == slot and held(tier, 1)
    stats = tier.stats()
    assert (stats.chunks, stats.bytes, stats.stores) == (1, CHUNK, 1)
    assert stats.capacity == 4 * CHUNK


def test_clock_eviction_by_bytes() -> None:
    tier = make(3)
    for i in range(3):
        put(tier, i)
    tier.touch(key(0))  # 0 gets a second chance: 1 is the first the hand finds unused
    put(tier, 3)
    assert not held(tier, 1) and all(held(tier, i) for i in (0, 2, 3))
    assert tier.stats().evictions == 1


def test_pinned_chunks_are_never_evicted() -> None:
    tier = make(2)
    put(tier, 0)
    put(tier, 1)
    a = pin(tier, 0)
    put(tier, 2)  # evicts 1, the only unpinned chunk
    assert held(tier, 0) and not held(tier, 1)
    pin(tier, 2)
    assert tier.reserve(CHUNK) is None  # everything pinned: no slot
    tier.unpin(a)
    assert tier.reserve(CHUNK) is not None


def test_remove_of_pinned_chunk_keeps_slot_until_unpinned() -> None:
    tier = make(1)
    slot = put(tier, 0)
    assert pin(tier, 0) == slot
    assert tier.remove(key(0)) and not tier.remove(key(0))
    assert not held(tier, 0)
    assert tier.reserve(CHUNK) is None  # the slot is still in use by its pin holder
    tier.unpin(slot)
    assert tier.reserve(CHUNK) == SlotRef(0, CHUNK)


def test_a_removed_chunk_pinned_twice_frees_its_slot_with_the_second_unpin_only() -> None:
    tier = make(1)
    slot = put(tier, 0)
    entries = [tier.entry(key(0))] * 2
    tier.pin_entries(entries)
    assert tier.remove(key(0))
    tier.unpin_entries(entries[:1])
    assert tier.reserve(CHUNK) is None  # one pin left
    tier.unpin_entries(entries[1:])
    assert tier.reserve(CHUNK) == slot
    with pytest.raises(SlotStateError):
        tier.unpin_entries(entries[:1])


def test_duplicate_commit_keeps_the_first_and_frees_the_second() -> None:
    tier = make(2)
    first = put(tier, 0)
    second = tier.reserve(CHUNK)
    assert second is not None
    sid = tier.commit(key(0), second)
    assert tier.slot_of(sid) == first
    assert tier.allocator.slots_in_use == 1


def test_state_errors() -> None:
    tier = make(2)
    slot = put(tier, 0)
    with pytest.raises(SlotStateError):
        tier.free(slot)  # committed, not a reservation
    with pytest.raises(SlotStateError):
        tier.commit(key(1), slot)  # already committed
    with pytest.raises(SlotStateError):
        tier.commit(key(1), SlotRef(CHUNK, CHUNK))  # never reserved
    with pytest.raises(SlotStateError):
        tier.unpin(slot)  # not pinned by its slot
    with pytest.raises(SlotStateError):
        tier.pin_slot(2)  # no chunk in that slot id
    with pytest.raises(SlotStateError):
        tier.unpin_entries([tier.entry(key(0))])  # type: ignore[list-item]


def test_clear_drops_only_unpinned() -> None:
    tier = make(3)
    put(tier, 0)
    put(tier, 1)
    pin(tier, 0)
    assert tier.clear() == 1
    assert held(tier, 0) and tier.stats().chunks == 1
    assert tier.stats().evictions == 0


def test_two_chunk_sizes_share_the_budget() -> None:
    tier = make(4)  # 4 small chunks or 2 big ones
    for i in range(4):
        put(tier, i)
    big = tier.reserve(2 * CHUNK)  # needs two adjacent small slots gone
    assert big is not None and big.length == 2 * CHUNK
    assert tier.stats().evictions == 2
    assert tier.allocator.used_bytes == 4 * CHUNK
    assert tier.reserve(8 * CHUNK) is None  # larger than the arena


def test_stats_are_snapshots() -> None:
    tier = make()
    snap = tier.stats()
    snap.count_error("x")
    snap.hits = 99
    tier.count_lookup(2, 2 * CHUNK, 1)
    fresh = tier.stats()
    assert fresh.errors == {} and (fresh.hits, fresh.misses, fresh.bytes_read) == (2, 1, 2 * CHUNK)


def test_entries_probe_by_namespace_and_hash() -> None:
    tier = make()
    a = put(tier, 1)
    found = tier.entries("ns", [key(1).prefix_hash, key(2).prefix_hash])
    assert found[0] is not None and tier.slot_of(found[0]) == a and found[1] is None
    assert tier.entries("ns", [bytearray(key(1).prefix_hash)]) == found[:1]  # unhashable: as bytes
    assert tier.entries("other", [key(1).prefix_hash]) == [None]


def test_reserve_many_evicts_by_the_clock_and_stops_at_pinned_chunks() -> None:
    tier = make(4)
    slots = [put(tier, i) for i in range(4)]
    pin(tier, 0)
    tier.touch(key(1))  # the hand finds 0 (pinned), 1 (used: a second chance), 2, 3
    got = tier.reserve_many(CHUNK, 2)
    assert sorted(got) == sorted([slots[2], slots[3]])  # their slots, handed on as they are
    assert not held(tier, 2) and not held(tier, 3) and tier.stats().evictions == 2
    more = tier.reserve_many(CHUNK, 2)
    assert more[0] == slots[1] and more[1] is None  # only the pinned chunk is left
    assert tier.allocator.slots_in_use == 4


def test_commit_many_keeps_one_by_one_eviction_order() -> None:
    tier = make(5)
    put(tier, 0)
    put(tier, 1)
    fresh = [tier.reserve(CHUNK) for _ in range(3)]
    assert None not in fresh
    ids = tier.commit_many([key(2), key(0), key(3)], fresh)  # type: ignore[arg-type]
    # key(0) was held already: its new slot is freed, and it is touched (a second chance).
    assert [tier.key_of(sid) for sid in ids] == [key(2), key(0), key(3)]
    assert tier.slot_of(ids[1]) != fresh[1] and tier.allocator.slots_in_use == 4
    assert tier.reserve_many(CHUNK, 1)[0] is not None  # the freed slot: nothing evicted
    assert tier.reserve_many(CHUNK, 1)[0] is not None  # evicts the least recently used: key(1)
    assert not held(tier, 1) and all(held(tier, i) for i in (0, 2, 3))
    assert tier.reserve_many(CHUNK, 1)[0] is not None  # then key(2): 0's second chance holds
    assert not held(tier, 2) and held(tier, 0)


def test_prefix_stops_at_the_first_missing_chunk() -> None:
    tier = make()
    one, two = put(tier, 1), put(tier, 2)
    h = [key(i).prefix_hash for i in range(4)]
    assert [tier.slot_of(e) for e in tier.prefix("ns", [h[1], h[2]])] == [one, two]
    assert [tier.slot_of(e) for e in tier.prefix("ns", [h[1], h[3], h[2]])] == [one]  # a hole ends it
    assert tier.prefix("ns", [h[3], h[1]]) == [] and tier.prefix("other", [h[1]]) == []
    assert [tier.slot_of(e) for e in tier.prefix("ns", [bytearray(h[1])])] == [one]  # unhashable


def test_checked_commit_many_matches_the_one_by_one_path() -> None:
    checked, plain = make(4), make(4)
    for tier in (checked, plain):
        put(tier, 0)
        slots = [tier.reserve(CHUNK) for _ in range(2)]
        ids = tier.commit_many([key(1), key(2)], slots, checked=tier is checked)  # type: ignore[arg-type]
        assert [tier.key_of(e) for e in ids] == [key(1), key(2)] and [tier.slot_of(e) for e in ids] == slots
        assert slot_of(tier, 2) == slots[1] and tier.stats().stores == 3
        again = tier.reserve(CHUNK)
        assert again is not None
        existing = tier.commit_many([key(0)], [again], checked=tier is checked)  # held already
        assert tier.slot_of(existing[0]) != again and tier.allocator.slots_in_use == 3  # freed
    assert checked.stats() == plain.stats()
    # Same eviction order: 1 and 2 go first, then 0 (touched by the second commit).
    for tier in (checked, plain):
        assert None not in tier.reserve_many(CHUNK, 2)  # the free slot, and key(1)'s
        assert not held(tier, 1) and held(tier, 2) and held(tier, 0)
        assert tier.reserve_many(CHUNK, 1)[0] is not None
        assert not held(tier, 2) and held(tier, 0)


# ------------------------------------------------------------------------- the index's structure
def test_a_second_chance_lasts_one_sweep_of_the_hand() -> None:
    tier = make(3)
    for i in range(3):
        put(tier, i)
    tier.touch(key(0))
    tier.touch(key(1))
    put(tier, 3)  # the hand clears 0's and 1's bits and evicts 2, the only unused one
    assert not held(tier, 2) and all(held(tier, i) for i in (0, 1, 3))
    put(tier, 4)  # round again: 0 was not used since the hand passed it
    assert not held(tier, 0) and all(held(tier, i) for i in (1, 3, 4))
    assert tier.stats().evictions == 2


def test_pinned_chunks_outlive_sweeps_and_go_once_unpinned() -> None:
    tier = make(2)
    put(tier, 0)
    sid = tier.entry(key(0))
    assert sid is not None
    tier.pin_entries([sid, sid])  # two holders
    for i in range(1, 5):
        put(tier, i)  # each evicts the one before: the hand walks past the pinned chunk
        assert held(tier, 0) and held(tier, i) and tier.stats().evictions == i - 1
    tier.unpin_entries([sid])
    put(tier, 5)
    assert held(tier, 0)  # one pin left
    tier.unpin_entries([sid])
    put(tier, 6)
    put(tier, 7)
    assert not held(tier, 0) and tier.pins_of(sid) == 0 and tier.stats().chunks == 2


def test_a_chunk_removed_while_pinned_keeps_its_slot_until_the_last_unpin() -> None:
    tier = make(3)
    first = put(tier, 0)
    old = tier.entry(key(0))
    assert old is not None
    tier.pin_entries([old])
    assert tier.remove(key(0)) and tier.prefix("ns", [key(0).prefix_hash]) == []
    again = put(tier, 0)  # stored anew, in another slot
    new = tier.entry(key(0))
    assert new is not None and new != old and again != first
    assert tier.allocator.slots_in_use == 2 and tier.stats().chunks == 1
    tier.unpin_entries([old])  # the removed copy's slot goes back now
    assert tier.allocator.slots_in_use == 1 and tier.slot_of(new) == again and held(tier, 0)


def test_slot_ids_are_reused_with_their_state_cleared() -> None:
    tier = make(2)
    slot = tier.reserve(CHUNK)
    assert slot is not None
    (sid,) = tier.commit_many([key(0)], [slot], persisted=True, covered=[[b"block"]])
    assert tier.persisted(sid) and tier.covered_of(sid) == [b"block"]
    tier.pin_entries([sid])
    tier.unpin_entries([sid])
    assert tier.remove(key(0))
    reused = put(tier, 1)
    assert tier.entry(key(1)) == sid and reused == slot  # the freed id and slot, taken again
    assert not tier.persisted(sid) and tier.covered_of(sid) == () and tier.pins_of(sid) == 0
    assert tier.key_of(sid) == key(1) and not held(tier, 0)


def test_mixed_lengths_evict_until_a_hole_fits_around_a_pinned_chunk() -> None:
    tier = make(4)
    slots = [put(tier, i) for i in range(4)]  # slots at 0, 1, 2 and 3 chunks
    pin(tier, 1)
    big = tier.reserve(2 * CHUNK)  # 0 and 2 go first, but their holes are not adjacent: 3 too
    assert big == SlotRef(2 * CHUNK, 2 * CHUNK)
    assert tier.stats().evictions == 3 and held(tier, 1) and tier.stats().chunks == 1
    tier.commit(key(9), big)
    small = tier.reserve(CHUNK)
    assert small == slots[0]  # the free hole, nothing evicted
    assert tier.stats().evictions == 3
    assert tier.packed([tier.entry(key(9)), None]) == (2 * CHUNK).to_bytes(8, "little") + (-1).to_bytes(
        8, "little", signed=True
    )


def test_handed_on_victims_keep_the_books_right() -> None:
    tier = make(4)
    for i in range(4):
        put(tier, i)
    got = tier.reserve_many(CHUNK, 3)  # three victims' slots, handed on as reservations
    assert None not in got and tier.allocator.slots_in_use == 4 and tier.stats().chunks == 1
    tier.commit_many([key(10 + i) for i in range(3)], got, checked=True)  # type: ignore[arg-type]
    assert tier.stats().chunks == 4 and tier.allocator.slots_in_use == 4
    assert sorted(slot_of(tier, 10 + i) for i in range(3)) == sorted(got)  # type: ignore[type-var]
