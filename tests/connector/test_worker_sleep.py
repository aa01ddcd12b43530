"""vLLM's sleep mode (vLLM 0.33's unregister_kv_caches / restore_kv_caches): the worker ends every copy
of the KV cache before it lets go of it, fails the async loads still pending (reported, so vLLM
recomputes them), gives up its copier and arena, and serves again once the KV cache is restored."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import torch

from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from kvtier.storage.base import Tier
from tests.connector.conftest import LAYERS
from tests.connector.test_worker_loads import _job, _layer_block, _stored_slot


def _asleep_with_a_save_and_a_stage_in_flight(worker: Any, client: Any, monkeypatch: Any) -> list[str]:
    """A step whose save copy is held back and whose disk hit is being staged, then sleep mode (on a
    thread, the save released meanwhile); what ended, in order."""
    copier = worker.copier
    gate = threading.Event()
    order: list[str] = []  # list.append is atomic
    real = copier._save_cpu

    def held_back(*args: Any) -> None:
        assert gate.wait(10), "the test never opened the gate"
        real(*args)
        order.append("save copied")

    monkeypatch.setattr(copier, "_save_cpu", held_back)
    monkeypatch.setattr(client, "stage", lambda lease: Future(), raising=False)  # never answers
    staged = LoadJob("r2", "lease-r2", [ChunkLoad(0, 0, [6, 7], key=b"k", tier=Tier.DISK)], is_async=True)
    meta = KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])], loads=[staged])
    worker.bind(meta)
    worker.start_load(meta)
    worker.wait_for_save()  # the save is deferred to the save thread, held at the gate
    sleeper = threading.Thread(target=lambda: (worker.unregister_kv_caches(), order.append("unregistered")))
    sleeper.start()
    gate.set()
    sleeper.join(10)
    assert not sleeper.is_alive(), "unregister_kv_caches never returned"
    return order


def test_sleep_ends_copies_fails_pending_loads_and_lets_go_of_copier_and_arena(
    arena_worker, monkeypatch
) -> None:
    worker, client, _, _ = arena_worker
    order = _asleep_with_a_save_and_a_stage_in_flight(worker, client, monkeypatch)
    assert order == ["save copied", "unregistered"]
    assert [hashes for hashes, _ in client.commits] == [[b"a"]]  # the save ended and was committed
    assert worker.copier is None and not worker.ready and worker._arena.mapping is None
    assert worker.take_load_errors() == {6, 7}  # the staged load failed: vLLM recomputes it
    assert worker.get_finished(set()) == (set(), {"r2"}) and client.released == ["lease-r2"]
    stats = worker.stats()
    assert stats["failed_load_chunks"] == 1 and stats["failed_load_blocks"] == 2


def test_a_step_while_asleep_touches_nothing_and_restore_serves_the_same_kv_again(
    arena_worker, monkeypatch
) -> None:
    worker, client, kv, arena = arena_worker
    asleep_slot, _ = _stored_slot(worker, arena, 0)
    worker.unregister_kv_caches()
    before = [t.clone() for t in kv]
    meta = KVTierMetadata(loads=[_job("r1", asleep_slot, [3])])
    worker.bind(meta)
    worker.start_load(meta)
    worker.wait_for_save()
    assert worker.take_load_errors() == {3} and all(
        torch.equal(a, b) for a, b in zip(kv, before, strict=True)
    )

    worker.restore_kv_caches()  # vLLM 0.33 may hand no tensors: the registered ones are back
    assert worker.ready and len(client.specs) == 2  # the arena was asked for again
    slot, stored = _stored_slot(worker, arena, 1)
    meta = KVTierMetadata(loads=[_job("r2", slot, [9, 4])])
    worker.bind(meta)
    worker.start_load(meta)
    for layer in range(LAYERS):
        worker.wait_for_layer_load(f"layer{layer}")
    worker.wait_for_save()
    assert worker.take_load_errors() == set()
    for layer in range(LAYERS):
        assert torch.equal(_layer_block(kv, layer, 9), stored[layer, 0])
        assert torch.equal(_layer_block(kv, layer, 4), stored[layer, 1])
