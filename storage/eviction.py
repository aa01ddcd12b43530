"""LRU eviction policy by bytes: a small pure module (no I/O, no slots), owned by the tier that uses
it.

The policy only keeps order and sizes. Whether an entry may go (leased, queued for a write) is the
tier's knowledge, passed in as a predicate: the policy knows nothing of slots, leases or writes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import compress, islice, repeat
from operator import not_
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUPolicy(Generic[K]):
    """Least-recently-used order of keys with their sizes in bytes."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, int] = OrderedDict()  # first = least recently used

    def add(self, key: K, nbytes: int) -> None:
        """Track key as most recently used (re-adding replaces its size)."""
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes}")
        self._order.pop(key, None)
        self._order[key] = nbytes

    def touch(self, key: K) -> bool:
        """Mark key most recently used (a hit); False when it is not tracked."""
        if key not in self._order:
            return False
        self._order.move_to_end(key)
        return True

    def touch_many(self, keys: Sequence[K]) -> None:
        """touch() each key in order; keys not tracked are skipped."""
        try:
            # One C-level pass (map + a zero-length deque) instead of a Python call per key: the
            # lookup of a long prompt touches every chunk it hits.
            deque(map(self._order.move_to_end, keys), maxlen=0)
        except KeyError:
            # Some key is not tracked: start over one by one. Touching a key again keeps the same
            # final order, so the keys the first pass already moved end up where they should.
            for key in keys:
                self.touch(key)

    def add_new(self, keys: Sequence[K], nbytes: int) -> None:
        """add() each key in order, all of nbytes size; one C-level pass when none is tracked yet."""
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes}")
        order = self._order
        if len(set(keys)) != len(keys) or any(map(order.__contains__, keys)):
            for key in keys:  # re-adding moves a key: only add() itself does that
                self.add(key, nbytes)
            return
        order.update(zip(keys, repeat(nbytes)))

    def remove(self, key: K) -> bool:
        """Stop tracking key; False when it was not tracked."""
        return self._order.pop(key, None) is not None

    def remove_many(self, keys: Iterable[K]) -> None:
        """Stop tracking keys, every one of them tracked (KeyError otherwise)."""
        deque(map(self._order.pop, keys), maxlen=0)

    def victims(self, need_bytes: int, pinned: Callable[[K], object]) -> list[K]:
        """LRU-first unpinned keys whose sizes add up to need_bytes; [] when they cannot.

        pinned(key) is true for a key that must stay. Nothing is removed: the caller evicts the
        victims and calls remove() for each. Pinned keys the scan walks past are in use, so they
        count as recently used: moving them to the end keeps the next scan from walking past them
        again (without it, a full arena of leased chunks made every reserve scan them all).
        """
        if need_bytes <= 0:
            return []
        head = self._head_victims(need_bytes, pinned)
        if head is not None:
            return head
        chosen: list[K] = []
        skipped: list[K] = []
        freed = 0
        for key, nbytes in self._order.items():
            if pinned(key):
                skipped.append(key)
                continue
            chosen.append(key)
            freed += nbytes
            if freed >= need_bytes:
                break
        for key in skipped:
            self._order.move_to_end(key)
        return chosen if freed >= need_bytes else []

    def _head_victims(self, need_bytes: int, pinned: Callable[[K], object]) -> list[K] | None:
        """victims() in C-level passes over the least recently used keys, when they are of one size
        (a full arena of one chunk size); None when the scan must decide. A C-level predicate
        (operator.attrgetter) keeps it free of Python frames."""
        order = self._order
        if not order:
            return None
        size = next(iter(order.values()))
        if size <= 0:
            return None
        count = -(-need_bytes // size)
        keys = iter(order)
        head: list[K] = []
        free: list[bool] = []  # per key of head: not pinned
        have, step = 0, count
        while have < count:  # read on until head holds count unpinned keys
            more = list(islice(keys, step))
            if not more:
                return None  # too few unpinned keys in all: the scan decides (and reorders)
            flags = list(map(not_, map(pinned, more)))
            head += more
            free += flags
            have += flags.count(True)
            step = 2 * (count - have)
        if have == len(head):  # the usual case: nothing pinned in the way
            chosen, stop = head[:count], count
        else:
            stop = list(compress(range(len(head)), free))[count - 1] + 1
            chosen = list(compress(head[:stop], free))
        if list(map(order.__getitem__, chosen)).count(size) != count:
            return None
        # Pinned keys walked past count as recently used (see victims).
        deque(map(order.move_to_end, list(compress(head[:stop], map(not_, free)))), maxlen=0)
        return chosen
