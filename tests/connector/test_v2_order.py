"""The connector driven in vLLM's V2 model runner's order (its GPU default), drafter included.

vLLM's own ``ActiveKVConnector`` (``vllm/v1/worker/gpu/kv_connector.py``) calls the connector's hooks;
a fake runner calls it as ``gpu/model_runner.py`` does: ``pre_forward`` (handle_preemptions, bind,
start_load_kv) inside the forward context, or outside any before a FULL graph replay; the target's
layer waits; ``finish_forward``; then, in ``sample_tokens``, the EAGLE/MTP drafter, whose layers wait
only where its forward is not a FULL graph; then ``post_forward`` (wait_for_save, the transfer
results, the load errors, the stats). The V1 order is driven in test_worker_loads.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

from kvtier.connector import connector as connector_module
from kvtier.connector.connector import KVTierConnector
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob
from kvtier.storage.arena import Arena
from kvtier.storage.base import SlotRef
from tests.connector.vllm_kv import kv_cache_config, views_of
from tools.arena_client import ArenaClient

BLOCK, CHUNK, NUM_BLOCKS = 16, 32, 16
TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
DRAFTER = ["model.layers.2.self_attn.attn"]  # EAGLE's layer, numbered after the target's
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)


def _vllm_config() -> Any:
    """A vLLM config reduced to what the connector and set_forward_context read."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_size": CHUNK},
            engine_id="e1",
            kv_load_failure_policy="recompute",
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
            use_sequence_parallel_moe=False, is_moe_model=False,
        ),
        model_config=SimpleNamespace(model="tiny", revision=None),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=SimpleNamespace(num_speculative_tokens=1),
        compilation_config=SimpleNamespace(fast_moe_cold_start=False, static_forward_context={}),
    )  # fmt: skip


class _Client(ArenaClient):
    """The arena stand-in as the connector's own client, which the connector closes at shutdown."""

    def close(self) -> None:
        self.connected = False


class V2Runner:
    """The connector's part of vLLM's V2 execute_model and sample_tokens, one step per call."""

    def __init__(self, kv: ActiveKVConnector, vllm_config: Any) -> None:
        self.kv, self.vllm_config = kv, vllm_config
        self.connector = kv.kv_connector

    def _waits(self, layers: list[str], mode: str) -> None:
        """A forward over ``layers``: each attention layer waits for its loads, unless a FULL graph."""
        if mode == "FULL":
            return
        with set_forward_context(
            {"attn": "metadata"}, self.vllm_config, cudagraph_runtime_mode=CUDAGraphMode[mode]
        ):
            for name in layers:
                self.connector.wait_for_layer_load(name)

    def step(
        self,
        meta: KVTierMetadata,
        target: str,
        drafter: str,
        drafter_reads: Callable[[], None] = lambda: None,
    ) -> KVConnectorOutput:
        """One step: the target's forward in ``target`` mode, the drafter's in ``drafter`` mode
        (``drafter_reads`` runs where its forward reads the KV)."""
        output = SimpleNamespace(
            kv_connector_metadata=meta, finished_req_ids=set(),
            has_sync_kv_loads=any(not job.is_async for job in meta.loads),
        )  # fmt: skip
        batch = SimpleNamespace(idx_mapping=None, req_ids=["r"], num_tokens=1)
        if target == "FULL":  # the replay's pre_forward runs outside any forward context
            self.kv.pre_forward(output, batch, attn_metadata={"attn": "metadata"})
        else:
            mode = CUDAGraphMode[target]
            with set_forward_context({"attn": "metadata"}, self.vllm_config, cudagraph_runtime_mode=mode):
                self.kv.pre_forward(output, batch)
                for name in TARGET:
                    self.connector.wait_for_layer_load(name)
        self.kv.finish_forward()
        self._waits(DRAFTER, drafter)  # sample_tokens: the drafter proposes
        drafter_reads()
        result = self.kv.post_forward(set())
        assert result is not None
        return result


