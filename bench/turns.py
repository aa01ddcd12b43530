"""Samples taken in turn: every figure of a comparison sees the same drift of the machine's speed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of repeat calls of fn."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def take_turns(samplers: Sequence[Callable[[int], float]], count: int, rounds: int = 3) -> list[list[float]]:
    """Every sample of each sampler, taken in turn: sampler by sampler in the order given, for
    indexes 0..count-1, rounds times over; result[k][j] is sampler k's j-th sample."""
    taken = [[sample(i) for sample in samplers] for _ in range(rounds) for i in range(count)]
    return [[turn[k] for turn in taken] for k in range(len(samplers))]


def in_turns(samplers: Sequence[Callable[[int], float]], count: int, rounds: int = 3) -> list[float]:
    """Each sampler's median over single samples taken in turn (see take_turns)."""
    return [statistics.median(samples) for samples in take_turns(samplers, count, rounds)]
