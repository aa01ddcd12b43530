"""Lease table: time to live with an injected clock, replacement, release, expiry sweep."""

from __future__ import annotations

import pytest

from kvtier.storage.base import ChunkKey, Tier
from kvtier.storage.leases import Lease, LeaseTable


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_lease(table: LeaseTable, lease_id: str, n: int = 2) -> Lease:
    keys = [ChunkKey("ns", bytes([i])) for i in range(n)]
    return table.new(lease_id, keys, [Tier.CPU] * n, [None] * n, [False] * n)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_put_get_and_expiry(clock: Clock) -> None:
    table = LeaseTable(10.0, clock)
    lease = make_lease(table, "r1")
    assert table.put(lease) is None
    assert table.get("r1") is lease and len(table) == 1
    clock.now += 9.9
    assert table.sweep() == [] and table.get("r1") is lease
    clock.now += 0.1
    assert table.get("r1") is None  # expired, even before the sweep removes it
    assert table.sweep() == [lease]
    assert len(table) == 0 and table.sweep() == []


def test_replace_hands_back_the_old_lease(clock: Clock) -> None:
    table = LeaseTable(10.0, clock)
    first = make_lease(table, "r1")
    table.put(first)
    second = make_lease(table, "r1", 3)
    assert table.put(second) is first
    assert table.is_current(second) and not table.is_current(first)
    clock.now += 11
    assert table.sweep() == [second]  # the replaced lease's heap entry is skipped


def test_renew_postpones_expiry(clock: Clock) -> None:
    table = LeaseTable(10.0, clock)
    lease = make_lease(table, "r1")
    table.put(lease)
    clock.now += 8
    table.renew(lease)
    clock.now += 8
    assert table.sweep() == [] and table.get("r1") is lease
    clock.now += 2
    assert table.sweep() == [lease]


def test_pop_is_idempotent_and_stops_expiry(clock: Clock) -> None:
    table = LeaseTable(10.0, clock)
    lease = make_lease(table, "r1")
    table.put(lease)
    assert table.pop("r1") is lease and table.pop("r1") is None
    clock.now += 100
    assert table.sweep() == []


def test_drain_returns_everything(clock: Clock) -> None:
    table = LeaseTable(1.0, clock)
    leases = [make_lease(table, f"r{i}") for i in range(3)]
    for lease in leases:
        table.put(lease)
    assert sorted(x.lease_id for x in table.drain()) == ["r0", "r1", "r2"]
    assert len(table) == 0 and table.get("r0") is None


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LeaseTable(0)
