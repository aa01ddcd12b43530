"""The worker's arena mapping: pinned for DMA off vLLM's serving path, and used only once pinned."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier.connector.worker_arena as worker_arena
from kvtier.app.client import HelloReply
from kvtier.connector.worker_arena import WorkerArena
from kvtier.storage.arena import Arena
from kvtier.storage.base import SlotRef


@pytest.fixture
def arenas(tmp_path: Path) -> Iterator[tuple[Arena, Arena]]:
    """Two service instances' arenas (as after a service restart)."""
    pair = (Arena.create(tmp_path, 1 << 16, prefault=False), Arena.create(tmp_path, 1 << 16, prefault=False))
    yield pair
    for arena in pair:
        arena.close()


class _Pins:
    """A stand-in for CUDA's host registration: pinning waits at a gate; unpinning is recorded."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.pinned_on: list[str] = []
        self.unpinned: list[list[int]] = []

    def pin(self, buf: memoryview) -> list[int]:
        self.pinned_on.append(threading.current_thread().name)
        assert self.gate.wait(10), "the test never opened the gate"
        return [len(self.pinned_on)]

    def unpin(self, addresses: list[int]) -> None:
        self.unpinned.append(addresses)


@pytest.fixture
def pins(monkeypatch: pytest.MonkeyPatch) -> _Pins:
    fake = _Pins()
    monkeypatch.setattr(worker_arena, "pin_host_buffer", fake.pin)
    monkeypatch.setattr(worker_arena, "unpin_host_buffer", fake.unpin)
    return fake


def _hello(instance: str, arena: Arena) -> HelloReply:
    return HelloReply(instance, arena.info())


def test_a_new_arena_met_while_serving_is_pinned_on_a_thread_of_its_own(arenas, pins) -> None:
    mapped = WorkerArena(None, cuda=True)
    mapped.adopt(_hello("a", arenas[0]))  # returns while the pin thread waits at the gate
    assert not mapped.usable and not mapped.pinned
    assert mapped.view("a", SlotRef(0, 8)) is None  # no copy uses it before it is pinned
    pins.gate.set()
    mapped.shutdown()  # waits for the pinning, then unpins and unmaps
    assert pins.pinned_on[0].startswith("kvtier-pin") and pins.unpinned == [[1]]


def test_a_replaced_arena_is_unpinned_off_the_serving_path_and_the_new_one_serves_once_pinned(
    arenas, pins
) -> None:
    pins.gate.set()
    mapped = WorkerArena(None, cuda=True)
    mapped.adopt(_hello("a", arenas[0]), pin_here=True)  # start-up: pinned in the caller's thread
    assert pins.pinned_on == [threading.current_thread().name]
    assert mapped.usable and mapped.pinned and mapped.view("a", SlotRef(0, 8)) is not None
    mapped.adopt(_hello("b", arenas[1]))
    assert mapped.view("a", SlotRef(0, 8)) is None  # the old instance's slots are gone
    mapped.shutdown()
    assert pins.pinned_on[1].startswith("kvtier-pin") and pins.unpinned == [[1], [2]]


def test_without_cuda_an_arena_serves_at_once_and_nothing_is_pinned(arenas, pins) -> None:
    mapped = WorkerArena(None, cuda=False)
    mapped.adopt(_hello("a", arenas[0]))
    view = mapped.view("a", SlotRef(0, 8))
    assert mapped.usable and not mapped.pinned and view is not None
    view.release()
    mapped.shutdown()
    assert pins.pinned_on == [] and pins.unpinned == []
