"""The object tier's index: paths, a LIST's reconciliation with what the loop did meanwhile, victims."""

from __future__ import annotations

from kvtier.storage.base import ChunkKey
from kvtier.storage.tiers.object_index import ObjectIndex, object_path, parse_path

NS = "0123456789abcdef"


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, bytes([i]) * 8)


def test_paths_round_trip_and_foreign_paths_are_refused() -> None:
    assert object_path(key(1)) == f"{NS}/0101010101010101"
    assert parse_path(object_path(key(1))) == key(1)
    for foreign in ("notes.txt", f"{NS}/xyz", f"{NS}/abc", f"{NS[:-1]}/0101", f"{NS}/", "a/b/c"):
        assert parse_path(foreign) is None


def test_a_list_adds_what_others_wrote_and_drops_what_is_gone() -> None:
    index = ObjectIndex()
    index.stored(key(1), 10)
    index.stored(key(2), 10)
    refresh = index.begin()
    ids = index.ids
    listed = [(1.0, ids.compact(key(2)), 10), (2.0, ids.compact(key(3)), 30)]
    done = index.reconcile(refresh, listed)
    assert [ids.key_of(c) for c in done.added] == [key(3)]
    assert [ids.key_of(c) for c in done.gone] == [key(1)]
    assert (index.find(key(1)), index.used) == (None, 40)


def test_what_the_loop_did_during_a_list_wins_over_the_list() -> None:
    index = ObjectIndex()
    index.stored(key(1), 10)
    refresh = index.begin()
    index.stored(key(4), 10)  # written after the LIST passed it: not listed, kept
    index.drop(key(1))  # deleted while the LIST ran, though listed: not brought back
    listed = [(1.0, index.ids.compact(key(1)), 10)]
    done = index.reconcile(refresh, listed)
    assert done.added == [] and done.gone == []
    assert index.find(key(4)) is not None and index.find(key(1)) is None


def test_victims_are_unused_and_not_held() -> None:
    index = ObjectIndex()
    for i in range(4):
        index.stored(key(i), 10)
    index.touch(index.ids.compact(key(0)))  # a hit: a second chance
    held = {index.ids.compact(key(1))}
    assert [index.ids.key_of(c) for c in index.victims(15, held.__contains__)] == [key(2), key(3)]
