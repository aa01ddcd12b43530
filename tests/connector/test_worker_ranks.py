"""More than one rank, and the kv_role values: each rank's namespace, lease and slots, which ranks
store, and what a producer or consumer engine does (config rules and a worker over a real arena)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

from kvtier.app.settings import SettingsError
from kvtier.connector import config
from kvtier.connector.config import EVERY_TP_RANK, UnsupportedEngine, build_config
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from kvtier.connector.worker import WorkerSide
from kvtier.storage.base import SlotRef
from tests.connector.conftest import LAYERS

DENSE = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
MLA = dict(DENSE, num_kv_heads=1, head_size=576)


def _engine(spec: Any, tp: int = 1, pp: int = 1, role: str = "kv_both") -> tuple[Any, KVCacheConfig]:
    """A vLLM config reduced to what build_config reads, and a one-group KV cache config."""
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_size": 32}, engine_id="e1", kv_role=role
        ),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=SimpleNamespace(model="tiny", revision=None),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=None,
    )
    group = KVCacheGroupSpec(layer_names=["layer0", "layer1"], kv_cache_spec=spec)
    return vllm_config, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])


def _side(monkeypatch: pytest.MonkeyPatch, engine: Any, tp_rank: int | None) -> config.ConnectorConfig:
    """The config of the scheduler (tp_rank None) or of the worker of that tensor-parallel rank."""
    monkeypatch.setattr(config, "_tp_pp_rank", lambda is_worker: (tp_rank or 0, 0))
    return build_config(*engine, role_is_worker=tp_rank is not None)


def test_each_tensor_parallel_rank_stores_its_shard_under_its_own_namespace(monkeypatch) -> None:
    engine = _engine(FullAttentionSpec(**DENSE), tp=2)
    sched = _side(monkeypatch, engine, None)
    workers = [_side(monkeypatch, engine, rank) for rank in (0, 1)]
    assert [w.rank for w in workers] == [0, 1]
    assert [w.spec.tp_rank for w in workers] == [0, 1]
    # The scheduler looks up exactly the namespaces the workers store under, in rank order.
    assert sched.lookup_namespaces == tuple(w.namespace for w in workers)
    assert len(set(sched.lookup_namespaces)) == 2
    assert all(w.saves and w.loads for w in workers)


def test_mla_kv_is_stored_once_under_a_namespace_without_a_rank_and_loaded_on_every_rank(monkeypatch) -> None:
    engine = _engine(MLAAttentionSpec(**MLA), tp=2)
    sched = _side(monkeypatch, engine, None)
    workers = [_side(monkeypatch, engine, rank) for rank in (0, 1)]
    assert {w.spec.tp_rank for w in workers} == {EVERY_TP_RANK}
    assert workers[0].namespace == workers[1].namespace
    assert sched.lookup_namespaces == (workers[0].namespace,) * 2  # each rank loads under its own lease
    assert [w.saves for w in workers] == [True, False]  # one rank stores it
    # The engine's tensor-parallel size stays in the namespace: its numerics differ from TP=1's.
    single = _side(monkeypatch, _engine(MLAAttentionSpec(**MLA), tp=1), 0)
    assert single.namespace != workers[0].namespace


@pytest.mark.parametrize(
    ("role", "loads", "saves"),
    [("kv_both", True, True), ("kv_producer", False, True), ("kv_consumer", True, False)],
)
def test_kv_roles_decide_whether_an_engine_loads_and_saves(monkeypatch, role, loads, saves) -> None:
    for rank in (None, 0):
        cfg = _side(monkeypatch, _engine(FullAttentionSpec(**DENSE), role=role), rank)
        assert (cfg.loads, cfg.saves) == (loads, saves)


def test_any_other_kv_role_is_refused_naming_the_served_ones(monkeypatch) -> None:
    engine = _engine(FullAttentionSpec(**DENSE), role="kv_sender")
    with pytest.raises(
        SettingsError, match=r"kv_role is 'kv_sender'; kvtier serves kv_both .*kv_producer .*kv_consumer"
    ):
        _side(monkeypatch, engine, None)


def test_pipeline_parallel_engines_are_refused_naming_the_stage_count(monkeypatch) -> None:
    with pytest.raises(UnsupportedEngine, match=r"pipeline_parallel_size 1 .*this engine has 2"):
        _side(monkeypatch, _engine(FullAttentionSpec(**DENSE), pp=2), None)


# ------------------------------------------------------------------------------------ the worker
@pytest.fixture
def rank1(arena_worker):
    """(worker of rank 1, client, KV tensors, arena), beside the fixture's worker of rank 0."""
    worker0, client, kv, arena = arena_worker
    worker = WorkerSide(dataclasses.replace(worker0.cfg, rank=1), client)
    worker.register_kv_caches({f"layer{i}": t for i, t in enumerate(kv)})
    yield worker, client, kv, arena
    worker.shutdown()


def _filled(worker: Any, arena: Any, index: int) -> tuple[SlotRef, torch.Tensor]:
    size = worker.copier.chunk_bytes
    slot = SlotRef((7 - index) * size, size)
    arena.view(slot)[:] = os.urandom(size)
    return slot, worker.copier.slot_view(arena.view(slot))


def test_a_rank_loads_from_its_own_slot_and_ends_its_own_lease(rank1) -> None:
    worker, client, kv, arena = rank1
    slot0, _ = _filled(worker, arena, 0)
    slot1, stored1 = _filled(worker, arena, 1)
    chunk = ChunkLoad(0, 0, [3, 4], (slot0.offset, slot0.length), [(slot1.offset, slot1.length)])
    meta = KVTierMetadata(loads=[LoadJob("r1", "lease-r1", [chunk], False, "inst-1")])
    worker.bind(meta)
    worker.start_load(meta)
    for i in range(LAYERS):
        worker.wait_for_layer_load(f"layer{i}")
    assert worker.take_load_errors() == set()
    for layer in range(LAYERS):
        for row, block in enumerate((3, 4)):
            assert torch.equal(kv[layer][block].view(torch.uint8).flatten(), stored1[layer, row])
    assert client.released == ["lease-r1@1"]


def test_a_rank_without_its_slot_reports_exactly_its_blocks(rank1) -> None:
    worker, client, _, arena = rank1
    slot0, _ = _filled(worker, arena, 0)
    chunks = [ChunkLoad(0, 0, [3, 4], (slot0.offset, slot0.length), [None])]
    meta = KVTierMetadata(loads=[LoadJob("r1", "lease-r1", chunks, False, "inst-1")])
    worker.bind(meta)
    worker.start_load(meta)
    assert worker.take_load_errors() == {3, 4}
    assert client.released == ["lease-r1@1"]


def test_a_rank_that_does_not_save_reserves_nothing_and_still_lets_held_blocks_go(
    arena_worker,
) -> None:
    worker0, client, kv, _ = arena_worker
    worker = WorkerSide(dataclasses.replace(worker0.cfg, rank=1, saves=False), client)
    try:
        worker.register_kv_caches({f"layer{i}": t for i, t in enumerate(kv)})
        meta = KVTierMetadata(saves=[SaveJob("r1", [b"h0"], [[1, 2]])], held=["r1"])
        worker.bind(meta)
        worker.wait_for_save()
        assert worker.get_finished(set()) == ({"r1"}, set())
        assert client.commits == [] and client._next == 0
    finally:
        worker.shutdown()
