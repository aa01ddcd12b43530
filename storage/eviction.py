"""CLOCK (second chance) eviction over dense ids: a small pure module (no I/O, no slots), owned by
the tier that uses it.

The policy keeps one reference bit per id and a hand that sweeps the ids in order. A use sets the
bit; the hand passing an id clears it, and an id the hand finds with its bit clear is a victim. So
an id used since the hand last passed it gets a second chance: an approximation of LRU that needs
no object and no list move per use, only a byte set (the tier's index keeps no object per chunk).

Whether an id may go (stored, not pinned) and what it weighs are the tier's knowledge, passed in as
functions over lists of ids: the policy knows nothing of slots, leases or writes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import not_, setitem

# Of candidate ids (bit clear, in hand order): those that may go now, in the same order.
EvictableFn = Callable[[list[int]], list[int]]
# Of ids: the bytes each one frees.
SizesFn = Callable[[list[int]], list[int]]


class ClockPolicy:
    """Reference bits of ids 1 .. limit-1 and the hand that sweeps them."""

    def __init__(self) -> None:
        self.bits = bytearray(1)  # by id; id 0 is never used
        self._hand = 1

    @property
    def limit(self) -> int:
        """One more than the largest id tracked."""
        return len(self.bits)

    def grow(self, limit: int) -> None:
        """Track ids up to limit-1 (new ids start with their bit clear)."""
        if limit > len(self.bits):
            self.bits.extend(bytes(limit - len(self.bits)))

    def touch(self, sid: int) -> None:
        """Mark one id used."""
        self.bits[sid] = 1

    def touch_many(self, ids: Sequence[int]) -> None:
        """Mark ids used: one C-level pass (a lookup of a long prompt touches every chunk it hits)."""
        deque(map(setitem, repeat(self.bits), ids, repeat(1)), maxlen=0)

    def add_new(self, ids: Sequence[int]) -> None:
        """Start ids unused: the hand evicts them unless they are used before it comes round."""
        deque(map(setitem, repeat(self.bits), ids, repeat(0)), maxlen=0)

    def victims(self, need_bytes: int, unit: int, evictable: EvictableFn, sizes: SizesFn) -> list[int]:
        """Ids the hand picks, in its order, whose sizes add up to need_bytes; [] when they cannot.

        unit: the size a victim usually has (to size the hand's steps). Nothing is removed: the
        caller evicts every victim. The hand moves on past the last victim, clearing the bits it
        passes; it walks at most twice round (one round clears every bit, the next finds every id
        that may go), so a call that cannot be met still ends.
        """
        limit = len(self.bits)
        if need_bytes <= 0 or limit <= 1:
            return []
        bits, hand = self.bits, self._hand
        chosen: list[int] = []
        freed, walked, budget = 0, 0, 2 * (limit - 1)
        extra = 0  # grows while windows fall short: a sweep past many pinned ids takes few steps
        while freed < need_bytes and walked < budget:
            if hand >= limit:
                hand = 1
            want = -(-(need_bytes - freed) // max(unit, 1)) + extra
            end = min(limit, hand + want + (want >> 2) + 8)
            # Ids with their bit clear, in order: C-level passes over the window's bytes.
            cands = list(compress(range(hand, end), map(not_, bits[hand:end])))
            if len(cands) > want:  # enough if all may go: the window ends before the next one
                end = cands[want]
                del cands[want:]
            extra = 2 * extra + 8
            stop = end
            ok = evictable(cands)
            if chosen and walked + (end - hand) > limit - 1:  # round again: not the same ids twice
                picked = set(chosen)
                ok = [sid for sid in ok if sid not in picked]
            if ok:
                got = sizes(ok)
                if got.count(got[0]) == len(got) and got[0] > 0:  # one size: how many is computed
                    take = min(len(ok), -(-(need_bytes - freed) // got[0]))
                    freed += take * got[0]
                else:
                    take = 0
                    for size in got:
                        take += 1
                        freed += size
                        if freed >= need_bytes:
                            break
                chosen += ok[:take]
                if freed >= need_bytes:
                    stop = ok[take - 1] + 1
            bits[hand:stop] = bytes(stop - hand)  # their second chance is used up
            walked += stop - hand
            hand = stop
        self._hand = hand
        return chosen if freed >= need_bytes else []
