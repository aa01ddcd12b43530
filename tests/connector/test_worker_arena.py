"""The worker's arena mapping: pinned for DMA off vLLM's serving path, and used only once pinned."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import kvtier.connector.worker_arena as worker_arena
from kvtier.app.client import HelloReply
from kvtier.connector.connector import KVTierStats
from kvtier.connector.prom import ARENA_PINNED, KVTierPromMetrics
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
    """A stand-in for CUDA's host registration: pinning waits at a gate; unpinning is recorded, and so
    is each thread's torch.cuda.set_device."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.pinned_on: list[str] = []
        self.unpinned: list[list[int]] = []
        self.bound: dict[str, torch.device] = {}  # thread name -> the device it set
        self.refuse = False  # CUDA refuses to pin (e.g. an arena outside tmpfs)

    def pin(self, buf: memoryview, device: torch.device, slot_bytes: int) -> list[int]:
        name = threading.current_thread().name
        self.pinned_on.append(name)
        assert device == CUDA1 and (name == MAIN or self.bound.get(name) == CUDA1)
        assert self.gate.wait(10), "the test never opened the gate"
        return [] if self.refuse else [len(self.pinned_on)]

    def unpin(self, addresses: list[int], device: torch.device) -> None:
        assert device == CUDA1
        self.unpinned.append(addresses)

    def set_device(self, device: torch.device) -> None:
        self.bound[threading.current_thread().name] = device


CUDA1 = torch.device("cuda", 1)  # a rank's KV cache on the machine's second GPU
MAIN = threading.current_thread().name


@pytest.fixture
def pins(monkeypatch: pytest.MonkeyPatch) -> _Pins:
    fake = _Pins()
    monkeypatch.setattr(worker_arena, "pin_host_buffer", fake.pin)
    monkeypatch.setattr(worker_arena, "unpin_host_buffer", fake.unpin)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    return fake


def _hello(instance: str, arena: Arena) -> HelloReply:
    return HelloReply(instance, arena.info())


def test_a_new_arena_met_while_serving_is_pinned_on_a_thread_of_its_own(arenas, pins) -> None:
    mapped = WorkerArena(None, CUDA1)
    mapped.adopt(_hello("a", arenas[0]))  # returns while the pin thread waits at the gate
    assert not mapped.usable and not mapped.pinned
    assert mapped.view("a", SlotRef(0, 8)) is None  # no copy uses it before it is pinned
    pins.gate.set()
    mapped.shutdown()  # waits for the pinning, then unpins and unmaps
    assert pins.pinned_on[0].startswith("kvtier-pin") and pins.unpinned == [[1]]
    assert pins.bound == {pins.pinned_on[0]: CUDA1}  # the pin thread bound the KV cache's device


def test_a_replaced_arena_is_unpinned_off_the_serving_path_and_the_new_one_serves_once_pinned(
    arenas, pins
) -> None:
    pins.gate.set()
    mapped = WorkerArena(None, CUDA1)
    mapped.adopt(_hello("a", arenas[0]), pin_here=True)  # start-up: pinned in the caller's thread
    assert pins.pinned_on == [threading.current_thread().name]
    assert mapped.usable and mapped.pinned and mapped.view("a", SlotRef(0, 8)) is not None
    mapped.adopt(_hello("b", arenas[1]))
    assert mapped.view("a", SlotRef(0, 8)) is None  # the old instance's slots are gone
    mapped.shutdown()
    assert pins.pinned_on[1].startswith("kvtier-pin") and pins.unpinned == [[1], [2]]


def test_without_cuda_an_arena_serves_at_once_and_nothing_is_pinned(arenas, pins) -> None:
    mapped = WorkerArena(None, None)
    mapped.adopt(_hello("a", arenas[0]))
    view = mapped.view("a", SlotRef(0, 8))
    assert mapped.usable and not mapped.pinned and view is not None
    view.release()
    mapped.shutdown()
    assert pins.pinned_on == [] and pins.unpinned == []


@pytest.mark.parametrize("refused", [False, True], ids=["pinned", "pinning-refused"])
def test_a_cuda_worker_reports_whether_its_arena_is_pinned(arena_worker, arenas, pins, refused: bool) -> None:
    worker, _, _, _ = arena_worker
    pins.gate.set()
    pins.refuse = refused
    assert worker.arena_pinned is None  # a CPU worker has nothing to pin
    assert "pinned_arenas" not in worker.stats() and "unpinned_arenas" not in worker.stats()
    worker._arena.shutdown()
    worker._arena = WorkerArena(None, CUDA1, slot_bytes=4096)
    worker._arena.adopt(_hello("a", arenas[0]), pin_here=True)
    assert worker.arena_pinned is (not refused)
    reports = [worker.stats(), worker.stats()]
    prom = _Prom()
    for report in reports:
        prom.metrics.observe(report, engine_idx=0)
    if refused:  # in every report: the engine runs with copies from pageable memory
        assert [r["unpinned_arenas"] for r in reports] == [1, 1] and prom.pinned() == 0
    else:  # once, when it became pinned
        assert [r.get("pinned_arenas") for r in reports] == [1, None] and prom.pinned() == 1
    assert "unpinned_arenas" not in KVTierStats(data=reports[0]).reduce()


class _Prom:
    """KVTierPromMetrics on a registry of its own, as vLLM builds it in its frontend."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        kinds = {
            kind: functools.partial(kind, registry=self.registry) for kind in (Gauge, Counter, Histogram)
        }
        self.metrics = KVTierPromMetrics(
            SimpleNamespace(kv_transfer_config=None), kinds, ["engine"], {0: ["0"]}
        )

    def pinned(self) -> float | None:
        return self.registry.get_sample_value(ARENA_PINNED, {"engine": "0"})
