"""The worker-side checks of ``bench.gpu_check``: ``WorkerSide`` over vLLM's LBNHC views, driven as vLLM's
model runner drives it, with vLLM's metadata reduced to what the worker reads (``connector.metadata``)
and a stand-in client over a real arena (``bench.arena_client``). Runs on CUDA and on the CPU alike,
except the full-graph replay, which needs CUDA graphs.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from kvtier.app.settings import KVTierSettings
from kvtier.bench.arena_client import ArenaClient
from kvtier.bench.gpu_check_layouts import NUM_BLOCKS, Case, Skipped, expect, random_bytes
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from kvtier.connector.planning import Geometry
from kvtier.connector.worker import WorkerSide
from kvtier.storage.arena import Arena
from kvtier.storage.base import NamespaceSpec, SlotRef

BLOCK_SIZE, BLOCKS_PER_CHUNK = 16, 4
FULL_GRAPH = SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(name="FULL"), attn_metadata={})


@dataclass
class Rig:
    """A worker over random KV, its stand-in client and arena."""

    worker: WorkerSide
    client: ArenaClient
    arena: Arena
    views: list[torch.Tensor]

    def page(self, layer: int, block: int) -> bytes:
        """The bytes of one block of one layer, as the copier's planes hold them."""
        planes = self.worker.copier.layers[layer] if self.worker.copier else []
        return b"".join(bytes(p[block].cpu().numpy()) for p in planes)

    def slot_rows(self, slot: SlotRef) -> torch.Tensor:
        """The slot as [layer, block, page] bytes."""
        assert self.worker.copier is not None
        return self.worker.copier.slot_view(self.arena.view(slot))


@contextlib.contextmanager
def worker_rig(device: torch.device) -> Iterator[Rig]:
    """A registered worker over vLLM's default (LBNHC) views of random bytes on ``device``."""
    raw, views = Case(False, "LBNHC", block_size=BLOCK_SIZE).build(device)
    raw.view(torch.uint8).copy_(random_bytes(tuple(raw.shape), device, 7))
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(len(views)))
    page = sum(v[0].numel() * v.element_size() for v in views[:1])
    chunk = BLOCK_SIZE * BLOCKS_PER_CHUNK
    spec = NamespaceSpec("check", str(views[0].dtype), "LBNHC", BLOCK_SIZE, chunk, len(views), page)
    cfg = ConnectorConfig(
        KVTierSettings(), Geometry(BLOCK_SIZE, chunk), spec, "ns", "engine", NUM_BLOCKS, names, "recompute",
        False,
    )  # fmt: skip
    chunk_bytes = len(views) * BLOCKS_PER_CHUNK * page
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        arena = Arena.create(shm, 8 * chunk_bytes, prefault=False)
        client = ArenaClient(arena, chunk_bytes)
        worker = WorkerSide(cfg, client)  # type: ignore[arg-type]
        try:
            worker.register_kv_caches(dict(zip(names, views, strict=True)))
            expect(worker.ready, "the worker did not map the arena")
            yield Rig(worker, client, arena, views)
        finally:
            worker.shutdown()
            arena.close()


def _forward(rig: Rig, meta: KVTierMetadata, context: Any = None, wait: bool = True) -> None:
    """One step as vLLM's model runner drives it, up to the end of the forward."""
    rig.worker.bind(meta)
    rig.worker.handle_preemptions(meta)
    rig.worker.start_load(meta, context)
    if wait:
        for name in rig.worker.cfg.layer_names:
            rig.worker.wait_for_layer_load(name)


def _stored(rig: Rig, index: int) -> SlotRef:
    """A slot past those reserve hands out, holding random bytes."""
    assert rig.worker.copier is not None
    size = rig.worker.copier.chunk_bytes
    slot = SlotRef((7 - index) * size, size)
    rig.arena.view(slot)[:] = bytes(random_bytes((size,), torch.device("cpu"), 100 + index).numpy())
    return slot


def _load_job(req: str, slot: SlotRef, blocks: list[int], instance: str = "inst-1") -> LoadJob:
    chunk = ChunkLoad(0, 0, blocks, (slot.offset, slot.length))
    return LoadJob(req, f"lease-{req}", [chunk], False, instance)


def _expect_loaded(rig: Rig, slot: SlotRef, blocks: list[int]) -> None:
    rows = rig.slot_rows(slot)
    for layer in range(len(rig.views)):
        for row, block in enumerate(blocks):
            expect(rig.page(layer, block) == bytes(rows[layer, row].numpy()), f"layer {layer} block {block}")


