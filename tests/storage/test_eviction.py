"""The pure CLOCK policy: the hand's order, second chances, sizes, ids that may not go skipped."""

from __future__ import annotations

from kvtier.storage.eviction import ClockPolicy


def _clock(n: int) -> ClockPolicy:
    clock = ClockPolicy()
    clock.grow(n + 1)  # ids 1..n
    return clock


def every(ids: list[int]) -> list[int]:
    return ids


def ones(ids: list[int]) -> list[int]:
    return [1] * len(ids)


def test_the_hand_takes_unused_ids_in_order_and_moves_on() -> None:
    clock = _clock(5)
    assert clock.victims(2, 1, every, ones) == [1, 2]
    assert clock.victims(2, 1, every, ones) == [3, 4]  # on from where it stopped
    assert clock.victims(2, 1, every, ones) == [5, 1]  # and round
    assert clock.victims(0, 1, every, ones) == []


def test_a_used_id_gets_one_second_chance() -> None:
    clock = _clock(4)
    clock.touch_many([1, 3])
    assert clock.victims(2, 1, every, ones) == [2, 4]  # 1 and 3 passed, their bits cleared
    assert clock.victims(1, 1, every, ones) == [1]  # next round: no chance left
    clock.touch(2)
    clock.add_new([3])  # a new id starts unused
    assert clock.victims(2, 1, every, ones) == [3, 4]


def test_ids_that_may_not_go_are_walked_past() -> None:
    clock = _clock(4)
    pinned = {1, 2}

    def free(ids: list[int]) -> list[int]:
        return [i for i in ids if i not in pinned]

    assert clock.victims(2, 1, free, ones) == [3, 4]
    assert clock.victims(3, 1, free, ones) == []  # cannot be met: nothing
    pinned.clear()
    assert clock.victims(2, 1, free, ones) == [1, 2]


def test_sizes_add_up_to_just_enough() -> None:
    clock = _clock(4)
    size = {1: 10, 2: 30, 3: 10, 4: 10}

    def sizes(ids: list[int]) -> list[int]:
        return [size[i] for i in ids]

    assert clock.victims(35, 10, every, sizes) == [1, 2]
    assert clock.victims(20, 10, every, sizes) == [3, 4]
    assert clock.victims(61, 10, every, sizes) == []  # more than all of them
    assert clock.victims(60, 10, every, sizes) == [1, 2, 3, 4]  # picking does not remove


def test_an_empty_clock_has_no_victims() -> None:
    assert ClockPolicy().victims(1, 1, every, ones) == []


def test_a_sweep_past_many_ids_that_may_not_go_still_finds_the_one_that_may() -> None:
    clock = _clock(50_000)
    calls: list[int] = []

    def last_only(ids: list[int]) -> list[int]:
        calls.append(len(ids))
        return [i for i in ids if i == 50_000]

    assert clock.victims(1, 1, last_only, ones) == [50_000]
    assert len(calls) < 40  # the windows grow: not one step per id walked past
