"""A step that computes nothing waits briefly for a stage's reply and reports the load in that same
get_finished (reading the reply in vLLM's thread); a step with a forward never waits on a stage,
nor does a step while a disk load, which advances only as it is polled, is in flight."""

from __future__ import annotations

import os
from typing import Any

import torch

from kvtier.app.client_call import Call
from kvtier.app.client_results import StageReply
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob
from kvtier.connector.worker import IDLE_WAIT_S
from kvtier.connector.worker_jobs import PendingLoad
from kvtier.storage.base import SlotRef, StageResult, Tier


class ArrivingStage(Call[StageReply]):
    """A pending stage whose reply arrives while someone waits on it (a timeout above 0); every
    wait's timeout recorded."""

    def __init__(self, reply: StageReply) -> None:
        super().__init__(None, 1, b"", (StageReply, lambda r: r))
        self.reply = reply
        self.waits: list[float | None] = []

    def result(self, timeout: float | None = None) -> StageReply:
        self.waits.append(timeout)
        if timeout and not self.done():
            self.set_result(self.reply)
        return super().result(timeout)


def _staged(worker: Any, arena: Any, client: Any, monkeypatch: Any) -> tuple[ArrivingStage, torch.Tensor]:
    """A slot of random rows, and the pending stage that will name it."""
    size = worker.copier.chunk_bytes
    slot = SlotRef(7 * size, size)
    arena.view(slot)[:] = os.urandom(size)
    stage = ArrivingStage(StageReply(StageResult([slot], [Tier.CPU], []), "inst-1"))
    monkeypatch.setattr(client, "stage", lambda lease: stage, raising=False)
    return stage, worker.copier.slot_view(arena.view(slot))


def _step(worker: Any, meta: KVTierMetadata) -> tuple[set[str], set[str]]:
    worker.bind(meta)
    worker.start_load(meta)
    worker.wait_for_save()
    result: tuple[set[str], set[str]] = worker.get_finished(set())
    return result


def test_an_idle_step_waits_for_the_stage_and_reports_the_load_in_the_same_call(
    arena_worker, monkeypatch
) -> None:
    worker, client, kv, arena = arena_worker
    stage, stored = _staged(worker, arena, client, monkeypatch)
    job = LoadJob("r", "lease-r", [ChunkLoad(0, 0, [3, 4], tier=Tier.OBJECT)], is_async=True)
    assert _step(worker, KVTierMetadata(loads=[job])) == (set(), set())  # a forward's step: no wait
    assert stage.waits == []
    assert _step(worker, KVTierMetadata(idle=True)) == (set(), {"r"})
    assert stage.waits == [IDLE_WAIT_S, 0]  # the wait, then _finish_async's read of the reply
    assert client.released == ["lease-r"]
    assert worker.stats()["loaded_chunks"] == 1
    for layer in range(len(kv)):
        assert torch.equal(kv[layer][3].view(torch.uint8).flatten(), stored[layer, 0])
        assert torch.equal(kv[layer][4].view(torch.uint8).flatten(), stored[layer, 1])
    assert _step(worker, KVTierMetadata(idle=True)) == (set(), set())  # nothing pending: no wait
    assert stage.waits == [IDLE_WAIT_S, 0]


def test_an_idle_step_does_not_wait_while_a_disk_load_needs_polling(arena_worker, monkeypatch) -> None:
    worker, client, _, arena = arena_worker
    stage, _ = _staged(worker, arena, client, monkeypatch)
    job = LoadJob("r", "lease-r", [ChunkLoad(0, 0, [3, 4], tier=Tier.OBJECT)], is_async=True)
    _step(worker, KVTierMetadata(loads=[job]))

    class PolledDisk:
        polls = 0

        def advance(self) -> bool:
            PolledDisk.polls += 1
            return False

    disk_job = LoadJob("d", "lease-d", [ChunkLoad(0, 0, [5], key=b"k", tier=Tier.DISK)], is_async=True)
    worker._async["d"] = PendingLoad(disk_job, None, 0.0, PolledDisk())  # type: ignore[arg-type]
    assert _step(worker, KVTierMetadata(idle=True)) == (set(), set())
    assert stage.waits == [] and PolledDisk.polls == 1  # no wait; the disk load polled at once
    del worker._async["d"]
