"""The CUDA-only checks of ``tools.gpu_check``: stream ordering, host blocking, far offsets, pinning.

Ordering checks hold the current stream busy with ``torch.cuda._sleep`` first, so a copier that
does not order its own streams after (saves) or before (loads) the caller's work reads or leaves
stale bytes, instead of winning the race by luck.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable

import torch

from kvtier.bench.kv_views import kv_cache_views
from kvtier.connector import staging
from kvtier.connector.copy import BlockCopier
from kvtier.connector.pinning import pin_host_buffer, unpin_host_buffer
from tools.gpu_check_layouts import (
    BLOCKS_PER_CHUNK,
    NUM_BLOCKS,
    NUM_LAYERS,
    Case,
    Skipped,
    Table,
    address_table,
    check_saved,
    expect,
    host_slots,
    random_bytes,
)

IDS = [9, 3, 12, 5]  # scattered: the kernel takes uploaded ids
SLEEP_MS = 200  # long against issuing a copy (tens of microseconds a piece)


def sleep_cycles(device: torch.device, ms: float) -> int:
    """``torch.cuda._sleep`` cycles that hold the current stream about ``ms`` milliseconds."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))


def _kv(device: torch.device, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], Table]:
    """vLLM's default LBNHC views of random bytes, and where each page lies."""
    raw, views = Case(False, "LBNHC").build(device)
    raw.view(torch.uint8).copy_(random_bytes(tuple(raw.shape), device, seed))
    return raw, views, address_table(views, NUM_BLOCKS, list(range(NUM_BLOCKS)))


def _streams(device: torch.device) -> list[torch.cuda.Stream]:
    """The default stream and a side stream, as the caller's current stream."""
    return [torch.cuda.default_stream(device), torch.cuda.Stream(device)]


def check_save_after_compute(device: torch.device) -> None:
    """A save copies what the current stream wrote before it, not what was there."""
    raw, views, table = _kv(device)
    cycles = sleep_cycles(device, SLEEP_MS)
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    try:
        with host_slots(copier, 1) as (slot,):
            for seed, stream in enumerate(_streams(device), start=1):
                new = random_bytes(tuple(raw.shape), device, seed).view(torch.int8)
                torch.cuda.synchronize(device)
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)
                    raw.copy_(new)  # the forward writing the KV
                    copier.save(slot, IDS)
                copier.wait()
                torch.cuda.synchronize(device)
                check_saved(slot, new, table, IDS, f"save on stream {stream}")
    finally:
        copier.close()


def _read_after_load(device: torch.device, layered: bool) -> None:
    raw, views, table = _kv(device)
    cycles = sleep_cycles(device, SLEEP_MS)
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    try:
        with host_slots(copier, 1) as (slot,):
            for seed, stream in enumerate(_streams(device), start=1):
                slot.copy_(random_bytes(tuple(slot.shape), torch.device("cpu"), seed))
                torch.cuda.synchronize(device)
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)
                    read = _load_and_read(copier, slot, raw, table, layered)
                torch.cuda.synchronize(device)
                copier.wait()
                for layer in range(NUM_LAYERS):
                    for row, block in enumerate(IDS):
                        got = read[layer][row].view(torch.uint8).cpu()
                        expect(
                            torch.equal(got, slot[layer, row]),
                            f"stream {stream}: layer {layer} block {block}",
                        )
    finally:
        copier.close()


def _load_and_read(
    copier: BlockCopier, slot: torch.Tensor, raw: torch.Tensor, table: Table, layered: bool
) -> list[list[torch.Tensor]]:
    """Load IDS from the slot and read their pages on the current stream at once (the forward)."""
    loads = copier.load_layers([(slot, 0, IDS)]) if layered else None
    if loads is None:
        copier.load(slot, 0, IDS)
    read = []
    for layer in range(NUM_LAYERS):
        if loads is not None:
            loads.wait_layer(layer)
        read.append([raw[table[layer, block]] for block in IDS])
    if loads is not None:
        expect(loads.finish() is None, "load_layers(...).finish() reported an error")
    return read


def check_load_before_read(device: torch.device) -> None:
    """What the current stream reads after load() is the loaded bytes."""
    _read_after_load(device, layered=False)


def check_load_layers_before_read(device: torch.device) -> None:
    """What the current stream reads after wait_layer(i) is layer i's loaded bytes."""
    _read_after_load(device, layered=True)