@pytest.fixture
def v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[V2Runner, Any, list[torch.Tensor]]]:
    """(runner, arena, KV views): a worker-role KVTierConnector over an arena stand-in, registered by
    vLLM's ActiveKVConnector, with a copy thread that overlaps loads with the forward."""
    names = TARGET + DRAFTER
    config = kv_cache_config(names, SPEC, KVCacheLayout.LBNHC, NUM_BLOCKS)
    _, views = views_of(config, SPEC, KVCacheLayout.LBNHC)
    chunk_bytes = len(names) * (CHUNK // BLOCK) * SPEC.page_size_bytes
    arena = Arena.create(tmp_path, 4 * chunk_bytes, prefault=False)
    monkeypatch.setattr(connector_module, "_connect", lambda cfg, respawns: _Client(arena, chunk_bytes))
    monkeypatch.setattr("kvtier.connector.worker.engine_cpus", lambda: frozenset({0, 1}))
    vllm_config = _vllm_config()
    conn = KVTierConnector(vllm_config, KVConnectorRole.WORKER, config)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", conn)
    kv = ActiveKVConnector(vllm_config, dict(zip(names, views, strict=True)))  # registers the KV caches
    assert conn._worker is not None and conn._worker.copier is not None
    conn._worker.copier.overlap_loads = True  # the target's layers overlap the loads of later ones
    yield V2Runner(kv, vllm_config), arena, views
    conn.shutdown()
    arena.close()


def _stored(arena: Any, views: list[torch.Tensor]) -> tuple[SlotRef, list[bytes]]:
    """A chunk of random bytes in the arena's last slot, and each layer's two pages in it."""
    gen = torch.Generator().manual_seed(7)
    page = SPEC.page_size_bytes
    size = len(views) * 2 * page
    slot = SlotRef(3 * size, size)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    arena.view(slot)[:] = data
    return slot, [data[i * 2 * page : (i + 1) * 2 * page] for i in range(len(views))]


def _pages(view: torch.Tensor, blocks: list[int]) -> bytes:
    return b"".join(view[b].permute(1, 0, 2).contiguous().view(torch.uint8).numpy().tobytes() for b in blocks)


def _load(slot: SlotRef) -> KVTierMetadata:
    chunk = ChunkLoad(0, 0, [5, 9], (slot.offset, slot.length))
    return KVTierMetadata(loads=[LoadJob("r1", "lease-r1", [chunk], False, "inst-1")])


@pytest.mark.parametrize("target", ["PIECEWISE", "NONE", "FULL"])
@pytest.mark.parametrize("history", [True, False], ids=["after-a-piecewise-drafter", "first-step"])
def test_a_full_graph_drafter_reads_loaded_kv_and_fails_no_load(v2, target: str, history: bool) -> None:
    runner, arena, views = v2
    if history:  # a step whose drafter's forward waited for its layer (PIECEWISE)
        out = runner.step(KVTierMetadata(), "PIECEWISE", "PIECEWISE")
        assert not out.invalid_block_ids
    slot, pages = _stored(arena, views)
    drafter = len(TARGET)
    seen: list[bytes] = []
    out = runner.step(_load(slot), target, "FULL", lambda: seen.append(_pages(views[drafter], [5, 9])))
    assert seen == [pages[drafter]]  # the drafter's replay found its layer's load in place
    assert all(_pages(view, [5, 9]) == pages[i] for i, view in enumerate(views))
    assert not out.invalid_block_ids
    stats = out.kv_connector_stats.data
    assert stats["loaded_chunks"] == 1 and stats["unwaited_layer_loads"] == 0
    assert stats["failed_load_blocks"] == 0


def test_a_target_forward_that_skips_a_layer_still_fails_its_loads_in_v2_order(v2) -> None:
    runner, arena, views = v2
    runner.step(KVTierMetadata(), "PIECEWISE", "PIECEWISE")
    slot, _ = _stored(arena, views)
    connector = runner.connector
    real = connector.wait_for_layer_load
    connector.wait_for_layer_load = lambda name: None if name == TARGET[1] else real(name)
    out = runner.step(_load(slot), "PIECEWISE", "PIECEWISE")
    assert out.invalid_block_ids == {5, 9}
    assert out.kv_connector_stats.data["unwaited_layer_loads"] == 1
