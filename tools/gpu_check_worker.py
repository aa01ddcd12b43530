"""The worker-side checks of ``tools.gpu_check``: ``WorkerSide`` over vLLM's LBNHC views, driven as vLLM's
model runner drives it, with vLLM's metadata reduced to what the worker reads (``connector.metadata``)
and a stand-in client over a real arena (``tools.arena_client``). Runs on CUDA and on the CPU alike,
except the full-graph replay, which needs CUDA graphs.
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvtier.app.client import HelloReply
from kvtier.app.settings import KVTierSettings
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.copy import BlockCopier
from kvtier.connector.group_copy import GroupedCopier, build_copier
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from kvtier.connector.pinning import pin_host_buffer, unpin_host_buffer
from kvtier.connector.planning import Geometry
from kvtier.connector.worker import WorkerSide
from kvtier.connector.worker_arena import WorkerArena
from kvtier.storage.arena import Arena
from kvtier.storage.base import NamespaceSpec, SlotRef
from tools.arena_client import ArenaClient
from tools.gpu_check_layouts import NUM_BLOCKS, Case, CheckFailed, Skipped, expect, random_bytes

BLOCK_SIZE, BLOCKS_PER_CHUNK = 16, 4
FULL_GRAPH = SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(name="FULL"), attn_metadata={})


@dataclass
class Rig:
    """A worker over random KV, its stand-in client and arena."""

    worker: WorkerSide
    client: ArenaClient
    arena: Arena
    views: list[torch.Tensor]

    @property
    def copier(self) -> BlockCopier:
        """The worker's copier: one KV cache group's, as the rig registers one."""
        copier = self.worker.copier
        if not isinstance(copier, BlockCopier):
            raise CheckFailed(f"the rig's worker has no one-group copier: {type(copier).__name__}")
        return copier

    def page(self, layer: int, block: int) -> bytes:
        """The bytes of one block of one layer, as the copier's planes hold them."""
        return b"".join(bytes(p[block].cpu().numpy()) for p in self.copier.layers[layer])

    def slot_rows(self, slot: SlotRef) -> torch.Tensor:
        """The slot as [layer, block, page] bytes."""
        return self.copier.slot_view(self.arena.view(slot))


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
        KVTierSettings.model_validate({}), Geometry(BLOCK_SIZE, chunk), spec, "ns", "engine", NUM_BLOCKS,
        names, "recompute", False,
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
        pages = [planes[0][blocks[0] : blocks[-1] + 1] for planes in rig.copier.layers]
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


def _v2_step(rig: Rig, meta: KVTierMetadata, drafter_waits: bool, drafter_reads: Callable[[], Any]) -> Any:
    """One step in vLLM's V2 model runner's order: handle_preemptions and bind, start_load_kv, the
    target's layer waits, finish_forward, the drafter (the last layer; a FULL graph waits for none),
    then wait_for_save and the reports. What ``drafter_reads`` returned."""
    worker, names = rig.worker, rig.worker.cfg.layer_names
    worker.handle_preemptions(meta)
    worker.bind(meta)
    worker.start_load(meta, None)
    for name in names[:-1]:
        worker.wait_for_layer_load(name)
    worker.finish_forward()
    if drafter_waits:
        worker.wait_for_layer_load(names[-1])
    read = drafter_reads()  # on the current (compute) stream
    worker.wait_for_save()
    worker.get_finished(set())
    expect(worker.take_load_errors() == set(), "load errors reported")
    return read


def check_worker_v2_drafter(device: torch.device) -> None:
    """V2's order with an EAGLE/MTP drafter: after a step whose drafter waited for its layer, a
    FULL-graph drafter that waits for none reads its layer's loaded bytes, and no load fails."""
    with worker_rig(device) as rig:
        _v2_step(rig, KVTierMetadata(), True, lambda: None)
        blocks, drafter = [10, 11, 12, 13], len(rig.views) - 1
        plane = rig.copier.layers[drafter][0]
        slot = _stored(rig, 1)
        meta = KVTierMetadata(loads=[_load_job("r1", slot, blocks)])
        read = _v2_step(rig, meta, False, lambda: plane[blocks[0] : blocks[-1] + 1].clone())
        expect(rig.worker.stats()["unwaited_layer_loads"] == 0, "the drafter's layer was taken as skipped")
        got = read.cpu()
        expect(torch.equal(got, rig.slot_rows(slot)[drafter, : len(blocks)]), "the drafter read stale KV")


