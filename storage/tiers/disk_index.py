"""The disk tier's index: which chunks have a file, its size, its recency (CLOCK); and the index's load.

Who owns what: ``DiskIndex`` and ``IndexLoad`` belong to the event loop; ``NamespaceIds`` is shared
with the scan's threads and assigns new ids under a lock; ``order_by_mtime`` runs in a thread.
Design: docs/internals.md#disk-tier-diskpy-disk_filespy-disk_indexpy
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.storage.base import ChunkKey
from kvtier.storage.eviction import ClockPolicy

ID_BYTES = 4  # namespace id width; a bytes key of up to 7 more bytes than its hash costs no more memory
_new_tuple = tuple.__new__  # ChunkKey without its Python-level __new__


class NamespaceIds:
    """Small ids for namespaces, so a compact key names its namespace in ID_BYTES bytes."""

    def __init__(self) -> None:
        self._prefix: dict[str, bytes] = {}
        self._names: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def find(self, namespace: str) -> bytes | None:
        """The id of namespace, or None when it has none yet (no key of it is indexed)."""
        return self._prefix.get(namespace)

    def prefix(self, namespace: str) -> bytes:
        """The id of namespace, assigned on first use (safe from any thread)."""
        found = self._prefix.get(namespace)
        if found is not None:
            return found
        with self._lock:
            found = self._prefix.get(namespace)
            if found is None:
                found = len(self._names).to_bytes(ID_BYTES, "big")
                self._names[found] = namespace
                self._prefix[namespace] = found  # last: a reader without the lock sees it complete
        return found

    def compact(self, key: ChunkKey) -> bytes:
        """The compact key of key (assigning its namespace an id if needed)."""
        return self.prefix(key.namespace) + key.prefix_hash

    def key_of(self, compact: bytes) -> ChunkKey:
        """The ChunkKey a compact key names."""
        return _new_tuple(ChunkKey, (self._names[compact[:ID_BYTES]], compact[ID_BYTES:]))  # type: ignore[no-any-return]


class DiskIndex:
    """Compact key -> file size by dense id, the bytes of all of them, and CLOCK recency.

    Each indexed key has an id: the dict maps the key to it, and arrays by id hold its key, size and
    the clock's reference bit (``eviction.ClockPolicy``). So a use is a byte set, a removal leaves no
    hole for a later scan to step over, and eviction sweeps a window of ids instead of walking a
    recency order from its oldest end.
    """

    def __init__(self, ids: NamespaceIds | None = None) -> None:
        self.ids = ids or NamespaceIds()
        self.used = 0
        self._id_of: dict[bytes, int] = {}
        self._keys: list[bytes | None] = [None]  # by id; id 0 is never used
        self._sizes = array("q", [0])  # by id
        self._free: list[int] = []  # ids of removed keys, for the next new ones
        self._clock = ClockPolicy()

    def __len__(self) -> int:
        return len(self._id_of)

    def __contains__(self, compact: object) -> bool:
        return compact in self._id_of

    def find(self, key: ChunkKey) -> bytes | None:
        """key's compact key if it is indexed, else None."""
        prefix = self.ids.find(key.namespace)
        if prefix is None:
            return None
        compact = prefix + key.prefix_hash
        return compact if compact in self._id_of else None

    def size_of(self, compact: bytes) -> int | None:
        """The indexed file size, or None."""
        sid = self._id_of.get(compact)
        return None if sid is None else self._sizes[sid]

    def put(self, compact: bytes, size: int) -> None:
        """Index a new key's file, not yet used, or a key's new file, which counts as a use."""
        sid = self._id_of.get(compact)
        if sid is None:
            # The last id freed: in a full tier a victim's, just behind the hand (a whole sweep away).
            sid = self._free.pop() if self._free else self._new_id()
            self._id_of[compact] = sid
            self._keys[sid] = compact
            self._clock.bits[sid] = 0
        else:
            self.used -= self._sizes[sid]
            self._clock.touch(sid)
        self._sizes[sid] = size
        self.used += size

    def _new_id(self) -> int:
        sid = len(self._keys)
        self._keys.append(None)
        self._sizes.append(0)
        self._clock.grow(sid + 1)
        return sid

    def touch(self, compact: bytes) -> bool:
        """Mark an indexed key used; False when it is not indexed."""
        sid = self._id_of.get(compact)
        if sid is None:
            return False
        self._clock.touch(sid)
        return True

    def pop(self, compact: bytes) -> int | None:
        """Unindex a key; its size, or None when it was not indexed."""
        sid = self._id_of.pop(compact, None)
        if sid is None:
            return None
        self._keys[sid] = None
        self._free.append(sid)
        size = self._sizes[sid]
        self.used -= size
        return size

    def victims(self, need: int, held: Callable[[bytes], bool] | None = None, slack: int = 0) -> list[bytes]:
        """Keys the clock picks, none held, whose sizes add up to at least need, then more while
        their total stays within need + slack; [] when the keys not held cannot free need. Nothing
        is unindexed: the caller pops each victim."""
        if need <= 0 or not self._id_of:
            return []
        keys, sizes = self._keys, self._sizes

        def evictable(ids: list[int]) -> list[int]:
            if held is None:
                return [sid for sid in ids if keys[sid] is not None]
            return [sid for sid in ids if (c := keys[sid]) is not None and not held(c)]

        def sizes_of(ids: list[int]) -> list[int]:
            return [sizes[sid] for sid in ids]

        unit = max(1, self.used // len(self._id_of))
        extra = slack // unit * unit  # whole victims only: the hand clears the marks of all it asks for
        chosen = self._clock.victims(need + extra, unit, evictable, sizes_of)
        if not chosen and extra:
            chosen = self._clock.victims(need, unit, evictable, sizes_of)
        out: list[bytes] = []
        total = 0
        for sid in chosen:
            size = sizes[sid]
            if total >= need and total + size > need + slack:
                break
            out.append(keys[sid])  # type: ignore[arg-type]
            total += size
        return out

    def key_list(self) -> list[bytes]:
        """Every indexed compact key (a copy)."""
        return list(self._id_of)

    def reorder(self, entries: dict[bytes, int]) -> None:
        """Take entries, the same keys and sizes as the index, oldest first: they get new ids in that
        order with their bits clear, so that the hand, from the first id, evicts the oldest first."""
        if len(entries) != len(self._id_of):
            raise ValueError(f"a reorder of {len(self._id_of)} entries got {len(entries)}")
        self._id_of = dict(zip(entries, range(1, len(entries) + 1), strict=True))
        self._keys = [None, *entries]
        self._sizes = array("q", [0])
        self._sizes.extend(entries.values())
        self._free = []
        self._clock = ClockPolicy()
        self._clock.grow(len(entries) + 1)


@dataclass(slots=True)
class ScanBatch:
    """What the scan found in one directory: indexable files, and files to remove."""

    keys: list[bytes] = field(default_factory=list)  # compact keys
    sizes: list[int] = field(default_factory=list)
    mtimes: list[float] = field(default_factory=list)
    bad: list[bytes] = field(default_factory=list)  # corrupt or of another format: to be removed
    covered: list[Sequence[bytes]] = field(default_factory=list)  # each file's block hashes (its trailer)


class IndexLoad:
    """The books of one load of the index from the scan (see the module docstring)."""

    def __init__(self) -> None:
        self.recent: dict[bytes, None] = {}  # keys stored or read during the load, in that order
        self.dropped: set[bytes] = set()  # keys unindexed or deleted during the load
        self.cleared = False  # a clear ran during the load: files found from then on are removed
        self.found = 0  # files the scan reported
        self._keys: list[bytes] = []
        self._sizes = array("q")
        self._mtimes = array("d")

    def stored(self, compact: bytes) -> None:
        """The loop stored or read key during the load: it follows every file the scan finds."""
        self.recent.pop(compact, None)
        self.recent[compact] = None

    def merge(
        self, index: DiskIndex, batch: ScanBatch, writing: set[bytes], indexed: list[int] | None = None
    ) -> list[bytes]:
        """Index the batch's files the loop knows nothing newer of; returns the keys whose files are
        to be removed (bad ones, and after a clear every file found but a write's). indexed, when
        given, gets the position in the batch of each file indexed."""
        self.found += len(batch.keys)
        self._keys += batch.keys
        self._sizes.extend(batch.sizes)  # no int object per file kept till the end
        self._mtimes.extend(batch.mtimes)
        entries, dropped = index, self.dropped
        remove = [k for k in batch.bad if k not in entries and k not in writing]
        for at, (compact, size) in enumerate(zip(batch.keys, batch.sizes, strict=True)):
            if compact in entries or compact in dropped:
                continue  # stored anew, or deleted, since the scan saw it
            if self.cleared and compact not in writing:
                dropped.add(compact)
                remove.append(compact)
                continue
            index.put(compact, size)
            if indexed is not None:
                indexed.append(at)
        return remove

    def records(self) -> tuple[list[bytes], array[int], array[float]]:
        """Every file the scan reported (for order_by_mtime, once no batch is left to merge)."""
        return self._keys, self._sizes, self._mtimes

    def settle(self, index: DiskIndex, ordered: dict[bytes, int]) -> None:
        """Give index the order of ordered (every file found, oldest first), fixed by what happened
        during the load: keys dropped go, keys stored or read come last, in their order, marked used."""
        for compact in self.dropped:
            ordered.pop(compact, None)
        for compact in self.recent:
            ordered.pop(compact, None)
        for compact in self.recent:
            size = index.size_of(compact)
            if size is not None:
                ordered[compact] = size
        index.reorder(ordered)
        for compact in self.recent:
            index.touch(compact)
        self._keys, self._sizes, self._mtimes = [], array("q"), array("d")  # ordered holds what is needed


def order_by_mtime(keys: list[bytes], sizes: array[int], mtimes: array[float]) -> dict[bytes, int]:
    """keys -> sizes, oldest modification first (run in a thread: numpy sorts without the GIL)."""
    order = np.argsort(np.frombuffer(mtimes, dtype=np.float64), kind="stable").tolist()
    return {keys[i]: sizes[i] for i in order}
