"""Lease table: which chunks a lookup holds in place, in which tier, and until when.

Who owns what: the store's event loop owns the table, which keeps books only: pinning and unpinning
is the store's job, done with the leases the table hands back. The clock is injected.
Design: docs/internals.md#tiered-store-storepy-leasespy-reservationspy
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from kvtier.storage.base import ChunkKey, SlotList, Tier

Clock = Callable[[], float]


class Lease(msgspec.Struct, eq=False):
    """The chunks one lookup found: per index its key, the tier that held it and the pins taken.

    ``pinned[i]`` is the CPU chunk this lease pins for chunk i (a CPU hit, or a promoted lower-tier
    hit), kept as its CPU tier slot id so that unpinning needs no lookup; ``lower_pinned[i]`` says
    whether chunk i is pinned in its lower tier instead. (A msgspec Struct, not a dataclass: made
    in C, and every lookup makes one.)
    """

    lease_id: str
    keys: list[ChunkKey]
    tiers: list[Tier]
    pinned: list[int | None]
    lower_pinned: list[bool]
    expires_at: float
    failed: set[int] = msgspec.field(default_factory=set)
    # The lookup answer's slots when every chunk is a CPU hit (see TieredStore._lease_entries): a
    # lookup that takes over this lease's pins answers with the same slots.
    slots: SlotList | None = None

    def __len__(self) -> int:
        return len(self.keys)


class LeaseTable:
    """lease_id -> Lease with a time to live; replaced leases and expired ones are handed back."""

    def __init__(self, ttl: float, clock: Clock = time.monotonic) -> None:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        self.ttl = ttl
        self._clock = clock
        self._leases: OrderedDict[str, Lease] = OrderedDict()  # oldest (first to expire) first

    def __len__(self) -> int:
        return len(self._leases)

    def new(
        self,
        lease_id: str,
        keys: list[ChunkKey],
        tiers: list[Tier],
        pinned: list[int | None],
        lower_pinned: list[bool],
        slots: SlotList | None = None,
    ) -> Lease:
        """A lease expiring ttl from now (not yet in the table)."""
        return Lease(lease_id, keys, tiers, pinned, lower_pinned, self._clock() + self.ttl, slots=slots)

    def put(self, lease: Lease) -> Lease | None:
        """Add lease; returns the lease it replaced (same id), which the caller must unpin."""
        old = self._leases.pop(lease.lease_id, None)
        self._leases[lease.lease_id] = lease
        return old

    def get(self, lease_id: str) -> Lease | None:
        """The live lease of this id, or None (unknown or expired)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self._clock():
            return None
        return lease

    def is_current(self, lease: Lease) -> bool:
        """True while lease is the table's lease of its id (not replaced, released or swept)."""
        return self._leases.get(lease.lease_id) is lease

    def renew(self, lease: Lease) -> None:
        """Push lease's expiry to ttl from now (used when it is being loaded)."""
        lease.expires_at = self._clock() + self.ttl
        if self.is_current(lease):
            self._leases.move_to_end(lease.lease_id)

    def pop(self, lease_id: str) -> Lease | None:
        """Remove and return the lease of this id (expired or not), or None."""
        return self._leases.pop(lease_id, None)

    def sweep(self) -> list[Lease]:
        """Remove and return every expired lease."""
        leases, now = self._leases, self._clock()
        expired: list[Lease] = []
        while leases:
            lease = next(iter(leases.values()))
            if lease.expires_at > now:
                break
            del leases[lease.lease_id]
            expired.append(lease)
        return expired

    def drain(self) -> list[Lease]:
        """Remove and return every lease (shutdown)."""
        leases = list(self._leases.values())
        self._leases.clear()
        return leases