def check_wait_layer_nonblocking(device: torch.device) -> None:
    """wait_layer() orders the GPU and returns: the host is free long before the loads end."""
    raw, views, table = _kv(device)
    cycles = sleep_cycles(device, SLEEP_MS)
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    try:
        with host_slots(copier, 1) as (slot,):
            slot.copy_(random_bytes(tuple(slot.shape), torch.device("cpu"), seed=5))
            torch.cuda.synchronize(device)
            torch.cuda._sleep(cycles)  # the loads queue behind it
            start = time.perf_counter()
            loads = copier.load_layers([(slot, 0, IDS)])
            for layer in range(NUM_LAYERS):
                loads.wait_layer(layer)
            host = time.perf_counter() - start
            error = loads.finish()
            total = time.perf_counter() - start
            copier.wait()
            expect(error is None, f"finish() reported {error!r}")
            expect(
                host < total / 4,
                f"issuing and waiting for every layer held the host {host * 1e3:.1f} ms of the "
                f"{total * 1e3:.1f} ms the loads took behind a {SLEEP_MS} ms sleep",
            )
            want = raw.clone()
            for layer in range(NUM_LAYERS):
                for row, block in enumerate(IDS):
                    want[table[layer, block]] = slot[layer, row].view(torch.int8).to(device)
            expect(torch.equal(raw, want), "the loaded KV differs from the slot's rows")
    finally:
        copier.close()


def check_stream_left_as_found(device: torch.device) -> None:
    """A non-default current stream is current again after every copier call."""
    _, views, _ = _kv(device)
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    side = torch.cuda.Stream(device)
    outcomes: list[BaseException | None] = []

    def layer_loads(slot: torch.Tensor) -> None:
        loads = copier.load_layers([(slot, 0, IDS)])
        for layer in range(NUM_LAYERS):
            loads.wait_layer(layer)
        expect(loads.finish() is None, "load_layers(...).finish() reported an error")

    try:
        with host_slots(copier, 1) as (slot,), torch.cuda.stream(side):
            calls: dict[str, Callable[[], object]] = {
                "save": lambda: copier.save(slot, IDS),
                "load": lambda: copier.load(slot, 0, IDS),
                "save_batch": lambda: copier.save_batch([(slot, IDS)], outcomes.append),
                "load_layers": lambda: layer_loads(slot),
            }
            for name, call in calls.items():
                call()
                expect(torch.cuda.current_stream(device) == side, f"{name} left another stream current")
                copier.wait()
                expect(
                    torch.cuda.current_stream(device) == side,
                    f"wait() after {name} left another stream current",
                )
        expect(outcomes == [None], f"save_batch reported {outcomes}")
    finally:
        copier.close()


# The far-offsets check's KV: 2 layers of 64 KiB pages over 4.5 GiB.
FAR_HEADS, FAR_HEAD_SIZE, FAR_LAYERS, FAR_BYTES = 8, 128, 2, 9 << 29


def check_offsets_past_4gib(device: torch.device) -> None:
    """Blocks whose bytes lie past 2**31 and 2**32 bytes into the KV buffer copy byte for byte."""
    page = FAR_HEADS * 16 * 2 * FAR_HEAD_SIZE * 2
    num_blocks = FAR_BYTES // (FAR_LAYERS * page)
    free, _ = torch.cuda.mem_get_info(device)
    if free < 2 * FAR_BYTES + (2 << 30):  # the KV and a copy of it to compare against
        raise Skipped(f"needs {(2 * FAR_BYTES >> 30) + 2} GiB of GPU memory, {free >> 30} GiB free")
    for layout in ("LBNHC", "BLHNC"):
        raw, views = kv_cache_views(
            FAR_LAYERS, num_blocks, 16, FAR_HEADS, FAR_HEAD_SIZE, torch.bfloat16, layout, device
        )
        blocks = _blocks_across(views, num_blocks, (1 << 31, 1 << 32))
        table = address_table(views, num_blocks, blocks)
        expect(max(int(t[-1]) for t in table.values()) >= 1 << 32, f"{layout}: no page past 2**32")
        for seed, where in enumerate(table.values()):
            raw[where] = random_bytes((where.numel(),), device, seed).view(torch.int8)
        _far_roundtrip(raw, views, num_blocks, table, blocks[::2] + blocks[1::2], layout)
        del raw, views, table
        torch.cuda.empty_cache()


def _blocks_across(views: list[torch.Tensor], num_blocks: int, limits: tuple[int, ...]) -> list[int]:
    """The blocks, in every layer, whose pages lie at or beside each byte offset of ``limits``."""
    blocks = {num_blocks - 1}
    for view in views:
        as_bytes = view.view(torch.int8)
        base, stride = as_bytes.storage_offset(), as_bytes.stride(0)
        for limit in limits:
            at = (limit - base) // stride
            blocks.update(b for b in (at - 1, at, at + 1) if 0 <= b < num_blocks)
    return sorted(blocks)