def check_worker_save(device: torch.device) -> None:
    """A step's finished chunk is copied into its reserved slot and committed, byte for byte."""
    with worker_rig(device) as rig:
        blocks = [9, 8, 7, 6]
        _forward(rig, KVTierMetadata(saves=[SaveJob("r1", [b"h1"], [blocks])]))
        rig.worker.wait_for_save()
        assert rig.worker.copier is not None
        rig.worker.copier.wait()  # the save's copies and its commit end behind the step
        expect([h for h, _ in rig.client.commits] == [[b"h1"]], f"commits {rig.client.commits}")
        rows = rig.slot_rows(rig.client.commits[0][1][0])
        for layer in range(len(rig.views)):
            for row, block in enumerate(blocks):
                expect(rig.page(layer, block) == bytes(rows[layer, row].numpy()), f"layer {layer} row {row}")


def check_worker_load(device: torch.device) -> None:
    """A CPU-tier hit is in its blocks once each layer's wait returns; its lease ends after the step."""
    with worker_rig(device) as rig:
        slot = _stored(rig, 0)
        _forward(rig, KVTierMetadata(loads=[_load_job("r1", slot, [3, 4, 5])]))
        rig.worker.wait_for_save()
        expect(rig.worker.take_load_errors() == set(), "load errors reported")
        _expect_loaded(rig, slot, [3, 4, 5])
        expect(rig.client.released == ["lease-r1"], f"released {rig.client.released}")


def check_worker_failed_load(device: torch.device) -> None:
    """A hit whose slot is not in the mapped arena is reported as exactly its blocks."""
    with worker_rig(device) as rig:
        slot = _stored(rig, 0)
        _forward(rig, KVTierMetadata(loads=[_load_job("r1", slot, [3, 4], instance="gone")]))
        expect(rig.worker.take_load_errors() == {3, 4}, "the failed blocks were not reported exactly")
        rig.worker.wait_for_save()
        expect(rig.client.released == ["lease-r1"], f"released {rig.client.released}")


def check_worker_preemption_fence(device: torch.device) -> None:
    """Saves still copying when a request is preempted end before handle_preemptions returns."""
    with worker_rig(device) as rig:
        _forward(rig, KVTierMetadata(saves=[SaveJob("r1", [b"h1"], [[1, 2, 3, 4]])]))
        rig.worker.wait_for_save()  # deferred on CUDA and with a save thread
        rig.worker.handle_preemptions(KVTierMetadata(preempted=["r1"]))
        expect(len(rig.client.commits) == 1, "a save was still copying after the preemption fence")


def check_worker_full_graph_replay(device: torch.device) -> None:
    """A replayed full CUDA graph that reads loaded blocks, with no layer wait, reads the loaded bytes."""
    if device.type != "cuda":
        raise Skipped("CUDA graphs need CUDA")
    with worker_rig(device) as rig:
        blocks = [10, 11, 12, 13]
        assert rig.worker.copier is not None
        pages = [planes[0][blocks[0] : blocks[-1] + 1] for planes in rig.worker.copier.layers]
        out = [torch.empty(p.shape, dtype=torch.uint8, device=device) for p in pages]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # reads the blocks' bytes as attention would, in one replay
            for page, dst in zip(pages, out, strict=True):
                dst.copy_(page)
        slot = _stored(rig, 1)
        _forward(rig, KVTierMetadata(loads=[_load_job("r1", slot, blocks)]), FULL_GRAPH, wait=False)
        graph.replay()  # on the current stream, right after start_load_kv, as vLLM replays it
        torch.cuda.synchronize(device)
        rig.worker.wait_for_save()
        expect(rig.worker.take_load_errors() == set(), "load errors reported")
        rows = rig.slot_rows(slot)
        for layer, dst in enumerate(out):
            got = dst.cpu()
            expect(torch.equal(got, rows[layer, : len(blocks)]), f"layer {layer}: the replay read stale KV")


def worker_checks() -> list[tuple[str, Callable[[torch.device], None]]]:
    """The worker-side checks, by name, in the order they run."""
    return [
        ("worker_save", check_worker_save),
        ("worker_load", check_worker_load),
        ("worker_failed_load", check_worker_failed_load),
        ("worker_preemption_fence", check_worker_preemption_fence),
        ("worker_full_graph_replay", check_worker_full_graph_replay),
    ]
