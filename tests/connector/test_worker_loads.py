"""Worker loads of CPU-tier hits against a real arena: layer by layer, each attention layer waits only
for its own layer; a forward that skips a wait gets its loads recomputed; failed loads are exact."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from kvtier.connector import faults
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from kvtier.storage.base import SlotRef, Tier
from tests.app import wait_until
from tests.connector.conftest import LAYERS
from tools.arena_client import done

LAYER_NAMES = [f"layer{i}" for i in range(LAYERS)]


def _stored_slot(worker: Any, arena: Any, index: int) -> tuple[SlotRef, torch.Tensor]:
    """A slot past the ones reserve hands out, filled with random bytes; its [layer, row, page] view."""
    size = worker.copier.chunk_bytes
    slot = SlotRef((7 - index) * size, size)
    arena.view(slot)[:] = os.urandom(size)
    return slot, worker.copier.slot_view(arena.view(slot))


def _job(req: str, slot: SlotRef, blocks: list[int], instance: str = "inst-1") -> LoadJob:
    chunk = ChunkLoad(0, 0, blocks, (slot.offset, slot.length))
    return LoadJob(req, f"lease-{req}", [chunk], False, instance)


def _layer_block(kv: list[torch.Tensor], layer: int, block: int) -> torch.Tensor:
    return kv[layer][block].view(torch.uint8).flatten()


def _start(worker: Any, meta: KVTierMetadata) -> None:
    worker.bind(meta)
    worker.start_load(meta)


def test_each_layer_is_in_place_once_its_wait_returns_and_the_lease_ends_after_the_forward(
    arena_worker, monkeypatch
) -> None:
    worker, client, kv, arena = arena_worker
    assert worker.copier.cpu_threads == 2
    worker.copier.overlap_loads = True  # as where the copy thread has a CPU of its own
    slot, stored = _stored_slot(worker, arena, 0)
    gate = threading.Event()
    at_gate = threading.Event()
    real = worker.copier._load_cpu

    order: list[str] = []  # what happened, in order: list.append is atomic

    def copy_thread_waits_at_the_gate(lo: int, hi: int, *args: Any) -> None:
        on_copy_thread = threading.current_thread().name == "kvtier-copy"
        if on_copy_thread:
            at_gate.set()
            assert gate.wait(10), "the test never opened the gate"
        real(lo, hi, *args)
        if on_copy_thread and lo == 0:
            order.append("layer 0 copied")

    monkeypatch.setattr(worker.copier, "_load_cpu", copy_thread_waits_at_the_gate)
    _start(worker, KVTierMetadata(loads=[_job("r1", slot, [3, 4])]))
    assert at_gate.wait(10)  # the copy thread took layer 0, the first one, and holds it
    waiter = threading.Thread(target=lambda: (worker.wait_for_layer_load("layer0"), order.append("waited")))
    waiter.start()
    # Meanwhile the waiter copies the other layers itself, from the last one down; layer 0's wait
    # returns only once the copy thread has put layer 0 in place.
    last = LAYERS - 1
    assert wait_until(lambda: torch.equal(_layer_block(kv, last, 3), stored[last, 0]), 10)
    assert not torch.equal(_layer_block(kv, 0, 3), stored[0, 0])  # held at the gate
    assert client.released == []  # the slot is still being read
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert order == ["layer 0 copied", "waited"], "layer 0's wait returned before its copy"
    for layer in range(LAYERS):  # every layer in place once layer 0's wait returned
        assert torch.equal(_layer_block(kv, layer, 3), stored[layer, 0])
        assert torch.equal(_layer_block(kv, layer, 4), stored[layer, 1])
    worker.wait_for_layer_load("layer1")
    worker.wait_for_layer_load("layer2")
    worker.wait_for_save()
    assert worker.take_load_errors() == set()
    assert client.released == ["lease-r1"]
    stats = worker.stats()
    assert stats["loaded_chunks"] == 1 and stats["unwaited_layer_loads"] == 0


def test_without_a_cpu_to_spare_start_load_puts_every_layer_in_place_before_the_forward(
    arena_worker,
) -> None:
    worker, client, kv, arena = arena_worker
    worker.copier.overlap_loads = False  # the model's threads use every CPU (this 2-core VM)
    slot, stored = _stored_slot(worker, arena, 0)
    _start(worker, KVTierMetadata(loads=[_job("r1", slot, [3, 4])]))
    for layer in range(LAYERS):  # before any layer's wait
        assert torch.equal(_layer_block(kv, layer, 3), stored[layer, 0])
        assert torch.equal(_layer_block(kv, layer, 4), stored[layer, 1])
    assert client.released == []  # the lease ends after the forward, as with overlapped loads
    for layer in range(LAYERS):
        worker.wait_for_layer_load(f"layer{layer}")
    worker.wait_for_save()
    assert worker.take_load_errors() == set()
    assert client.released == ["lease-r1"]
    stats = worker.stats()
    assert stats["loaded_chunks"] == 1 and stats["unwaited_layer_loads"] == 0


def _forward(worker: Any, layers: range, context: Any = None, meta: KVTierMetadata | None = None) -> None:
    """One step as vLLM's model runner drives it: bind, start_load, the forward's layer waits."""
    meta = meta or KVTierMetadata()
    worker.bind(meta)
    worker.start_load(meta, context)
    for layer in layers:
        worker.wait_for_layer_load(f"layer{layer}")


def _context(mode: str, attn_metadata: Any = "metadata") -> Any:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext

    return ForwardContext(
        no_compile_layers={}, attn_metadata=attn_metadata, slot_mapping={},
        cudagraph_runtime_mode=CUDAGraphMode[mode],
    )  # fmt: skip


def test_a_forward_that_skips_a_layer_wait_has_its_loads_recomputed_and_later_loads_fenced(
    arena_worker,
) -> None:
    worker, client, kv, arena = arena_worker
    _forward(worker, range(LAYERS))  # a step with no loads: the forward waits for every layer
    worker.wait_for_save()
    slot, _ = _stored_slot(worker, arena, 0)
    _forward(worker, range(1), meta=KVTierMetadata(loads=[_job("r1", slot, [3, 4])]))
    # layers 1 and 2 were never waited for, though a forward did before
    assert worker.get_finished(set()) == (set(), set())
    assert worker.take_load_errors() == {3, 4}
    worker.wait_for_save()
    stats = worker.stats()
    assert stats["unwaited_layer_loads"] == 1 and stats["failed_load_blocks"] == 2
    assert stats["loaded_chunks"] == 0 and client.released == ["lease-r1"]

    slot2, stored2 = _stored_slot(worker, arena, 1)
    _start(worker, KVTierMetadata(loads=[_job("r2", slot2, [6])]))
    # Fenced: every layer is in place when start_load returns, with no wait at all.
    assert all(torch.equal(_layer_block(kv, layer, 6), stored2[layer, 0]) for layer in range(LAYERS))
    assert client.released == ["lease-r1", "lease-r2"]
    worker.wait_for_save()
    assert worker.take_load_errors() == set() and worker.stats()["unwaited_layer_loads"] == 0


def test_a_first_forward_that_waits_for_no_layer_has_its_loads_recomputed(arena_worker) -> None:
    worker, _, _, arena = arena_worker
    slot, _ = _stored_slot(worker, arena, 0)
    _forward(worker, range(0), meta=KVTierMetadata(loads=[_job("r1", slot, [3, 4])]))
    assert worker.take_load_errors() == {3, 4}
    assert worker.stats()["unwaited_layer_loads"] == 1


@pytest.mark.parametrize("history", [True, False], ids=["after-a-plain-step", "first-step"])
def test_a_drafter_whose_layers_wait_after_the_load_report_causes_no_load_error(
    arena_worker, history: bool
) -> None:
    worker, client, kv, arena = arena_worker
    target, drafter = range(LAYERS - 1), LAYERS - 1  # the last layer is the drafter's
    if history:
        _forward(worker, target)
        assert worker.take_load_errors() == set()
        worker.wait_for_layer_load(f"layer{drafter}")
        worker.wait_for_save()
    slot, stored = _stored_slot(worker, arena, 0)
    _forward(worker, target, meta=KVTierMetadata(loads=[_job("r1", slot, [3, 4])]))
    # vLLM (spec decode) reports load errors before the drafter runs and saves after it
    assert worker.get_finished(set()) == (set(), set())
    assert worker.take_load_errors() == set()
    assert torch.equal(_layer_block(kv, drafter, 3), stored[drafter, 0])  # in place before the drafter
    worker.wait_for_layer_load(f"layer{drafter}")
    worker.wait_for_save()
    stats = worker.stats()
    assert stats["unwaited_layer_loads"] == 0 and stats["failed_load_blocks"] == 0
    assert stats["loaded_chunks"] == 1 and client.released == ["lease-r1"]


@pytest.mark.parametrize(
    "context",
    [("FULL", "metadata"), ("NONE", None)],
    ids=["v1-full-graph", "v2-loads-started-outside-the-forward"],
)
def test_loads_before_a_full_graph_replay_are_in_place_before_it_runs(
    arena_worker, context: tuple[str, Any]
) -> None:
    worker, client, kv, arena = arena_worker
    worker.copier.overlap_loads = True  # even where loads would overlap the forward layer by layer
    _forward(worker, range(LAYERS), _context("PIECEWISE"))
    worker.wait_for_save()
    slot, stored = _stored_slot(worker, arena, 0)
    _forward(worker, range(0), _context(*context), KVTierMetadata(loads=[_job("r1", slot, [3, 4])]))
    # No layer waited: the replay (CPU: what runs next) finds every layer in place.
    for layer in range(LAYERS):
        assert torch.equal(_layer_block(kv, layer, 3), stored[layer, 0])
        assert torch.equal(_layer_block(kv, layer, 4), stored[layer, 1])
    assert worker.take_load_errors() == set()
    worker.wait_for_save()
    stats = worker.stats()
    assert stats["full_graph_loads"] == 1 and stats["unwaited_layer_loads"] == 0
    assert stats["loaded_chunks"] == 1 and client.released == ["lease-r1"]


def test_which_forwards_wait_for_each_layer() -> None:
    from kvtier.connector.worker_jobs import layers_wait_in_forward

    assert layers_wait_in_forward(None)  # outside vLLM's model runner
    assert layers_wait_in_forward(_context("NONE"))
    assert layers_wait_in_forward(_context("PIECEWISE"))
    assert not layers_wait_in_forward(_context("FULL"))
    assert not layers_wait_in_forward(_context("NONE", attn_metadata=None))


def test_a_load_that_cannot_start_is_reported_exactly_and_no_request_saves_that_step(
    arena_worker,
) -> None:
    worker, client, _, arena = arena_worker
    good, _ = _stored_slot(worker, arena, 0)
    stale, _ = _stored_slot(worker, arena, 1)
    meta = KVTierMetadata(
        loads=[_job("r1", good, [3]), _job("r2", stale, [5, 6], instance="gone")],
        # r3 may have computed on r2's blocks: vLLM shares a CPU-tier (sync) load's blocks at once.
        saves=[SaveJob("r2", [b"x"], [[7, 8]]), SaveJob("r3", [b"y"], [[9, 10]])],
    )
    _start(worker, meta)
    for name in LAYER_NAMES:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    worker.copier.wait()
    assert worker.take_load_errors() == {5, 6}  # the other instance's slot; r1 loaded
    assert client.commits == [] and len(client.aborted) == 2  # nothing computed this step is stored
    assert sorted(client.released) == ["lease-r1", "lease-r2"]


def test_a_failed_layer_copy_fails_the_steps_loads_without_stalling_the_forward_or_later_fences(
    arena_worker, monkeypatch
) -> None:
    worker, client, _, arena = arena_worker
    slot, _ = _stored_slot(worker, arena, 0)
    real = worker.copier._load_cpu

    def broken(lo: int, hi: int, *args: Any) -> None:
        if lo == 1:
            raise MemoryError("simulated")
        real(lo, hi, *args)

    monkeypatch.setattr(worker.copier, "_load_cpu", broken)
    _start(worker, KVTierMetadata(loads=[_job("r1", slot, [3, 4])]))
    for name in LAYER_NAMES:
        worker.wait_for_layer_load(name)  # returns: the failure releases every waiter
    worker.wait_for_save()
    assert worker.take_load_errors() == {3, 4}
    assert client.released == ["lease-r1"]
    worker.copier.wait()  # the load's error belongs to the load, not to the next fence
    assert worker.stats()["unwaited_layer_loads"] == 0


@pytest.mark.parametrize("helper", [False, True], ids=["one-thread", "copy-thread"])
def test_copier_layer_loads_land_like_whole_chunk_loads(arena_worker, helper: bool) -> None:
    worker, _, kv, arena = arena_worker
    copier = worker.copier
    if not helper:
        copier._helper.close()
        copier._helper = None
    _, stored = _stored_slot(worker, arena, 0)
    loads = copier.load_layers([(stored, 1, [9])])
    for layer in range(LAYERS):
        loads.wait_layer(layer)
        assert torch.equal(_layer_block(kv, layer, 9), stored[layer, 1])
    assert loads.finish() is None and loads.ended is not None


def test_a_disk_read_that_cannot_open_stages_the_lease_instead(arena_worker, monkeypatch) -> None:
    worker, client, _, _ = arena_worker

    class Broken:
        def open(self, reads: Any) -> Any:
            raise RuntimeError("a bug in the reader")

        def close(self) -> None:
            pass

    staged: list[str] = []
    monkeypatch.setattr(worker, "_disk", Broken())
    monkeypatch.setattr(client, "stage", lambda lease: staged.append(lease) or done(None), raising=False)
    monkeypatch.setattr(faults, "caught", lambda exc, where: staged.append(where))
    job = LoadJob("r", "lease-1", [ChunkLoad(0, 0, [0, 1], key=b"k", tier=Tier.DISK)], is_async=True)
    worker.start_load(KVTierMetadata(loads=[job]))  # raises nothing into vLLM
    assert staged == ["opening disk files", "lease-1"]
    assert worker.counters.disk_read_fallbacks == 1
