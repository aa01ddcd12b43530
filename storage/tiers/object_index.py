"""The object tier's index: the objects kvtier wrote or listed under its prefix, their recency, and
how a LIST refreshes it.

A lookup reads this index only (no request to the store), so a miss costs a dict lookup. The index
holds what this node wrote and what the last LIST of the prefix found (other nodes' writes
included); ``ObjectTier`` runs a LIST at start and every ``refresh_period`` seconds, so a chunk
another node wrote is found at most one period plus one LIST later, and an object deleted
elsewhere (another node's eviction, a lifecycle rule) stays indexed as long: a lookup may then
answer a hit whose load finds nothing, which is a counted miss that unindexes the key.

The entries are ``disk_index.DiskIndex``'s (compact bytes keys, sizes, CLOCK recency, about 170 B
per object). A refresh is reconciled against what the loop did while the LIST ran
(``Refresh``): keys written meanwhile stay even if the LIST missed them, keys deleted meanwhile are
not brought back.

Who owns what: the tier's event loop owns the index and every Refresh; ``order`` runs on a thread
on a list the loop no longer changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.storage.base import ChunkKey
from kvtier.storage.keys import NAMESPACE_HEX_CHARS
from kvtier.storage.tiers.disk_index import DiskIndex

_MAX_HASH_BYTES = 255


def object_path(key: ChunkKey) -> str:
    """The object's path below the tier's prefix: ``<namespace>/<hash hex>``."""
    return f"{key.namespace}/{key.prefix_hash.hex()}"


def parse_path(path: str) -> ChunkKey | None:
    """The key an object path names, or None when it is not one of kvtier's."""
    namespace, slash, hexed = path.partition("/")
    if not slash or len(namespace) != NAMESPACE_HEX_CHARS or not hexed or len(hexed) % 2:
        return None
    if len(hexed) > 2 * _MAX_HASH_BYTES:
        return None
    try:
        int(namespace, 16)
        return ChunkKey(namespace, bytes.fromhex(hexed))
    except ValueError:
        return None


@dataclass(slots=True)
class Refresh:
    """What the loop did to the index while one LIST ran (see the module docstring)."""

    stored: set[bytes] = field(default_factory=set)  # written or read by this node meanwhile
    dropped: set[bytes] = field(default_factory=set)  # deleted or found gone meanwhile


@dataclass(slots=True)
class Reconciled:
    """A refresh's outcome: keys newly indexed (oldest first) and keys found gone."""

    added: list[bytes] = field(default_factory=list)
    gone: list[bytes] = field(default_factory=list)


class ObjectIndex:
    """The tier's index: a DiskIndex, plus the refreshes in progress."""

    def __init__(self) -> None:
        self.entries = DiskIndex()
        self.ids = self.entries.ids
        self._refreshes: list[Refresh] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def used(self) -> int:
        """Bytes of every indexed object."""
        return self.entries.used

    def find(self, key: ChunkKey) -> bytes | None:
        """key's compact key when indexed."""
        return self.entries.find(key)

    def stored(self, key: ChunkKey, size: int) -> bytes:
        """Index an object this node wrote (the most recent); returns its compact key."""
        compact = self.ids.compact(key)
        self.entries.put(compact, size)
        for refresh in self._refreshes:
            refresh.stored.add(compact)
            refresh.dropped.discard(compact)
        return compact

    def touch(self, compact: bytes) -> None:
        """A hit: the object becomes the most recently used."""
        if self.entries.touch(compact):
            for refresh in self._refreshes:
                refresh.stored.add(compact)

    def drop(self, key: ChunkKey) -> bool:
        """Unindex key (deleted, evicted, found gone); False when it was not indexed."""
        compact = self.ids.compact(key)
        for refresh in self._refreshes:
            refresh.dropped.add(compact)
            refresh.stored.discard(compact)
        return self.entries.pop(compact) is not None

    def begin(self) -> Refresh:
        """Start the books of a LIST."""
        refresh = Refresh()
        self._refreshes.append(refresh)
        return refresh

    def abandon(self, refresh: Refresh) -> None:
        """A LIST failed: forget its books."""
        if refresh in self._refreshes:
            self._refreshes.remove(refresh)

    def reconcile(self, refresh: Refresh, listed: list[tuple[float, bytes, int]]) -> Reconciled:
        """Apply a complete LIST: listed holds (mtime, compact key, size) of every object found,
        oldest first. New keys are indexed in that order as the most recent; indexed keys the LIST
        did not find, and nobody wrote meanwhile, are unindexed."""
        self.abandon(refresh)
        out = Reconciled()
        seen: set[bytes] = set()
        entries = self.entries
        for _, compact, size in listed:
            seen.add(compact)
            if compact in entries or compact in refresh.dropped:
                continue
            entries.put(compact, size)
            out.added.append(compact)
        stored = refresh.stored
        out.gone = [c for c in entries.key_list() if c not in seen and c not in stored]
        for compact in out.gone:
            entries.pop(compact)
        return out

    def victims(self, need: int, held: Callable[[bytes], bool] | None = None, slack: int = 0) -> list[bytes]:
        """Compact keys the clock picks, none held, freeing at least need bytes and up to slack more
        (``DiskIndex.victims``)."""
        return self.entries.victims(need, held, slack)


def order(listed: list[tuple[float, bytes, int]]) -> list[tuple[float, bytes, int]]:
    """listed sorted oldest first (run on a thread: a large bucket's LIST is a long list)."""
    listed.sort(key=lambda row: row[0])
    return listed
