"""Block copies between KV tensors and slot buffers keep every byte, in both layouts, on the CPU and
(where a CUDA device is present) between GPU KV tensors and pinned host slots."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier.connector.block_ids import IDS_ALIGN, aligned_starts, block_runs
from kvtier.connector.copy import BlockCopier, chunk_rows, loads_overlap
from kvtier.connector.layout import LayoutError, block_planes
from kvtier.connector.pinning import pin_host_buffer, unpin_host_buffer
from kvtier.runtime.affinity import NICE_STEPS

NUM_BLOCKS = 12
# The device slots are pinned for: where CUDA is, its first device (the copies below run there).
PIN_DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


@pytest.fixture
def slot_bytes() -> Iterator:
    """Slot buffers as the worker has them: host memory, registered as pinned where CUDA is."""
    pinned: list[list[int]] = []

    def make(nbytes: int) -> bytearray:
        buf = bytearray(nbytes)
        pinned.append(pin_host_buffer(memoryview(buf), PIN_DEVICE, nbytes))
        return buf

    yield make
    for addresses in pinned:
        unpin_host_buffer(addresses, PIN_DEVICE)


def _kv_cpu(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, 2, 4, 8, generator=g).to(torch.bfloat16)


def _kv_split(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, NUM_BLOCKS, 4, 8, generator=g).to(torch.bfloat16)


TWO_CPUS = frozenset({0, 1})  # a copy thread beside the caller's (the binding is best effort)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("helper_cpus", [None, TWO_CPUS], ids=["one-thread", "copy-thread"])
@pytest.mark.parametrize("make", [_kv_cpu, _kv_split])
def test_save_then_load_restores_blocks(make, helper_cpus, device, slot_bytes) -> None:
    src_layers = [make(1).to(device), make(2).to(device), make(3).to(device)]
    copier = BlockCopier(src_layers, NUM_BLOCKS, blocks_per_chunk=4, helper_cpus=helper_cpus)
    buf = slot_bytes(copier.chunk_bytes)
    slot = copier.slot_view(buf)
    copier.save(slot, [5, 2, 9, 7])
    copier.wait()
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    loader = BlockCopier(dst_layers, NUM_BLOCKS, blocks_per_chunk=4, helper_cpus=helper_cpus)
    loader.load(loader.slot_view(buf), 1, [3, 4, 6])  # blocks 2, 9, 7 of the source
    loader.wait()
    copier.close()
    loader.close()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        bdim = 0 if src.shape[0] == NUM_BLOCKS else 1
        for s_id, d_id in [(2, 3), (9, 4), (7, 6)]:
            assert torch.equal(src.select(bdim, s_id), dst.select(bdim, d_id))
        assert not dst.select(bdim, 0).any()


@pytest.mark.parametrize(
    ("lengths", "starts", "total"),
    [([3, 5, 4], [0, 4, 10], 14), ([1, 1, 1], [0, 2, 4], 6), ([4, 6], [0, 4], 10), ([], [], 0)],
)
def test_each_chunks_uploaded_ids_start_16_byte_aligned(
    lengths: list[int], starts: list[int], total: int
) -> None:
    """Triton compiles a kernel variant of its own for ids 8 bytes off a 16-byte line: every chunk's
    ids start at an even int64 index, so an odd-length chunk before them never shifts them."""
    assert IDS_ALIGN * 8 == 16
    assert aligned_starts(lengths) == (starts, total)
    assert all(start * 8 % 16 == 0 for start in starts)


def test_block_runs_split_ids_where_they_stop_stepping_by_one() -> None:
    assert block_runs([4, 5, 6, 2, 3, 9]) == [(0, 3, slice(4, 7)), (3, 2, slice(2, 4)), (5, 1, slice(9, 10))]
    assert block_runs([7]) == [(0, 1, slice(7, 8))]
    assert block_runs([]) == []
    assert block_runs([3, 3, 4]) == [(0, 1, slice(3, 4)), (1, 2, slice(3, 5))]
    # Descending runs (vLLM hands out freed blocks last one first), down to block 0 too.
    assert block_runs([9, 8, 7, 2, 1, 0, 1]) == [
        (0, 3, slice(9, 6, -1)),
        (3, 3, slice(2, None, -1)),
        (6, 1, slice(1, 2)),
    ]
    rows = list(range(10))
    assert [rows[r] for _, _, r in block_runs([5, 4, 1, 0])] == [[5, 4], [1, 0]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("helper_cpus", [None, TWO_CPUS], ids=["one-thread", "copy-thread"])
@pytest.mark.parametrize("make", [_kv_cpu, _kv_split])
def test_runs_of_blocks_copy_like_single_blocks(make, helper_cpus, device, slot_bytes) -> None:
    src_layers = [make(4).to(device), make(5).to(device)]
    saved = [1, 2, 3, 8, 7, 2, 1, 0]  # ascending, descending, descending down to block 0
    copier = BlockCopier(src_layers, NUM_BLOCKS, blocks_per_chunk=len(saved), helper_cpus=helper_cpus)
    buf = slot_bytes(copier.chunk_bytes)
    copier.save(copier.slot_view(buf), saved)
    copier.wait()
    one_by_one = bytearray(copier.chunk_bytes)
    for j, block in enumerate(saved):  # block j alone lands in row j of every layer
        row = slot_bytes(copier.chunk_bytes)
        copier.save(copier.slot_view(row), [block] * len(saved))
        copier.wait()
        page = copier.layout.page_bytes
        for layer in range(len(src_layers)):
            at = (layer * len(saved) + j) * page
            one_by_one[at : at + page] = row[at : at + page]
    assert buf == one_by_one
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    loader = BlockCopier(dst_layers, NUM_BLOCKS, blocks_per_chunk=len(saved), helper_cpus=helper_cpus)
    targets = [4, 5, 11, 10, 9, 1, 0]
    loader.load(loader.slot_view(buf), 1, targets)  # rows 1..7: blocks 2, 3, 8, 7, 2, 1, 0 of the source
    loader.wait()
    copier.close()
    loader.close()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        bdim = 0 if src.shape[0] == NUM_BLOCKS else 1
        for s_id, d_id in zip(saved[1:], targets, strict=True):
            assert torch.equal(src.select(bdim, s_id), dst.select(bdim, d_id))


@pytest.mark.parametrize("device", DEVICES)
def test_slot_layout_is_layer_block_page(device, slot_bytes) -> None:
    layers = [_kv_cpu(7).to(device), _kv_cpu(8).to(device)]
    copier = BlockCopier(layers, NUM_BLOCKS, blocks_per_chunk=2)
    buf = slot_bytes(copier.chunk_bytes)
    copier.save(copier.slot_view(buf), [3, 10])
    copier.wait()
    page = copier.layout.page_bytes
    assert bytes(buf[page : 2 * page]) == layers[0][10].view(torch.uint8).cpu().numpy().tobytes()
    assert bytes(buf[2 * page : 3 * page]) == layers[1][3].view(torch.uint8).cpu().numpy().tobytes()
    copier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [_kv_cpu, _kv_split])
def test_a_save_batch_reports_once_its_bytes_are_in_the_slots(make, device, slot_bytes) -> None:
    layers = [make(21).to(device), make(22).to(device)]
    copier = BlockCopier(layers, NUM_BLOCKS, blocks_per_chunk=3, helper_cpus=TWO_CPUS)
    chunks = [[4, 5, 6], [11, 0, 7]]
    bufs = [slot_bytes(copier.chunk_bytes) for _ in chunks]
    seen: list[tuple[BaseException | None, list[bytes]]] = []
    copier.save_batch(
        [(copier.slot_view(buf), ids) for buf, ids in zip(bufs, chunks, strict=True)],
        lambda error: seen.append((error, [bytes(buf) for buf in bufs])),  # the bytes done() sees
    )
    copier.wait()
    copier.close()
    assert len(seen) == 1 and seen[0][0] is None
    page = copier.layout.page_bytes
    for buf, ids, at_done in zip(bufs, chunks, seen[0][1], strict=True):
        assert bytes(buf) == at_done
        for layer, kv in enumerate(layers):
            for j, block in enumerate(ids):
                planes = block_planes(kv, NUM_BLOCKS)
                want = b"".join(p[block].cpu().numpy().tobytes() for p in planes)
                at = (layer * len(ids) + j) * page
                assert bytes(buf[at : at + page]) == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [_kv_cpu, _kv_split])
def test_layer_by_layer_loads_are_in_place_once_each_layer_is_waited_for(make, device, slot_bytes) -> None:
    src = [make(30 + i).to(device) for i in range(5)]
    saver = BlockCopier(src, NUM_BLOCKS, blocks_per_chunk=4)
    chunks = [[0, 1, 2, 3], [8, 6, 4, 2]]
    bufs = [slot_bytes(saver.chunk_bytes) for _ in chunks]
    for buf, ids in zip(bufs, chunks, strict=True):
        saver.save(saver.slot_view(buf), ids)
    saver.wait()
    dst = [torch.zeros_like(t) for t in src]
    loader = BlockCopier(dst, NUM_BLOCKS, blocks_per_chunk=4, helper_cpus=TWO_CPUS)
    targets = [[11, 10, 9], [5, 7, 3]]
    loads = loader.load_layers(
        [(loader.slot_view(bufs[0]), 1, targets[0]), (loader.slot_view(bufs[1]), 0, targets[1])]
    )
    bdim = 0 if src[0].shape[0] == NUM_BLOCKS else 1
    for layer in range(len(dst)):
        loads.wait_layer(layer)  # CUDA: orders the current stream, which then reads the layer
        got = [dst[layer].select(bdim, b).clone() for b in targets[0] + targets[1]]
        want = [src[layer].select(bdim, b) for b in chunks[0][1:] + chunks[1][:3]]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert loads.finish() is None
    for layer in range(len(dst)):  # blocks no chunk loaded stay untouched
        assert not dst[layer].select(bdim, 0).any() and not dst[layer].select(bdim, 1).any()
    saver.close()
    loader.close()


def test_saves_run_at_a_lower_priority_on_a_thread_apart_from_the_loads(slot_bytes) -> None:
    copier = BlockCopier([_kv_cpu(60), _kv_cpu(61)], NUM_BLOCKS, blocks_per_chunk=2, helper_cpus=TWO_CPUS)
    buf = slot_bytes(copier.chunk_bytes)
    seen: dict[str, tuple[int, int]] = {}

    def where() -> tuple[int, int]:
        return threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)

    copier.save_batch([(copier.slot_view(buf), [3, 4])], lambda error: seen.update(save=where()))
    assert copier._helper is not None
    copier._helper.submit(lambda: seen.update(load=where()))  # where load_layers copies
    copier.wait()
    copier.close()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen["save"][1] == min(19, mine + NICE_STEPS)
    assert seen["load"][1] == mine
    assert seen["save"][0] != seen["load"][0]


def test_the_fence_waits_for_a_save_still_copying(slot_bytes, monkeypatch) -> None:
    copier = BlockCopier([_kv_cpu(62)], NUM_BLOCKS, blocks_per_chunk=2, helper_cpus=TWO_CPUS)
    buf = slot_bytes(copier.chunk_bytes)
    entered, gate = threading.Event(), threading.Event()
    real = copier._save_cpu

    def held_back(*args: object) -> None:
        entered.set()
        assert gate.wait(30)
        real(*args)

    monkeypatch.setattr(copier, "_save_cpu", held_back)
    opener = threading.Thread(target=lambda: (entered.wait(30), gate.set()))
    opener.start()
    seen: list[BaseException | None] = []
    copier.save_batch([(copier.slot_view(buf), [7, 8])], seen.append)
    copier.wait()  # returns once the save has ended and reported, not when it was handed over
    assert seen == [None]
    assert bytes(buf) == b"".join(p[b].numpy().tobytes() for b in (7, 8) for p in copier.layers[0])
    opener.join(30)
    assert not opener.is_alive()
    copier.close()


def _one_saved_chunk(
    slot_bytes: Any, seed: int, layers: int, overlap_loads: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, BlockCopier]:
    """Blocks 4-6 of random CPU layers saved into one slot, and a loader (with a copy thread) over
    zeroed layers of the same shape: (source layers, zeroed layers, slot, loader)."""
    src = [_kv_cpu(seed + i) for i in range(layers)]
    saver = BlockCopier(src, NUM_BLOCKS, blocks_per_chunk=3)
    buf = slot_bytes(saver.chunk_bytes)
    saver.save(saver.slot_view(buf), [4, 5, 6])
    saver.close()
    dst = [torch.zeros_like(t) for t in src]
    loader = BlockCopier(
        dst, NUM_BLOCKS, blocks_per_chunk=3, helper_cpus=TWO_CPUS, overlap_loads=overlap_loads
    )
    return src, dst, buf, loader


def test_a_waiter_copies_the_layers_itself_while_the_copy_thread_is_busy(slot_bytes) -> None:
    src, dst, buf, loader = _one_saved_chunk(slot_bytes, 50, layers=4, overlap_loads=True)
    assert loader.cpu_threads == 2
    release = threading.Event()
    loader._helper.submit(release.wait)  # e.g. an earlier step's loads, still running there
    loads = loader.load_layers([(loader.slot_view(buf), 0, [1, 2, 3])])
    outcome: list[BaseException | None] = []
    # Takes the layers from the last one down to layer 0 (in a thread: were it to sleep instead,
    # the test would fail, not hang).
    waiter = threading.Thread(target=lambda: (loads.wait_layer(0), outcome.append(loads.finish())))
    waiter.start()
    waiter.join(30)
    finished_alone = outcome == [None]
    for s, d in zip(src, dst, strict=True):
        assert all(torch.equal(d[b], s[b + 3]) for b in (1, 2, 3))
    release.set()
    waiter.join(30)
    assert not waiter.is_alive()
    assert finished_alone, "the load waited for the busy copy thread"
    loader.wait()  # the copy thread's turn comes after: it finds nothing left to copy
    for s, d in zip(src, dst, strict=True):
        assert all(torch.equal(d[b], s[b + 3]) for b in (1, 2, 3))
    loader.close()


def test_loads_overlap_the_forward_only_with_a_cpu_the_model_leaves_free() -> None:
    assert not loads_overlap(None, 1)
    assert not loads_overlap(frozenset({0, 1}), 2)  # 2 cores, 2 compute threads: no core to spare
    assert not loads_overlap(frozenset({0, 1}), 4)
    assert loads_overlap(frozenset({0, 1, 2}), 2)


def test_without_overlap_the_loads_are_in_place_when_load_layers_returns(slot_bytes) -> None:
    src, dst, buf, loader = _one_saved_chunk(slot_bytes, 70, layers=3, overlap_loads=False)
    release = threading.Event()
    assert loader._helper is not None
    loader._helper.submit(release.wait)  # loads handed to the copy thread would wait behind this
    try:
        loads = loader.load_layers([(loader.slot_view(buf), 0, [1, 2, 3])])
        for s, d in zip(src, dst, strict=True):  # before any wait_layer
            assert all(torch.equal(d[b], s[b + 3]) for b in (1, 2, 3))
        assert loads.finish() is None and loads.ended is not None
    finally:
        release.set()
    loader.close()


def test_a_failed_layer_copy_stops_both_ends_and_is_reported() -> None:
    import threading

    from kvtier.connector.copy import _CpuLayerLoads

    copied: list[int] = []
    started = threading.Event()
    release = threading.Event()

    def copy_layer(layer: int) -> None:
        if layer == 0:  # the copy thread's first layer: still running while the waiter fails
            started.set()
            release.wait(10)
        if layer == 4:
            raise OSError("bad page")
        copied.append(layer)

    parked = threading.Event()

    class Observed(threading.Condition):
        """The loads' condition, telling the test when a thread waits on it."""

        def wait(self, timeout: float | None = None) -> bool:
            parked.set()
            return super().wait(timeout)

    loads = _CpuLayerLoads(6, copy_layer)
    loads._cond = Observed()  # before any thread uses it
    front = threading.Thread(target=loads.run)
    front.start()
    assert started.wait(10)
    waiter_done = threading.Event()
    result: list[BaseException | None] = []

    def wait_all() -> None:
        result.append(loads.finish())
        waiter_done.set()

    back = threading.Thread(target=wait_all)
    back.start()
    # The waiter copies layer 5, fails on layer 4, and then must wait for layer 0's copy rather
    # than return: it parks on the condition (a waiter that returned would never park).
    assert parked.wait(10), "the waiter returned (or hung) instead of waiting for the running copy"
    assert not waiter_done.is_set() and copied == [5]
    release.set()
    front.join(10)
    back.join(10)
    assert not front.is_alive() and not back.is_alive()
    assert isinstance(result[0], OSError) and sorted(copied) == [0, 5]
    assert sorted(copied) == [0, 5]  # nothing after the failure: layers 1-3 were never claimed
    assert loads.ended is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "ids", [[3, NUM_BLOCKS], [0, 5, 2, NUM_BLOCKS], [7, -1]], ids=["run", "scattered", "negative"]
)
def test_block_ids_outside_the_cache_are_refused_before_any_copy(ids, device, slot_bytes) -> None:
    kv = _kv_cpu(1).to(device)
    before = kv.clone()
    copier = BlockCopier([kv], NUM_BLOCKS, blocks_per_chunk=len(ids))
    buf = slot_bytes(copier.chunk_bytes)
    buf[:] = b"\x07" * len(buf)
    with pytest.raises(ValueError, match=f"out of range 0..{NUM_BLOCKS - 1}"):
        copier.save(copier.slot_view(buf), ids)
    with pytest.raises(ValueError, match="out of range"):
        copier.load(copier.slot_view(buf), 0, ids)
    with pytest.raises(ValueError, match="out of range"):
        copier.load_layers([(copier.slot_view(buf), 0, ids)])
    copier.wait()
    copier.close()
    assert buf == b"\x07" * len(buf)
    assert torch.equal(kv, before)


