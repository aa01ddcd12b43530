"""Circuit breaker: closed -> open -> half-open -> closed, with an injected clock."""

from __future__ import annotations

import pytest

from kvtier.storage.breaker import CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_on_failure_and_refuses_until_period() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(5.0, clock=clock)
    assert breaker.allow() and breaker.closed
    breaker.record_failure()
    assert not breaker.closed
    assert breaker.opens == 1
    assert not breaker.allow()
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow()  # the period is over: a probe may go


def test_half_open_lets_one_probe_and_success_closes() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(5.0, clock=clock)
    breaker.record_failure()
    clock.now += 5.0
    assert breaker.allow()  # the probe
    assert not breaker.closed  # half-open until the probe answers
    assert not breaker.allow()  # everyone else waits for the probe
    breaker.record_success()
    assert breaker.closed
    assert breaker.allow() and breaker.allow()


def test_failed_probe_reopens_for_a_full_period() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(2.0, clock=clock)
    breaker.record_failure()
    clock.now += 2.0
    assert breaker.allow()
    clock.now += 0.5
    breaker.record_failure()
    assert not breaker.closed
    assert breaker.opens == 2
    clock.now += 1.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow()


def test_lost_probe_gives_way_after_a_period() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(1.0, clock=clock)
    breaker.record_failure()
    clock.now += 1.0
    assert breaker.allow()  # probe whose caller never reports back
    clock.now += 0.5
    assert not breaker.allow()
    clock.now += 0.5
    assert breaker.allow()


def test_threshold_counts_consecutive_failures() -> None:
    breaker = CircuitBreaker(1.0, failure_threshold=3, clock=FakeClock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.closed
    breaker.record_failure()
    assert not breaker.closed


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0)
    with pytest.raises(ValueError):
        CircuitBreaker(1.0, failure_threshold=0)
