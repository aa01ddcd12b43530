"""The disk tier's index: which chunks have a file, its size, in LRU order; and the index's load.

Who owns what: ``DiskIndex`` and ``IndexLoad`` belong to the event loop; ``NamespaceIds`` is shared
with the scan's threads and assigns new ids under a lock; ``order_by_mtime`` runs in a thread.
Design: docs/internals.md#disk-tier-diskpy-disk_filespy-disk_indexpy
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.storage.base import ChunkKey

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
    """Compact key -> file size, least recently used first, and the bytes of all of them."""

    def __init__(self, ids: NamespaceIds | None = None) -> None:
        self.ids = ids or NamespaceIds()
        self.used = 0
        self._entries: dict[bytes, int] = {}
        self._sizes: dict[int, int] = {}  # one int object per distinct size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, compact: object) -> bool:
        return compact in self._entries

    def find(self, key: ChunkKey) -> bytes | None:
        """key's compact key if it is indexed, else None."""
        prefix = self.ids.find(key.namespace)
        if prefix is None:
            return None
        compact = prefix + key.prefix_hash
        return compact if compact in self._entries else None

    def size_of(self, compact: bytes) -> int | None:
        """The indexed file size, or None."""
        return self._entries.get(compact)

    def put(self, compact: bytes, size: int) -> None:
        """Index a file as the most recently used, replacing any entry of the key."""
        old = self._entries.pop(compact, None)
        if old is not None:
            self.used -= old
        self._entries[compact] = self._sizes.setdefault(size, size)
        self.used += size

    def interned(self, sizes: list[int]) -> list[int]:
        """sizes, each replaced by the int object the index shares for that size."""
        same = self._sizes.setdefault
        return list(map(same, sizes, sizes))

    def touch(self, compact: bytes) -> bool:
        """Make an indexed key the most recently used; False when it is not indexed."""
        size = self._entries.pop(compact, None)
        if size is None:
            return False
        self._entries[compact] = size
        return True

    def pop(self, compact: bytes) -> int | None:
        """Unindex a key; its size, or None when it was not indexed."""
        size = self._entries.pop(compact, None)
        if size is not None:
            self.used -= size
        return size

    def oldest(self) -> Iterator[tuple[bytes, int]]:
        """Entries from the least recently used on (do not change the index while iterating)."""
        return iter(self._entries.items())

    def keys(self) -> list[bytes]:
        """Every indexed compact key, oldest first (a copy)."""
        return list(self._entries)

    def reorder(self, entries: dict[bytes, int]) -> None:
        """Take entries, the same keys and sizes as the index, as its new LRU order."""
        if len(entries) != len(self._entries):
            raise ValueError(f"a reorder of {len(self._entries)} entries got {len(entries)}")
        self._entries = entries


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
        self._sizes: list[int] = []
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
        self._sizes += index.interned(batch.sizes)  # one int per file otherwise, each kept till the end
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

    def records(self) -> tuple[list[bytes], list[int], array[float]]:
        """Every file the scan reported (for order_by_mtime, once no batch is left to merge)."""
        return self._keys, self._sizes, self._mtimes

    def settle(self, index: DiskIndex, ordered: dict[bytes, int]) -> None:
        """Give index the LRU order of ordered (every file found, oldest first), fixed by what
        happened during the load: keys dropped go, keys stored or read come last, in their order."""
        for compact in self.dropped:
            ordered.pop(compact, None)
        for compact in self.recent:
            ordered.pop(compact, None)
        for compact in self.recent:
            size = index.size_of(compact)
            if size is not None:
                ordered[compact] = size
        index.reorder(ordered)
        self._keys, self._sizes, self._mtimes = [], [], array("d")  # ordered holds what is needed


def order_by_mtime(keys: list[bytes], sizes: list[int], mtimes: array[float]) -> dict[bytes, int]:
    """keys -> sizes, oldest modification first (run in a thread: numpy sorts without the GIL)."""
    order = np.argsort(np.frombuffer(mtimes, dtype=np.float64), kind="stable").tolist()
    return {keys[i]: sizes[i] for i in order}