def test_chunk_rows_gather_blocks_scattered_over_three_runs_or_more_in_one_plane() -> None:
    assert chunk_rows([4, 5, 6, 7], one_plane=True).index is None  # one run: its slice
    assert chunk_rows([4, 5, 9, 8], one_plane=True).index is None  # two runs: their slices
    scattered = chunk_rows([5, 2, 9, 7], one_plane=True)
    assert scattered.index is not None and scattered.index.tolist() == [5, 2, 9, 7]
    assert len(scattered.runs) == 4
    # A page split in planes keeps its slices: a gather into one plane's columns is strided.
    assert chunk_rows([5, 2, 9, 7], one_plane=False).index is None


@pytest.mark.parametrize("helper_cpus", [None, TWO_CPUS], ids=["one-thread", "copy-thread"])
@pytest.mark.parametrize(
    "ids",
    [[5, 2, 9, 7, 0, 11], [1, 2, 3, 4, 5, 6], [9, 8, 7, 2, 1, 0]],
    ids=["gathered", "one-run", "two-runs"],
)
def test_gathered_and_sliced_chunks_hold_the_same_bytes(ids, helper_cpus) -> None:
    kv = [_kv_cpu(2), _kv_cpu(3)]
    copier = BlockCopier(kv, NUM_BLOCKS, blocks_per_chunk=len(ids), helper_cpus=helper_cpus)
    buf = bytearray(copier.chunk_bytes)
    copier.save(copier.slot_view(buf), ids)
    copier.wait()
    expected = b"".join(layer[b].view(torch.uint8).numpy().tobytes() for layer in kv for b in ids)
    assert buf == expected
    dst = [torch.zeros_like(layer) for layer in kv]
    loader = BlockCopier(dst, NUM_BLOCKS, blocks_per_chunk=len(ids), helper_cpus=helper_cpus)
    targets = [11, 0, 6, 3, 4, 10]  # scattered: the load gathers from the slot into these blocks
    loader.load_layers([(loader.slot_view(buf), 0, targets)]).finish()
    loader.load(loader.slot_view(buf), 0, targets)
    loader.wait()
    copier.close()
    loader.close()
    for src_layer, dst_layer in zip(kv, dst, strict=True):
        for s_id, d_id in zip(ids, targets, strict=True):
            assert torch.equal(src_layer[s_id], dst_layer[d_id])
        for untouched in set(range(NUM_BLOCKS)) - set(targets):
            assert not dst_layer[untouched].any()


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(LayoutError):
        block_planes(torch.zeros(5, 3), NUM_BLOCKS)
    copier = BlockCopier([_kv_cpu(1)], NUM_BLOCKS, blocks_per_chunk=2)
    with pytest.raises(LayoutError):
        copier.slot_view(bytearray(copier.chunk_bytes + 1))


