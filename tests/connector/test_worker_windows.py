"""A hybrid engine's worker: chunks of every KV cache group, loads that fail whole, and saves still
reading sliding-window blocks fenced before vLLM writes those blocks again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.app.client_results import StageReply
from kvtier.app.settings import KVTierSettings
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.group_copy import GroupedCopier
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from kvtier.connector.planning import Geometry
from kvtier.connector.worker import WorkerSide
from kvtier.storage.arena import Arena
from kvtier.storage.base import NamespaceSpec, StageResult, Tier
from tools.arena_client import ArenaClient, done

NUM_BLOCKS, BLOCK, CHUNK = 16, 4, 8  # 2 blocks a chunk
# Group 0: a sliding window (one layer); group 1: full attention (one layer).
LAYERS = ("swa0", "full0")


@pytest.fixture
def hybrid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(worker, client, KV tensors by layer, arena): a hybrid worker with save threads over a real arena."""
    monkeypatch.setattr("kvtier.connector.worker.engine_cpus", lambda: frozenset({0, 1}))
    kv = {name: torch.randn(NUM_BLOCKS, BLOCK, 2, 8).to(torch.bfloat16) for name in LAYERS}
    page = kv["swa0"][0].numel() * 2
    spec = NamespaceSpec("m", "bfloat16", "NHD/groups", BLOCK, CHUNK, len(LAYERS), page)
    cfg = ConnectorConfig(
        KVTierSettings(), Geometry(BLOCK, CHUNK), spec, "ns", "engine", NUM_BLOCKS, LAYERS, "recompute",
        False, group_sizes=(1, 1), group_reach=(7, None),
    )  # fmt: skip
    chunk_bytes = len(LAYERS) * (CHUNK // BLOCK) * page
    arena = Arena.create(tmp_path, 8 * chunk_bytes, prefault=False)
    client = ArenaClient(arena, chunk_bytes)
    worker = WorkerSide(cfg, client)  # type: ignore[arg-type]
    worker.register_kv_caches(kv)
    yield worker, client, kv, arena
    worker.shutdown()
    arena.close()


def _rows(kv: dict[str, torch.Tensor], layer: str, ids: list[int]) -> bytes:
    return b"".join(kv[layer][b].view(torch.uint8).numpy().tobytes() for b in ids)


def test_a_hybrid_chunk_holds_each_groups_blocks_and_loads_back_into_the_window(hybrid) -> None:
    worker, client, kv, arena = hybrid
    assert isinstance(worker.copier, GroupedCopier)
    # The windowed group's first place repeats its held block (see planning.group_save_ids).
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[3, 3]], groups=[[[4, 5]]])]))
    worker.wait_for_save()
    worker.copier.wait()
    ((hashes, slots),) = client.commits
    assert hashes == [b"a"]
    assert bytes(arena.view(slots[0])) == _rows(kv, "swa0", [3, 3]) + _rows(kv, "full0", [4, 5])
    # A later request: the window's group gets one block (the other is outside it), full attention two.
    _stage_answers(client, {"lease": StageResult([slots[0]], [Tier.CPU], [])})
    job = LoadJob("r2", "lease", [ChunkLoad(0, 1, [9], tier=0, groups=[(0, [10, 11])])], is_async=True)
    _load(worker, job)
    assert worker.take_failed_loads() == set() and client.released == ["lease"]
    assert worker.stats()["loaded_tokens"] == 2 * BLOCK  # the full-attention group's two blocks
    assert _rows(kv, "swa0", [9]) == _rows(kv, "swa0", [3])
    assert _rows(kv, "full0", [10, 11]) == _rows(kv, "full0", [4, 5])


def _stage_answers(client: ArenaClient, results: dict[str, StageResult]) -> None:
    """The stand-in client answers a stage of each lease at once (an unknown lease stages nothing)."""
    client.stage = lambda lease: done(StageReply(results.get(lease, StageResult([], [], [])), "inst-1"))  # type: ignore[attr-defined]


def _load(worker: WorkerSide, job: LoadJob) -> None:
    """One step that starts the async load; the next get_finished reports it."""
    meta = KVTierMetadata(loads=[job])
    worker.bind(meta)
    worker.start_load(meta)
    worker.wait_for_save()
    assert worker.get_finished(set()) == (set(), {job.req_id})


def test_a_failed_load_of_a_hybrid_engine_fails_its_request_not_blocks(hybrid) -> None:
    worker, client, _, _ = hybrid
    _stage_answers(client, {})
    chunks = [ChunkLoad(i, 0, [9 + i], tier=1, groups=[(0, [11 + 2 * i, 12 + 2 * i])]) for i in range(2)]
    _load(worker, LoadJob("r3", "gone", chunks, is_async=True))
    assert worker.take_failed_loads() == {"r3"} and worker.take_load_errors() == set()
    stats = worker.stats()
    assert (stats["failed_load_chunks"], stats["loaded_chunks"]) == (2, 0)


@pytest.fixture
def gated(hybrid, monkeypatch):
    """hybrid, with the windowed group's save copies waiting for the returned event; its worker's
    fences recorded (a fence opens the gate first, as the copies it waits for would end)."""
    worker, client, _kv, _ = hybrid
    group0 = worker.copier.copiers[0]
    gate = threading.Event()
    real_save, real_fence = group0._save_cpu, worker._fence
    fences: list[int] = []

    def held_back(*args: Any) -> None:
        assert gate.wait(10), "the test never opened the gate"
        real_save(*args)

    def fence() -> bool:
        fences.append(len(client.commits))  # commits made before the fence waited
        gate.set()
        return real_fence()

    monkeypatch.setattr(group0, "_save_cpu", held_back)
    monkeypatch.setattr(worker, "_fence", fence)
    yield worker, client, gate, fences
    gate.set()


def test_a_save_reading_a_window_block_vllm_hands_out_again_is_fenced_first(gated) -> None:
    worker, client, _gate, fences = gated
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[3, 3]], groups=[[[4, 5]]])]))
    worker.wait_for_save()  # the windowed group's copy waits at the gate
    # Blocks of the full-attention group and fresh ones: no save reads them, nothing waits.
    worker.handle_preemptions(KVTierMetadata(allocated=[4, 5, 8]))
    assert fences == [] and client.commits == []
    # Block 3, the window's, handed out again (to a forward, or to a load): the save ends first.
    worker.handle_preemptions(KVTierMetadata(allocated=[8, 3]))
    assert fences == [0] and [h for h, _ in client.commits] == [[b"a"]]
    assert worker.stats()["window_fences"] == 1
    worker.handle_preemptions(KVTierMetadata(allocated=[3]))  # nothing in flight reads it any more
    assert fences == [0]


def test_a_load_into_a_window_block_a_save_still_reads_is_fenced_first(gated) -> None:
    worker, client, _gate, fences = gated
    worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[3, 3]], groups=[[[4, 5]]])]))
    worker.wait_for_save()
    load = LoadJob("r2", "lease", [ChunkLoad(0, 0, [7, 9], tier=1, groups=[(0, [3, 6])])], is_async=True)
    worker.handle_preemptions(KVTierMetadata(loads=[load]))
    assert fences == [0] and [h for h, _ in client.commits] == [[b"a"]]
