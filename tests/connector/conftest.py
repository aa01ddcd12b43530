"""A WorkerSide over a real arena and KV tensors, with a service client that hands out arena slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.app.settings import KVTierSettings
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.planning import Geometry
from kvtier.connector.worker import WorkerSide
from kvtier.storage.arena import Arena
from kvtier.storage.base import NamespaceSpec
from tools.arena_client import ArenaClient

NUM_BLOCKS, BLOCK, CHUNK, LAYERS = 16, 4, 8, 3


@pytest.fixture
def arena_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(worker, client, KV tensors, arena): a worker with a copy thread, over a real arena."""
    monkeypatch.setattr("kvtier.connector.worker.engine_cpus", lambda: frozenset({0, 1}))
    kv = [torch.randn(NUM_BLOCKS, BLOCK, 2, 8).to(torch.bfloat16) for _ in range(LAYERS)]
    page = kv[0][0].numel() * 2
    spec = NamespaceSpec("m", "bfloat16", "NHD", BLOCK, CHUNK, LAYERS, page)
    cfg = ConnectorConfig(
        KVTierSettings(), Geometry(BLOCK, CHUNK), spec, "ns", "engine", NUM_BLOCKS,
        tuple(f"layer{i}" for i in range(LAYERS)), "recompute", False,
    )  # fmt: skip
    chunk_bytes = LAYERS * (CHUNK // BLOCK) * page
    arena = Arena.create(tmp_path, 8 * chunk_bytes, prefault=False)
    client = ArenaClient(arena, chunk_bytes)
    worker = WorkerSide(cfg, client)  # type: ignore[arg-type]
    worker.register_kv_caches({f"layer{i}": t for i, t in enumerate(kv)})
    yield worker, client, kv, arena
    worker.shutdown()
    arena.close()