@pytest.mark.parametrize("make", [_kv_cpu, _kv_split])
def test_chunks_copied_between_fences_land_the_same_with_the_copy_thread(make) -> None:
    layers = [make(11), make(12), make(13)]
    chunks = [[0, 1], [5, 3], [8, 9], [2, 7], [11, 10]]
    plain = BlockCopier(layers, NUM_BLOCKS, blocks_per_chunk=2)
    threaded = BlockCopier(layers, NUM_BLOCKS, blocks_per_chunk=2, helper_cpus=TWO_CPUS)
    assert (plain.cpu_threads, threaded.cpu_threads) == (1, 2)
    want = [bytearray(plain.chunk_bytes) for _ in chunks]
    got = [bytearray(plain.chunk_bytes) for _ in chunks]
    for ids, a, b in zip(chunks, want, got, strict=True):
        plain.save(plain.slot_view(a), ids)
        threaded.save(threaded.slot_view(b), ids)  # every second one on the copy thread
    threaded.wait()
    assert got == want
    restored = [torch.zeros_like(t) for t in layers]
    loader = BlockCopier(restored, NUM_BLOCKS, blocks_per_chunk=2, helper_cpus=TWO_CPUS)
    for ids, buf in zip(chunks, got, strict=True):
        loader.load(loader.slot_view(buf), 0, ids)
    loader.wait()
    for src, dst in zip(layers, restored, strict=True):
        bdim = 0 if src.shape[0] == NUM_BLOCKS else 1
        for block in range(NUM_BLOCKS):
            copied = any(block in ids for ids in chunks)
            assert torch.equal(src.select(bdim, block), dst.select(bdim, block)) == copied
    for copier in (plain, threaded, loader):
        copier.close()


