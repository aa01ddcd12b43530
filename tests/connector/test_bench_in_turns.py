"""Samples taken in turn: every sampler's sample of an index right after the previous sampler's,
so the one-token prompt of the CPU-hit floor runs right after the floor's cold copy."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.bench.turns import in_turns, take_turns


def test_samplers_take_turns_in_the_order_given_and_each_gets_its_median() -> None:
    calls: list[tuple[str, int]] = []

    def sampler(name: str, values: dict[int, float]) -> Callable[[int], float]:
        def sample(i: int) -> float:
            calls.append((name, i))
            return values[i] + 0.5 * sum(1 for c in calls if c == (name, i))  # later rounds: +0.5

        return sample

    medians = in_turns([sampler("a", {0: 1.0, 1: 10.0}), sampler("b", {0: 100.0, 1: 200.0})], 2, rounds=3)
    # Round after round: a(0) b(0) a(1) b(1), never two samples of one sampler in a row.
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)] * 3
    # a: 1.5, 2, 2.5 for index 0 and 10.5, 11, 11.5 for index 1, whose median is 6.5; b likewise.
    assert medians == [6.5, 151.0]


def test_take_turns_keeps_every_sample_in_the_order_taken() -> None:
    counter = iter(range(100))
    taken = take_turns([lambda i: 10 * i + next(counter), lambda i: -next(counter)], 2, rounds=2)
    # Turns: (a0, b0), (a1, b1), then again: the k-th sample of a sampler belongs to the k-th turn.
    assert taken == [[0, 12, 4, 16], [-1, -3, -5, -7]]
