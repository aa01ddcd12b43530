"""The shared-memory arena file, its client mapping, stale-file reaping and the slot allocator."""

from __future__ import annotations

import itertools
import os
import random
import stat
from pathlib import Path

import numpy as np
import pytest

from kvtier.storage.arena import (
    PAGE,
    Arena,
    ArenaMapping,
    SlotAllocator,
    align_up,
    reap_stale_arenas,
)
from kvtier.storage.base import ArenaError, ArenaInfo, SlotRef, SlotStateError

MIB = 1 << 20


@pytest.fixture
def arena(tmp_path: Path):
    a = Arena.create(tmp_path, 4 * MIB)
    yield a
    a.close()


# -------------------------------------------------------------------------------- the file
def test_file_is_private_sized_and_named(arena: Arena, tmp_path: Path) -> None:
    path = Path(arena.path)
    assert path.parent == tmp_path
    assert path.name.startswith("kvtier-") and path.name.endswith(".arena")
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 4 * MIB
    assert arena.info() == ArenaInfo(str(path), 4 * MIB)


def test_mode_is_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        a = Arena.create(tmp_path, MIB, prefault=False)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
    finally:
        a.close()


def test_close_unlinks_and_is_idempotent(tmp_path: Path) -> None:
    a = Arena.create(tmp_path, MIB)
    path = a.path
    a.close()
    assert not os.path.exists(path)
    assert a.closed
    a.close()  # second close is a no-op
    with pytest.raises(ArenaError):
        a.view(SlotRef(0, 16))
    assert list(tmp_path.iterdir()) == []


def test_close_with_a_live_view_still_unlinks(tmp_path: Path) -> None:
    a = Arena.create(tmp_path, MIB, prefault=False)
    view = a.view(SlotRef(0, PAGE))
    a.close()  # warns, does not raise
    assert not os.path.exists(a.path)
    view[:4] = b"abcd"  # the pages stay mapped while the view lives
    view.release()


def test_prefault_finishes_without_touching_data(tmp_path: Path) -> None:
    a = Arena.create(tmp_path, 8 * MIB)
    try:
        a.view(SlotRef(0, 4))[:] = b"keep"  # written while pre-faulting may still run
        assert a.wait_prefaulted(10)
        assert a.prefault_error is None
        assert bytes(a.view(SlotRef(0, 4))) == b"keep"
        assert os.stat(a.path).st_blocks * 512 >= 8 * MIB  # every page allocated in tmpfs
    finally:
        a.close()


def test_create_errors(tmp_path: Path) -> None:
    with pytest.raises(ArenaError, match="not a directory"):
        Arena.create(tmp_path / "missing", MIB)
    with pytest.raises(ArenaError, match="below one page"):
        Arena.create(tmp_path, 100)
    with pytest.raises(ArenaError, match="bytes free"):
        Arena.create(tmp_path, 1 << 60)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------------------- client mapping