def test_an_arena_cuda_refuses_to_pin_leaves_no_error_for_the_next_kernel() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    buf = bytearray(1 << 20)
    pinned = pin_host_buffer(memoryview(buf), PIN_DEVICE, len(buf))
    assert pinned
    try:
        assert not pin_host_buffer(memoryview(buf), PIN_DEVICE, len(buf))  # registered already: CUDA refuses
        assert float(torch.ones(4, device="cuda").sum()) == 4.0  # no stale error raised here
    finally:
        unpin_host_buffer(pinned, PIN_DEVICE)


def test_a_cuda_save_that_fails_midway_reports_it_with_nothing_left_running(monkeypatch, slot_bytes) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import kvtier.connector.copy_cuda as copy_cuda
    from kvtier.connector import staging

    monkeypatch.setattr(staging, "PIECE_BYTES", 1)  # one layer per piece: several pieces per chunk
    layers = [_kv_split(40 + i).to("cuda") for i in range(4)]
    copier = BlockCopier(layers, NUM_BLOCKS, blocks_per_chunk=2)
    real, calls = copy_cuda.stage_blocks, []

    def second_fails(*args, **kwargs) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel launch failed")
        real(*args, **kwargs)

    monkeypatch.setattr(copy_cuda, "stage_blocks", second_fails)
    seen: list[BaseException | None] = []
    torch.cuda._sleep(200_000_000)  # the forward still running: the first piece's copies queue behind it
    slot = copier.slot_view(slot_bytes(copier.chunk_bytes))  # pinned: the DMA does not block the host
    copier.save_batch([(slot, [1, 2])], seen.append)
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
    gpu = copier._gpu
    lane = gpu._saves if gpu is not None else None
    assert lane is not None and lane.kernels.query() and lane.dma.query()  # nothing still queued
    copier.close()


