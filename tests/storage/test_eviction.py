"""The pure LRU policy: order, sizes, victims by bytes, pinned keys skipped."""

from __future__ import annotations

import pytest

from kvtier.storage.eviction import LRUPolicy


def _policy(*items: tuple[str, int]) -> LRUPolicy[str]:
    lru: LRUPolicy[str] = LRUPolicy()
    for key, nbytes in items:
        lru.add(key, nbytes)
    return lru


def never(key: str) -> bool:
    return False


def test_order_and_touch() -> None:
    lru = _policy(("a", 1), ("b", 1), ("c", 1))
    assert lru.victims(3, never) == ["a", "b", "c"]
    assert lru.touch("a")
    assert lru.victims(3, never) == ["b", "c", "a"]
    assert not lru.touch("zz")


def test_sizes_follow_add_readd_remove() -> None:
    lru = _policy(("a", 10), ("b", 20))
    assert lru.victims(30, never) == ["a", "b"] and lru.victims(31, never) == []
    lru.add("a", 5)  # re-adding replaces the size and makes it most recent
    assert lru.victims(25, never) == ["b", "a"] and lru.victims(26, never) == []
    assert lru.remove("b") and not lru.remove("b")
    assert lru.victims(5, never) == ["a"] and lru.victims(6, never) == []
    with pytest.raises(ValueError):
        lru.add("x", -1)


def test_victims_are_lru_first_and_just_enough() -> None:
    lru = _policy(("a", 10), ("b", 10), ("c", 10), ("d", 10))
    assert lru.victims(15, never) == ["a", "b"]
    assert lru.victims(10, never) == ["a"]
    assert lru.victims(40, never) == ["a", "b", "c", "d"]  # picking does not remove
    assert lru.victims(0, never) == []


def test_victims_skip_pinned() -> None:
    lru = _policy(("a", 10), ("b", 10), ("c", 10))
    pinned = {"a", "c"}
    assert lru.victims(10, pinned.__contains__) == ["b"]
    assert lru.victims(20, pinned.__contains__) == []  # cannot be met: evict nothing


def test_touch_protects_from_eviction() -> None:
    lru = _policy(("a", 10), ("b", 10))
    lru.touch("a")
    assert lru.victims(10, never) == ["b"]


def test_batch_operations_match_one_by_one() -> None:
    lru = _policy(("a", 1), ("b", 1), ("c", 1))
    lru.touch_many(["a", "zz", "b"])  # an untracked key is skipped, the others move in order
    assert lru.victims(3, never) == ["c", "a", "b"]
    lru.add_new(["d", "e"], 4)
    assert lru.victims(11, never) == ["c", "a", "b", "d", "e"] and lru.victims(12, never) == []
    lru.add_new(["c", "f", "f"], 2)  # tracked or repeated keys: as add() one by one
    assert lru.victims(14, never) == ["a", "b", "d", "e", "c", "f"] and lru.victims(15, never) == []
    lru.remove_many(["a", "d"])
    assert lru.victims(9, never) == ["b", "e", "c", "f"] and lru.victims(10, never) == []
    with pytest.raises(KeyError):
        lru.remove_many(["zz"])
    with pytest.raises(ValueError):
        lru.add_new(["x"], -1)


def test_victims_walk_past_pinned_keys_as_the_scan_does() -> None:
    # Keys of one size take the batched path: it must pick, and reorder, what the scan would.
    sizes = [(k, 10) for k in "abcdefgh"]
    pinned = {"a", "c", "d", "p"}
    batched = _policy(*sizes)
    assert batched.victims(25, pinned.__contains__) == ["b", "e", "f"]
    # Pinned keys walked past move to the end; victims stay until the caller removes them.
    order = batched.victims(80, never)
    assert order == ["b", "e", "f", "g", "h", "a", "c", "d"]
    scanned = _policy(("p", 11), *sizes)  # a first key of another size: the one-by-one scan
    assert scanned.victims(25, pinned.__contains__) == ["b", "e", "f"]
    assert [k for k in scanned.victims(91, never) if k != "p"] == order


def test_victims_that_cannot_be_met_leave_the_order_to_the_scan() -> None:
    lru = _policy(("a", 10), ("b", 10), ("c", 10))
    assert lru.victims(30, {"b"}.__contains__) == []
    assert lru.victims(30, never) == ["a", "c", "b"]  # the scan moved the pinned key it walked past