def check_grouped_copier(device: torch.device) -> None:
    """A hybrid engine's copier (one per KV cache group, each over its part of the slot): a chunk of
    two groups with their own block ids saved and loaded back elsewhere, byte for byte."""
    groups = [Case(False, "LBNHC").build(device), Case(False, "LBNHC").build(device)]
    for seed, (raw, _) in enumerate(groups):
        raw.view(torch.uint8).copy_(random_bytes(tuple(raw.shape), device, 20 + seed))
    copier = build_copier([views for _, views in groups], NUM_BLOCKS, BLOCKS_PER_CHUNK, None)
    if not isinstance(copier, GroupedCopier):
        raise CheckFailed(f"two groups make a grouped copier, not a {type(copier).__name__}")
    saved, loaded = [[3, 4, 5, 6], [9, 8]], [[10, 11, 12, 13], [14, 15]]
    buf = bytearray(copier.chunk_bytes)
    pinned = pin_host_buffer(memoryview(buf), device, len(buf)) if device.type == "cuda" else []
    try:
        slot = copier.slot_view(buf)
        ended: list[BaseException | None] = []
        copier.save_batch([(slot, saved)], ended.append)
        copier.wait()
        expect(ended == [None], f"the save batch reported {ended}")
        copier.load(slot, [(0, ids) for ids in loaded])
        copier.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for (_, views), old, new in zip(groups, saved, loaded, strict=True):
            for layer, view in enumerate(views):
                for a, b in zip(old, new, strict=True):
                    same = torch.equal(view[a].view(torch.uint8), view[b].view(torch.uint8))  # NaNs too
                    expect(same, f"layer {layer}: block {b} is not block {a}")
    finally:
        copier.close()
        if device.type == "cuda":
            unpin_host_buffer(pinned, device)


def check_arena_pinned(device: torch.device) -> None:
    """The worker's arena is really pinned for DMA (CUDA says so of its memory), at start-up and
    on the pin thread, which runs on the KV cache's device."""
    if device.type != "cuda":
        raise Skipped("pinning needs CUDA")
    with worker_rig(device) as rig:
        arena = rig.worker._arena
        expect(rig.worker.arena_pinned is True, "the worker does not report its arena pinned")
        expect(rig.worker.stats().get("pinned_arenas") == 1, "no pinned_arenas in the worker's report")
        mapping = arena.mapping
        assert mapping is not None
        expect(torch.frombuffer(mapping.view(SlotRef(0, 4096)), dtype=torch.uint8).is_pinned(), "not pinned")
        fresh = WorkerArena(None, device, rig.worker.copier.chunk_bytes if rig.worker.copier else 1)
        try:
            fresh.adopt(HelloReply("inst-2", rig.arena.info()))  # on the pin thread
            expect(
                fresh._pinning is not None and bool(fresh._pinning.result(timeout=60)), "pin thread failed"
            )
            assert fresh._pool is not None and fresh.mapping is not None
            bound = fresh._pool.submit(torch.cuda.current_device).result(timeout=10)
            expect(bound == device.index, f"the pin thread runs on device {bound}, the KV on {device}")
            view = torch.frombuffer(fresh.mapping.view(SlotRef(0, 4096)), dtype=torch.uint8)
            expect(view.is_pinned(), "the pin thread's mapping is not pinned")
            del view
        finally:
            fresh.shutdown()


def check_rank_on_device_1(device: torch.device) -> None:
    """A rank whose KV cache is on cuda:1 (a fresh process that only ever sets device 1): saves,
    loads, the save waiter and the pin thread open no CUDA context on device 0."""
    if device.type != "cuda":
        raise Skipped("needs CUDA")
    if torch.cuda.device_count() < 2:
        raise Skipped(f"{torch.cuda.device_count()} GPU here; a rank on device 1 needs two")
    probe = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check_worker", "--rank-on-device-1"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    if probe.returncode == SKIP_STATUS:
        raise Skipped(probe.stdout.strip())
    expect(probe.returncode == 0, f"{probe.stdout.strip()} {probe.stderr.strip()[-2000:]}")


SKIP_STATUS = 3


def _primary_context_active(ordinal: int) -> bool:
    """Whether the driver holds an active primary context on device ``ordinal`` (libcuda)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    expect(cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0, "libcuda")
    expect(cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0, "libcuda")
    return bool(active.value)


def _rank_on_device_1() -> int:
    """The probe of check_rank_on_device_1, in a process of its own; its exit status."""
    device = torch.device("cuda", 1)
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    if _primary_context_active(0):
        print("torch itself opened a context on device 0 before kvtier ran")
        return SKIP_STATUS
    try:
        check_worker_save(device)
        check_worker_load(device)
        check_arena_pinned(device)
        torch.cuda.synchronize(device)
    except AssertionError as exc:
        print(f"on cuda:1: {exc}")
        return 1
    if _primary_context_active(0):
        print("a kvtier thread opened a CUDA context on device 0")
        return 1
    print("no context on device 0")
    return 0


def worker_checks() -> list[tuple[str, Callable[[torch.device], None]]]:
    """The worker-side checks, by name, in the order they run."""
    return [
        ("worker_save", check_worker_save),
        ("worker_load", check_worker_load),
        ("worker_failed_load", check_worker_failed_load),
        ("worker_preemption_fence", check_worker_preemption_fence),
        ("worker_full_graph_replay", check_worker_full_graph_replay),
        ("worker_v2_drafter", check_worker_v2_drafter),
        ("grouped_copier", check_grouped_copier),
        ("arena_pinned", check_arena_pinned),
        ("rank_on_device_1", check_rank_on_device_1),
    ]


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank-on-device-1"]:
        sys.exit(_rank_on_device_1())
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else __name__} --rank-on-device-1")