def test_client_mapping_shares_bytes(arena: Arena) -> None:
    slot = SlotRef(2 * PAGE, 3 * PAGE)
    client = ArenaMapping.open(arena.info())
    try:
        arena.view(slot)[:] = bytes(range(256)) * (3 * PAGE // 256)
        assert bytes(client.view(slot)) == bytes(arena.view(slot))
        arr = client.ndarray(slot, np.uint32)
        arr[:] = 7  # numpy writes land in the service's mapping
        assert np.frombuffer(arena.view(slot), np.uint32).tolist() == [7] * (3 * PAGE // 4)
        del arr
    finally:
        client.close()
        client.close()


def test_client_mapping_prefaults_in_background(arena: Arena) -> None:
    arena.view(SlotRef(0, 4))[:] = b"data"
    client = ArenaMapping.open(arena.info(), prefault=True)
    try:
        assert client.wait_prefaulted(10) and client.prefault_error is None
        assert bytes(client.view(SlotRef(0, 4))) == b"data"  # populating changed nothing
    finally:
        client.close()


def test_close_stops_prefaulting_promptly(tmp_path: Path) -> None:
    a = Arena.create(tmp_path, 256 * MIB)
    a.close()  # joins the thread at its next step
    assert a.wait_prefaulted(0) and list(tmp_path.iterdir()) == []


def test_client_mapping_errors(arena: Arena, tmp_path: Path) -> None:
    with pytest.raises(ArenaError, match="expected"):
        ArenaMapping.open(ArenaInfo(arena.path, arena.size + PAGE))
    with pytest.raises(ArenaError, match="cannot open"):
        ArenaMapping.open(str(tmp_path / "nope.arena"))
    client = ArenaMapping.open(arena.path)
    try:
        with pytest.raises(SlotStateError):
            client.view(SlotRef(arena.size - PAGE, 2 * PAGE))
    finally:
        client.close()


# -------------------------------------------------------------------------------- stale files
def _old(path: Path) -> None:
    os.utime(path, (1_000_000, 1_000_000))


def test_reap_removes_unlocked_arenas_and_only_old_half_created_ones(tmp_path: Path) -> None:
    dead = tmp_path / "kvtier-deadbeef.arena"
    dead.write_bytes(b"x" * 10)  # just written: a service killed right after it started
    young = tmp_path / "kvtier-00ff.creating"
    young.write_bytes(b"y")
    foreign = tmp_path / "other.arena"
    foreign.write_bytes(b"z")
    _old(foreign)
    live = Arena.create(tmp_path, MIB, prefault=False)  # reaps `dead` already
    try:
        assert not dead.exists()
        _old(Path(live.path))
        assert reap_stale_arenas(tmp_path) == []  # the live owner holds its lock
        assert young.exists() and foreign.exists() and os.path.exists(live.path)
        _old(young)
        assert reap_stale_arenas(tmp_path) == [str(young)]
    finally:
        live.close()


# -------------------------------------------------------------------------------- allocator
def test_alloc_aligns_and_fills_exactly() -> None:
    alloc = SlotAllocator(10 * PAGE + 100)
    assert alloc.capacity == 10 * PAGE
    a = alloc.alloc(100)
    b = alloc.alloc(PAGE + 1)
    assert a == SlotRef(0, 100) and b == SlotRef(PAGE, PAGE + 1)
    assert alloc.used_bytes == 3 * PAGE and alloc.slots_in_use == 2
    c = alloc.alloc(7 * PAGE)
    assert c is not None and c.offset == 3 * PAGE
    assert alloc.alloc(1) is None
    assert alloc.free_bytes == 0


def test_free_coalesces_neighbours() -> None:
    alloc = SlotAllocator(4 * PAGE)
    slots = [alloc.alloc(PAGE) for _ in range(4)]
    assert all(slots)
    for i in (1, 3, 0, 2):  # free in an order that needs both-side merges
        s = slots[i]
        assert s is not None
        alloc.free(s)
    assert alloc.alloc(4 * PAGE) == SlotRef(0, 4 * PAGE)  # merged back into one extent


def test_best_fit_keeps_large_holes() -> None:
    alloc = SlotAllocator(8 * PAGE)
    a, b, c, d = (alloc.alloc(2 * PAGE) for _ in range(4))
    assert a and b and c and d
    alloc.free(a)  # hole of 2 pages at 0
    alloc.free(c)
    alloc.free(d)  # hole of 4 pages at 4
    small = alloc.alloc(PAGE)
    assert small is not None and small.offset == 0  # the small hole, not the big one
    assert alloc.alloc(4 * PAGE) == SlotRef(4 * PAGE, 4 * PAGE)  # the big one is whole


def test_bad_frees_raise() -> None:
    alloc = SlotAllocator(4 * PAGE)
    slot = alloc.alloc(PAGE)
    assert slot is not None
    with pytest.raises(SlotStateError):
        alloc.free(SlotRef(slot.offset, slot.length + 1))
    alloc.free(slot)
    with pytest.raises(SlotStateError):
        alloc.free(slot)
    with pytest.raises(ValueError):
        SlotAllocator(PAGE, align=3000)


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    alloc = SlotAllocator(256 * PAGE)
    live: list[SlotRef] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            slot = alloc.alloc(rng.choice([100, PAGE, 3 * PAGE + 5, 8 * PAGE]))
            if slot is not None:
                live.append(slot)
        spans = sorted((s.offset, s.offset + align_up(s.length)) for s in live)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
        assert all(start % PAGE == 0 and end <= alloc.capacity for start, end in spans)
        assert alloc.used_bytes == sum(end - start for start, end in spans)
    for slot in live:
        alloc.free(slot)
    assert alloc.alloc(alloc.capacity) == SlotRef(0, alloc.capacity)  # all merged back


@pytest.mark.parametrize("seed", range(3))
def test_alloc_many_gives_what_alloc_one_by_one_gives(seed: int) -> None:
    rng = random.Random(seed)
    batched, single = SlotAllocator(64 * PAGE), SlotAllocator(64 * PAGE)
    live: list[SlotRef] = []
    for _ in range(300):
        if live and rng.random() < 0.5:
            for _ in range(rng.randrange(1, 4)):
                if live:
                    slot = live.pop(rng.randrange(len(live)))
                    batched.free(slot)
                    single.free(slot)
            continue
        length, count = rng.choice([PAGE, 2 * PAGE + 1, 3 * PAGE]), rng.randrange(1, 9)
        got = batched.alloc_many(length, count)
        want: list[SlotRef] = []
        for _ in range(count):
            slot = single.alloc(length)
            if slot is None:
                break
            want.append(slot)
        assert got == want
        ids = batched.claim(got)
        assert ids == single.claim(want)  # the same ids, freed ones reused alike
        assert batched.reopen(ids) == single.reopen(ids) == got  # open again, to be freed above
        live += got
        assert (batched.used_bytes, batched.slots_in_use) == (single.used_bytes, single.slots_in_use)