def _far_roundtrip(
    raw: torch.Tensor, views: list[torch.Tensor], num_blocks: int, table: Table, ids: list[int], layout: str
) -> None:
    copier = BlockCopier(views, num_blocks, len(ids))
    try:
        with host_slots(copier, 1) as (slot,):
            copier.save(slot, ids)
            copier.wait()
            check_saved(slot, raw, table, ids, f"{layout} save of blocks {ids}")
            slot.copy_(random_bytes(tuple(slot.shape), torch.device("cpu"), seed=99))
            want = raw.clone()
            for layer in range(len(views)):
                for row, block in enumerate(ids):
                    want[table[layer, block]] = slot[layer, row].view(torch.int8).to(raw.device)
            copier.load(slot, 0, ids)
            copier.wait()
            expect(torch.equal(raw, want), f"{layout} load of blocks {ids}: the KV differs")
    finally:
        copier.close()


def check_pin_unpin_pin(device: torch.device) -> None:
    """Pin, unpin, pin again and a refused second pin leave no CUDA error for the next kernel."""
    mapping = mmap.mmap(-1, 64 << 20)
    view = memoryview(mapping)
    pinned: list[int] = []
    try:
        pinned = pin_host_buffer(view, device, 1 << 20)
        expect(bool(pinned), "CUDA refused to pin a fresh mapping")
        unpin_host_buffer(pinned, device)
        pinned = pin_host_buffer(view, device, 1 << 20)
        expect(bool(pinned), "CUDA refused to pin a mapping pinned and unpinned before")
        expect(not pin_host_buffer(view, device, 1 << 20), "CUDA pinned the same memory twice")
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)  # raises a CUDA error a refused pin left behind
    finally:
        unpin_host_buffer(pinned, device)
        view.release()
        mapping.close()
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)


def copier_streams(copier: BlockCopier) -> list[torch.cuda.Stream]:
    """Every CUDA stream the copier holds, found by walking its attributes (so the check needs no
    knowledge of how the CUDA path keeps them)."""
    found: list[torch.cuda.Stream] = []
    seen: set[int] = set()

    def walk(obj: object, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.cuda.Stream):
            found.append(obj)
        elif isinstance(obj, list | tuple):
            for item in obj:
                walk(item, depth + 1)
        elif _is_kvtiers(obj) and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                walk(item, depth + 1)

    walk(copier, 0)
    return found


def _is_kvtiers(obj: object) -> bool:
    """Whether obj is an instance of one of kvtier's own classes (the walk goes no further)."""
    return type(obj).__module__.split(".")[0] in ("kvtier", "connector")


def check_failed_save_batch(device: torch.device) -> None:
    """A batch with a bad block id reports an error once nothing of it runs, and the copier goes on."""
    raw, views, table = _kv(device)
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    streams = copier_streams(copier)
    reported = threading.Event()
    seen: dict[str, object] = {}

    def done(error: BaseException | None) -> None:
        seen["error"], seen["busy"] = error, [s for s in streams if not s.query()]
        reported.set()

    try:
        expect(bool(streams), "found no CUDA stream on the copier")
        with host_slots(copier, 2) as (good, bad):
            torch.cuda._sleep(sleep_cycles(device, SLEEP_MS))  # a copy it issued would still wait
            copier.save_batch([(good, [1, 2, 3]), (bad, [4, NUM_BLOCKS + 5])], done)
            expect(reported.wait(timeout=60), "the failed batch was never reported")
            expect(seen["error"] is not None, "a batch with a bad block id reported success")
            expect(not seen["busy"], f"streams still busy when the failure was reported: {seen['busy']}")
            outcomes: list[BaseException | None] = []
            copier.save_batch([(good, [1, 2, 3])], outcomes.append)
            copier.wait()
            expect(outcomes == [None], f"the next batch reported {outcomes}")
            check_saved(good, raw, table, [1, 2, 3], "save after a failed batch")
    finally:
        copier.close()


