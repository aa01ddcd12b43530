"""A WorkerSide over a real arena and KV tensors, with a service client that hands out arena slots."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.app.client import HelloReply, ReserveReply
from kvtier.app.settings import KVTierSettings
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.planning import Geometry
from kvtier.connector.worker import WorkerSide
from kvtier.storage.arena import Arena
from kvtier.storage.base import NamespaceSpec, SlotRef

NUM_BLOCKS, BLOCK, CHUNK, LAYERS = 16, 4, 8, 3


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class _Client:
    """Just enough of ServiceClient for a worker: reserve hands out arena slots, the rest is recorded."""

    def __init__(self, arena: Arena, chunk_bytes: int) -> None:
        self.arena, self.chunk_bytes = arena, chunk_bytes
        self.connected, self.instance_id = True, "inst-1"
        self.commits: list[tuple[list[bytes], list[SlotRef]]] = []
        self.aborted: list[SlotRef] = []
        self.released: list[str] = []
        self._next = 0

    def hello(self, spec: NamespaceSpec) -> Future[HelloReply]:
        return _done(HelloReply(self.instance_id, self.arena.info(), "ns", self.chunk_bytes))

    def reserve(self, namespace: str, hashes: list[bytes]) -> Future[ReserveReply]:
        slots = []
        for _ in hashes:
            slots.append(SlotRef(self._next, self.chunk_bytes))
            self._next += self.chunk_bytes
        return _done(ReserveReply(slots, self.instance_id))

    def commit(
        self, namespace: str, hashes: list[bytes], slots: list[SlotRef], instance: str
    ) -> Future[None]:
        self.commits.append((list(hashes), list(slots)))
        return _done(None)

    def abort(self, slots: list[SlotRef], instance: str) -> None:
        self.aborted.extend(slots)

    def release_nowait(self, lease_id: str) -> None:
        self.released.append(lease_id)


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
    client = _Client(arena, chunk_bytes)
    worker = WorkerSide(cfg, client)  # type: ignore[arg-type]
    worker.register_kv_caches({f"layer{i}": t for i, t in enumerate(kv)})
    yield worker, client, kv, arena
    worker.shutdown()
    arena.close()
