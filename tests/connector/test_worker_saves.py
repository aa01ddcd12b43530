"""Worker saves against a real arena: what it commits, that a failed copy commits nothing, and that
saves copied after wait_for_save returns never outlive the blocks they read."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvtier.connector.metadata import KVTierMetadata, KVTierWorkerMeta, SaveJob
from kvtier.connector.worker import WorkerSide


def _step(worker: WorkerSide, saves: list[SaveJob]) -> None:
    worker.bind(KVTierMetadata(saves=saves))
    worker.wait_for_save()
    assert worker.copier is not None
    worker.copier.wait()  # the fence: deferred saves have ended and been committed


@pytest.fixture
def gated(arena_worker, monkeypatch):
    """arena_worker, with every save copy waiting for the returned event before it starts."""
    worker, client, _, _ = arena_worker
    copier = worker.copier
    assert copier is not None and copier.defers_saves
    gate = threading.Event()
    real = copier._save_cpu

    def held_back(lo: int, hi: int, slot: Any, rows: Any, first: int) -> None:
        assert gate.wait(10), "the test never opened the gate"
        real(lo, hi, slot, rows, first)

    monkeypatch.setattr(copier, "_save_cpu", held_back)
    yield worker, client, gate
    gate.set()  # never leave the save thread stuck for shutdown


def test_saved_chunks_are_committed_with_their_blocks_bytes(arena_worker) -> None:
    worker, client, kv, arena = arena_worker
    jobs = [SaveJob("r1", [b"a", b"b", b"c"], [[0, 1], [4, 5], [9, 2]])]
    _step(worker, jobs)
    assert [h for h, _ in client.commits] == [[b"a", b"b", b"c"]]
    slot = client.commits[0][1][2]  # chunk c: blocks 9 then 2, layer by layer
    got = bytes(arena.view(slot))
    want = b"".join(t[b].view(torch.uint8).numpy().tobytes() for t in kv for b in (9, 2))
    assert got == want and not client.aborted


def test_a_failed_copy_commits_nothing_of_that_save_and_gives_its_slots_back(
    arena_worker, monkeypatch
) -> None:
    worker, client, _, _ = arena_worker
    copier = worker.copier
    assert copier is not None and copier.defers_saves  # the whole step's saves go to the save thread
    real = copier._save_cpu

    def broken(lo: int, hi: int, slot: Any, rows: Any, first: int) -> None:
        if rows.runs[0][2].start == 4:  # the second chunk's copy fails (its blocks start at 4)
            raise MemoryError("simulated")
        real(lo, hi, slot, rows, first)

    monkeypatch.setattr(copier, "_save_cpu", broken)
    _step(worker, [SaveJob("r1", [b"a", b"b"], [[0, 1], [4, 5]])])
    assert client.commits == []
    assert len(client.aborted) == 2
    _step(worker, [SaveJob("r2", [b"d"], [[6, 7]])])  # the next step saves as usual
    assert [h for h, _ in client.commits] == [[b"d"]]


def test_wait_for_save_returns_before_the_copy_and_commits_after_it(gated) -> None:
    worker, client, gate = gated
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])]))
    worker.wait_for_save()  # returns while the copy waits at the gate
    assert client.commits == [] and worker.stats()["saved_chunks"] == 0
    gate.set()
    worker.copier.wait()
    assert [h for h, _ in client.commits] == [[b"a"]]
    assert worker.stats()["saved_chunks"] == 1


def test_a_held_request_is_reported_only_after_its_saves_end(gated) -> None:
    worker, _, gate = gated
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])], held=["r1"]))
    worker.wait_for_save()
    assert worker.get_finished(set()) == (set(), set())  # its blocks may still be read
    worker.bind(KVTierMetadata())
    worker.wait_for_save()
    assert worker.get_finished(set()) == (set(), set())
    gate.set()
    worker.copier.wait()
    assert worker.get_finished(set()) == ({"r1"}, set())
    assert worker.get_finished(set()) == (set(), set())  # reported once


def test_held_requests_wait_for_the_saves_of_their_own_step_even_when_asked_first(gated) -> None:
    # vLLM may ask get_finished before wait_for_save (defer_finalize); the final saves of a held
    # request are in the same step's metadata and are only issued by wait_for_save.
    worker, _, gate = gated
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])], held=["r1"]))
    assert worker.get_finished(set()) == (set(), set())
    worker.wait_for_save()
    gate.set()
    worker.copier.wait()
    assert worker.get_finished(set()) == ({"r1"}, set())


def test_a_held_request_without_saves_in_flight_goes_at_once(arena_worker) -> None:
    worker, _, _, _ = arena_worker
    worker.bind(KVTierMetadata(held=["r1"]))
    worker.wait_for_save()
    assert worker.get_finished(set()) == ({"r1"}, set())


def test_the_scheduler_side_learns_the_step_through_which_saves_have_ended(gated) -> None:
    worker, _, gate = gated
    worker.bind(KVTierMetadata(step=1))
    worker.wait_for_save()
    assert worker.worker_meta() == KVTierWorkerMeta(1)  # nothing to save: step 1 is through
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])], step=2))
    worker.wait_for_save()
    worker.bind(KVTierMetadata(step=3))
    worker.wait_for_save()
    assert worker.worker_meta() == KVTierWorkerMeta(1)  # step 2's copy waits at the gate
    gate.set()
    worker.copier.wait()
    assert worker.worker_meta() == KVTierWorkerMeta(3)


def test_preemption_fences_deferred_saves(gated) -> None:
    worker, client, gate = gated
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])]))
    worker.wait_for_save()
    commits_when_fenced: list[int] = []

    def preempt() -> None:
        worker.handle_preemptions(KVTierMetadata(preempted=["r1"]))
        commits_when_fenced.append(len(client.commits))

    thread = threading.Thread(target=preempt)
    thread.start()
    assert client.commits == []  # the save still waits at the gate: the fence cannot have ended
    gate.set()
    thread.join(10)
    assert not thread.is_alive(), "the fence never returned"
    # The fence returned only once the copy had ended and been committed.
    assert commits_when_fenced == [1] and [h for h, _ in client.commits] == [[b"a"]]


def test_a_save_the_save_thread_refuses_gives_its_slots_back_without_raising(arena_worker) -> None:
    worker, client, _, _ = arena_worker
    assert worker.copier is not None and worker.copier._saver is not None
    worker.copier._saver.close()  # as after shutdown: submit() raises CopyError
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])], held=["r1"]))
    worker.wait_for_save()
    assert client.commits == [] and len(client.aborted) == 1
    assert worker.stats()["save_errors"] == 1
    assert worker.get_finished(set()) == ({"r1"}, set())  # nothing reads its blocks


def test_a_new_generation_commits_earlier_saves_in_the_old_namespace_and_registers_the_new(
    arena_worker,
) -> None:
    worker, client, _, _ = arena_worker
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[0, 1]])]))
    worker.wait_for_save()  # its copy may still run: the generation change fences it first
    worker.bind(KVTierMetadata(saves=[SaveJob("r2", [b"b"], [[2, 3]])], generation="g1"))
    worker.wait_for_save()
    assert worker.copier is not None
    worker.copier.wait()
    new = worker.cfg.namespace
    assert worker.cfg.spec.model == "m~gen:g1" and new != "ns"
    assert client.specs[-1] == worker.cfg.spec
    assert client.namespaces == [("reserve", "ns"), ("commit", "ns"), ("reserve", new), ("commit", new)]
