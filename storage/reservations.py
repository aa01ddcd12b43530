"""Saving chunks: slots reserved to be filled, their commit or abort, and the write policy.

Who owns what: the store's event loop owns the reservations; the CPU tier owns the slots themselves
and the write-behind queue owns queued writes. A reserved slot ends in exactly one commit or abort.
Design: docs/internals.md#tiered-store-storepy-leasespy-reservationspy
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Literal

from kvtier.storage.base import ChunkKey, SlotRef, SlotStateError
from kvtier.storage.keys import chunk_keys
from kvtier.storage.tiers.cpu import CpuTier, SlotId
from kvtier.storage.writeback import WriteBack

# C-level getters for map() over tuples: no bytecode per chunk.
_first = itemgetter(0)  # a reservation's key, a ChunkKey's namespace, a SlotRef's offset
_second = itemgetter(1)  # a reservation's slot, a ChunkKey's prefix hash

_Reservation = tuple[ChunkKey, SlotRef]  # a plain tuple: zip() builds them in C, 64 at a time


class Reservations:
    """reserve / commit / abort over the CPU tier, and the queueing of chunks for lower tiers."""

    def __init__(
        self,
        cpu: CpuTier,
        writeback: WriteBack | None,
        write_policy: Literal["through", "on_reuse"] = "through",
    ) -> None:
        self._cpu = cpu
        self._writeback = writeback
        self._write_through = write_policy == "through" and writeback is not None
        self._reserved: dict[int, _Reservation] = {}  # slot offset -> (key, slot)
        self._reserving: dict[ChunkKey, int] = {}  # key -> offset of its reserved slot
        self.dropped = 0  # reserve() answers of None for lack of space

    # ------------------------------------------------------------------------------------ reserve
    def reserve(self, namespace: str, hashes: list[bytes], chunk_bytes: int) -> list[SlotRef | None]:
        """A slot of chunk_bytes for each key; None where the chunk is stored, reserved or queued
        (see the module docstring), or no space is left (counted in dropped)."""
        keys = chunk_keys(namespace, hashes)
        stored = self._cpu.entries(namespace, hashes)
        if self._all_new(keys, stored):
            return self._reserve_all(keys, chunk_bytes)
        reserving, reserved = self._reserving, self._reserved
        queued = self._writeback.pending if self._writeback is not None else None
        out: list[SlotRef | None] = [None] * len(keys)
        wanted: dict[ChunkKey, int] = {}  # key -> index of its first occurrence in this call
        again: list[ChunkKey] = []  # later occurrences: they get a slot only if the first did not
        for i, key in enumerate(keys):
            if key in wanted:
                again.append(key)
            elif stored[i] is None and key not in reserving and (queued is None or not queued(key)):
                wanted[key] = i
        slots = self._cpu.reserve_many(chunk_bytes, len(wanted))
        for (key, i), slot in zip(wanted.items(), slots, strict=True):
            if slot is None:
                self.dropped += 1
                continue
            reserved[slot.offset] = (key, slot)
            reserving[key] = slot.offset
            out[i] = slot
        # A repeat of a key whose first occurrence found no space would have found none either.
        self.dropped += sum(1 for key in again if out[wanted[key]] is None)
        return out

    def _all_new(self, keys: list[ChunkKey], stored: list[SlotId | None]) -> bool:
        """True when no key is stored, reserved, queued for a write or asked for twice (a save)."""
        if stored.count(None) != len(keys) or len(set(keys)) != len(keys):
            return False
        if not self._reserving.keys().isdisjoint(keys):
            return False
        return self._writeback is None or not any(map(self._writeback.pending, keys))

    def _reserve_all(self, keys: list[ChunkKey], chunk_bytes: int) -> list[SlotRef | None]:
        """reserve() for keys that are all new, in C-level passes while every key gets a slot."""
        slots = self._cpu.reserve_many(chunk_bytes, len(keys))
        granted = list(filter(None, slots))  # a SlotRef is a non-empty tuple: always true
        if len(granted) != len(slots):  # out of space for some: record those that got one
            self.dropped += len(slots) - len(granted)
            pairs = [(k, s) for k, s in zip(keys, slots, strict=True) if s is not None]
            keys = list(map(_first, pairs))
        else:
            pairs = list(zip(keys, granted, strict=True))
        offsets = list(map(_first, granted))
        self._reserved.update(zip(offsets, pairs, strict=True))
        self._reserving.update(zip(keys, offsets, strict=True))
        return slots

    # ------------------------------------------------------------------------------ commit, abort
    def commit(
        self,
        namespace: str,
        hashes: list[bytes],
        slots: list[SlotRef],
        covered: Sequence[Sequence[bytes]] = (),
    ) -> None:
        """Publish filled slots into the CPU tier (with each chunk's block hashes, when covered names
        them); queue them for lower tiers per write policy."""
        if len(hashes) != len(slots) or (covered and len(covered) != len(hashes)):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots and {len(covered)} hash lists")
        keys = self._check_reserved(slots, namespace, hashes)
        self._unreserve(slots)
        # Reserved slots are allocated and uncommitted: checked.
        ids = self._cpu.commit_many(keys, slots, checked=True, covered=covered)
        if self._write_through:
            for sid in ids:
                self.persist(sid)

    def abort(self, slots: list[SlotRef]) -> None:
        """Give reserved slots back unfilled."""
        self._check_reserved(slots)
        self._unreserve(slots)
        for slot in slots:
            self._cpu.free(slot)

    def _check_reserved(
        self, slots: list[SlotRef], namespace: str = "", hashes: list[bytes] | None = None
    ) -> list[ChunkKey]:
        """The keys slots are reserved for (each for its hash, when given); raises before changing
        anything when one is not."""
        offsets = list(map(_first, slots))
        found: list[Any] = list(map(self._reserved.get, offsets))
        try:
            keys: list[ChunkKey] = list(map(_first, found))
        except TypeError:  # a None: some slot is not reserved; see which below
            return self._check_each_reserved(slots, namespace, hashes)
        # Whole lists compared in C; the reservations' own keys: no new key object per chunk.
        if (
            list(map(_second, found)) != list(slots)
            or len(set(offsets)) != len(offsets)
            or (hashes is not None and not _keys_match(keys, namespace, hashes))
        ):
            return self._check_each_reserved(slots, namespace, hashes)
        return keys

    def _check_each_reserved(
        self, slots: list[SlotRef], namespace: str, hashes: list[bytes] | None
    ) -> list[ChunkKey]:
        """_check_reserved(), slot by slot: raises for the first slot that is not reserved."""
        reserved = self._reserved
        keys: list[ChunkKey] = []
        seen: set[int] = set()
        for i, slot in enumerate(slots):
            res = reserved.get(slot.offset)
            if res is None or res[1] != slot or slot.offset in seen:
                raise SlotStateError(f"{slot} is not a reserved slot")
            if hashes is not None and res[0] != (namespace, hashes[i]):
                raise SlotStateError(f"{slot} was reserved for another chunk")
            seen.add(slot.offset)
            keys.append(res[0])
        return keys

    def _unreserve(self, slots: list[SlotRef]) -> None:
        """Forget the reservations of these (checked) slots."""
        found = list(map(self._reserved.pop, map(_first, slots)))
        deque(map(self._reserving.__delitem__, map(_first, found)), maxlen=0)

    # ------------------------------------------------------------------------------ write policy
    def persist(self, sid: SlotId | None) -> None:
        """Queue a CPU chunk (an indexed one's slot id) for the lower tiers once; its slot stays
        pinned until written (the write-behind queue's done callback unpins it)."""
        cpu = self._cpu
        if sid is None or self._writeback is None or cpu.persisted(sid):
            return
        slot = cpu.pin_slot(sid)
        if self._writeback.offer(cpu.key_of(sid), slot, cpu.covered_of(sid)):
            cpu.set_persisted(sid)
        else:
            cpu.unpin(slot)

    def persist_all(self, ids: Sequence[SlotId]) -> None:
        """persist() each chunk: the 'on_reuse' trigger of a hit, which also retries a dropped write."""
        if self._writeback is not None and not self._cpu.all_persisted(ids):
            for sid in ids:
                self.persist(sid)


def _keys_match(keys: list[ChunkKey], namespace: str, hashes: list[bytes]) -> bool:
    """True when keys are namespace's keys of hashes, in order (compared in C)."""
    return list(map(_first, keys)).count(namespace) == len(keys) and list(map(_second, keys)) == list(hashes)