def check_load_pieces_ring_wrap(device: torch.device) -> None:
    """Chunks of several pieces (one layer each), loaded layer by layer and saved in one call each,
    so the staging ring wraps inside the call: every byte lands, read as the forward reads it."""
    raw, views, table = _kv(device)
    saved = staging.PIECE_BYTES
    staging.PIECE_BYTES = 1  # one layer a piece: NUM_LAYERS pieces a chunk, RING buffers a lane
    try:
        copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    finally:
        staging.PIECE_BYTES = saved
    ids = [[9, 3, 12, 5], [0, 1, 2, 4], [15, 14, 13, 11]]
    try:
        expect(copier._gpu is not None and copier._gpu.layers_per_piece == 1, "pieces of one layer")
        with host_slots(copier, len(ids)) as slots:
            for seed, slot in enumerate(slots, start=1):
                slot.copy_(random_bytes(tuple(slot.shape), torch.device("cpu"), seed))
            loads = copier.load_layers([(slot, 0, chunk) for slot, chunk in zip(slots, ids, strict=True)])
            read = []
            for layer in range(NUM_LAYERS):
                loads.wait_layer(layer)
                read.append([raw[table[layer, b]] for chunk in ids for b in chunk])
            expect(loads.finish() is None, "load_layers(...).finish() reported an error")
            torch.cuda.synchronize(device)
            for layer in range(NUM_LAYERS):
                want = torch.cat([slot[layer, : len(chunk)] for slot, chunk in zip(slots, ids, strict=True)])
                got = torch.stack([page.view(torch.uint8) for page in read[layer]]).cpu()
                expect(torch.equal(got, want), f"layer {layer}: a piece landed in the wrong blocks")
            for slot in slots:
                slot.zero_()
            ended: list[BaseException | None] = []
            copier.save_batch([(slot, chunk) for slot, chunk in zip(slots, ids, strict=True)], ended.append)
            copier.wait()
            expect(ended == [None], f"the save batch reported {ended}")
            for slot, chunk in zip(slots, ids, strict=True):
                check_saved(slot, raw, table, chunk, "save of several pieces")
    finally:
        copier.close()


def _kernel_variants() -> int | None:
    """Variants of the copy kernel Triton has compiled in this process (None where this Triton keeps
    them where this does not look)."""
    from kvtier.connector.cuda_kernels import _stage_blocks

    try:
        caches = getattr(_stage_blocks, "device_caches", None)
        if caches is not None:
            return sum(len(entry[0]) for entry in caches.values())
        return sum(len(cache) for cache in _stage_blocks.cache.values())
    except (AttributeError, TypeError, IndexError):
        return None


def check_misaligned_ids_timed(device: torch.device) -> None:
    """Scattered chunks of odd length in one batch (the second's ids would start 8 bytes into a
    16-byte line) compile no kernel inside the call: Triton's variants stay those the warm-up
    compiled, and the call takes about as long as the same call again."""
    raw, views, table = _kv(device)
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    ids = [[9, 3, 12], [5, 0, 7], [14, 2, 10]]  # three ids each: starts 0, 3, 6 unpadded
    variants = _kernel_variants()
    try:
        with host_slots(copier, len(ids)) as slots:
            times = []
            for _ in range(2):
                start = time.perf_counter()
                ended: list[BaseException | None] = []
                copier.save_batch(
                    [(slot, chunk) for slot, chunk in zip(slots, ids, strict=True)], ended.append
                )
                copier.wait()
                times.append(time.perf_counter() - start)
                expect(ended == [None], f"the save batch reported {ended}")
            for slot, chunk in zip(slots, ids, strict=True):
                check_saved(slot, raw, table, chunk, "save of odd-length scattered chunks")
    finally:
        copier.close()
    after = _kernel_variants()
    expect(variants == after, f"Triton compiled {after} variants of the kernel, the warm-up {variants}")
    # A Triton compile takes hundreds of milliseconds at least; a batch of three small chunks, less
    # than one.
    expect(
        times[0] < max(0.2, 20 * times[1]),
        f"the first batch took {times[0] * 1000:.1f} ms, the next {times[1] * 1000:.1f} ms: a compile",
    )


def cuda_checks() -> list[tuple[str, Callable[[torch.device], None]]]:
    """The CUDA-only checks, named as gpu_check prints them."""
    return [
        ("save_after_compute", check_save_after_compute),
        ("load_before_read", check_load_before_read),
        ("load_layers_before_read", check_load_layers_before_read),
        ("wait_layer_nonblocking", check_wait_layer_nonblocking),
        ("stream_left_as_found", check_stream_left_as_found),
        ("offsets_past_4gib", check_offsets_past_4gib),
        ("pin_unpin_pin", check_pin_unpin_pin),
        ("failed_save_batch", check_failed_save_batch),
        ("load_pieces_ring_wrap", check_load_pieces_ring_wrap),
        ("misaligned_ids_timed", check_misaligned_ids_timed),
    ]