def test_a_cuda_batch_of_ascending_descending_and_scattered_chunks_lands_exactly(slot_bytes) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    layers = [_kv_split(60 + i).to("cuda") for i in range(4)]
    copier = BlockCopier(layers, NUM_BLOCKS, blocks_per_chunk=3)
    # A run up and runs down (no upload; one down to block 0, one filling part of its slot), and
    # scattered ids; block 8 is in none.
    batch_ids = [[4, 5, 6], [9, 3, 7], [2, 1, 0], [11, 10]]
    slots = [copier.slot_view(slot_bytes(copier.chunk_bytes)) for _ in batch_ids]
    seen: list[BaseException | None] = []
    copier.save_batch(list(zip(slots, batch_ids, strict=True)), seen.append)
    copier.wait()
    assert seen == [None]
    for slot, ids in zip(slots, batch_ids, strict=True):
        want = torch.stack([torch.cat([p[ids] for p in planes], dim=1) for planes in copier.layers])
        assert torch.equal(slot[:, : len(ids)], want.cpu())
    loader = BlockCopier([torch.zeros_like(t) for t in layers], NUM_BLOCKS, blocks_per_chunk=3)
    loads = loader.load_layers([(slot, 0, ids) for slot, ids in zip(slots, batch_ids, strict=True)])
    assert loads.finish() is None
    copied = {b for ids in batch_ids for b in ids}
    for saved, restored in zip(copier.layers, loader.layers, strict=True):
        for a, b in zip(saved, restored, strict=True):
            for block in range(NUM_BLOCKS):
                assert torch.equal(a[block], b[block]) == (block in copied)
    for c in (copier, loader):
        c.close()


def test_a_save_batch_refused_at_once_is_reported_after_the_batches_before_it() -> None:
    # The worker frees a finished request's blocks once every save batch issued before has ended;
    # a batch refused at once (a bad block id) must not end ahead of one still copying.
    copier = BlockCopier([_kv_cpu(1), _kv_cpu(2)], NUM_BLOCKS, blocks_per_chunk=2, helper_cpus=TWO_CPUS)
    assert copier.defers_saves
    gate, ended = threading.Event(), []

    def first_done(error: BaseException | None) -> None:
        assert gate.wait(10), "the test never opened the gate"
        ended.append(("first", error))

    slot = copier.slot_view(bytearray(copier.chunk_bytes))
    copier.save_batch([(slot, [0, 1])], first_done)
    copier.save_batch([(slot, [0, NUM_BLOCKS])], lambda error: ended.append(("refused", error)))
    assert ended == []  # the refusal waits behind the first batch, still on the save thread
    gate.set()
    copier.wait()
    copier.close()
    assert [name for name, _ in ended] == ["first", "refused"]
    assert ended[0][1] is None and isinstance(ended[1][1], ValueError)
