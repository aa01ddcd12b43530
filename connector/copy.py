"""Block copies between vLLM's per-layer KV tensors and arena slots, as opaque bytes.

Who owns what: a ``BlockCopier`` owns its copy and save threads (CPU) or its ``CudaCopier`` (CUDA);
``wait()`` is the fence for every copy submitted before it.
Design: docs/internals.md#cpu-copies-copypy-copy_threadpy
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.connector.block_ids import Run, block_runs, check_block_ids
from kvtier.connector.copy_thread import CopyThread
from kvtier.connector.layout import LayoutError, PageLayout, block_planes
from kvtier.connector.pinning import bind_device
from kvtier.runtime.handoff import TwoEnds

if TYPE_CHECKING:
    from kvtier.connector.copy_cuda import CudaCopier

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level


# A CPU copy of layers [lo, hi): (lo, hi, slot, where the chunk's blocks lie, first slot row).
_LayerCopy = Callable[[int, int, np.ndarray, "ChunkRows", int], None]


class LayerLoads:
    """Loads issued layer by layer: wait_layer(i) returns once layers 0..i are in place."""

    ended: float | None = None  # time.monotonic() when the last copy ended, where it is known

    def wait_layer(self, layer: int) -> None:
        """Make what runs next (the forward's attention of ``layer``) see that layer's loads."""

    def finish(self) -> BaseException | None:
        """Block until every layer is in place; the first copy error, or None."""
        return None


class _CpuLayerLoads(LayerLoads):
    """A layer-by-layer load on the CPU, copied from both ends: the copy thread takes layers from the
    first one up (``run``), and a caller that waits for a layer not in place yet takes layers from
    the last one down (in ``wait_layer``) instead of sleeping. A full hit leaves the forward nothing
    to do meanwhile, so its copies use both cores (and do not queue behind earlier saves on the copy
    thread); a long prefill still finds its early layers copied first.

    Every layer is claimed by one thread and copied once. A failed copy stops both ends; waiters
    return once no copy is running any more, so nothing writes into the blocks after they do.
    """

    def __init__(self, num_layers: int, copy_layer: Callable[[int], None]) -> None:
        self._cond = threading.Condition()
        self._copy_layer = copy_layer
        self._num_layers = num_layers
        # Claimed under _cond too, so a claim and its count in _running are one step.
        self._layers = TwoEnds(num_layers)
        self._done = [False] * num_layers
        self._running = 0  # copies under way
        self._error: BaseException | None = None

    def run(self) -> None:
        """Copy layers from the first one up until every layer is claimed (copy thread)."""
        while True:
            with self._cond:
                layer = self._layers.front()
                if layer is None:
                    return
                self._running += 1
            self._copy(layer)

    def _copy(self, layer: int) -> None:
        """Copy a claimed layer and record it (its claimer counted it in _running)."""
        error: BaseException | None = None
        try:
            self._copy_layer(layer)
        except BaseException as exc:  # even an interrupt: waiters must not wait for it forever
            error = exc
        with self._cond:
            self._running -= 1
            if error is not None:
                if self._error is None:
                    self._error = error
                self._layers.close()  # nothing more is claimed
            else:
                self._done[layer] = True
            if self._settled(self._num_layers - 1):
                self.ended = time.monotonic()
            self._cond.notify_all()
        if error is not None and not isinstance(error, Exception):
            raise error

    def _settled(self, layer: int) -> bool:
        """Layers 0..layer are in place, or a copy failed and none is running (holder of _cond)."""
        if self._error is not None:
            return self._running == 0
        return all(self._done[: layer + 1])

    def wait_layer(self, layer: int) -> None:
        """Return once layers 0..layer are in place (or a copy failed), copying the last
        unclaimed layers meanwhile."""
        while True:
            with self._cond:
                if self._settled(layer):
                    return
                claimed = self._layers.back()
                if claimed is None:
                    self._cond.wait()
                    continue
                self._running += 1
            self._copy(claimed)

    def finish(self) -> BaseException | None:
        """Block until every layer is copied (helping with the copies); the copy error, or None."""
        self.wait_layer(self._num_layers - 1)
        return self._error


class _CudaLayerLoads(LayerLoads):
    """One event per layer, recorded on the copy stream after that layer's copies."""

    def __init__(self, events: list[torch.cuda.Event], device: torch.device) -> None:
        self._events = events
        self._device = device

    def wait_layer(self, layer: int) -> None:
        """Order the compute stream after the layer's copies; the host does not block."""
        if layer < len(self._events):
            torch.cuda.current_stream(self._device).wait_event(self._events[layer])

    def finish(self) -> BaseException | None:
        """Block the host until the last layer's copies have ended."""
        try:
            if self._events:
                self._events[-1].synchronize()
        except Exception as exc:
            return exc
        return None


def loads_overlap(helper_cpus: frozenset[int] | None, compute_threads: int) -> bool:
    """Whether a copy thread loading layers can overlap the forward: only where the copy thread's
    CPUs outnumber the model's compute threads.

    On fewer, the copy thread and the model's threads share cores, and a single thread already moves
    cold bytes at memory bandwidth: the caller copying before the forward is as fast or faster
    (docs/performance.md).
    """
    return helper_cpus is not None and len(helper_cpus) > compute_threads


# A chunk whose blocks form this many runs or more is copied with one gather or indexed assignment
# per layer: from 3 runs on, a gather beats one slice per run (docs/performance.md).
GATHER_RUNS = 3


@dataclass(frozen=True)
class ChunkRows:
    """Where one chunk's blocks lie in a layer's planes: their runs, and where they are scattered
    over many runs, their ids as an index for one gather (save) or indexed assignment (load)."""

    runs: list[Run]
    index: np.ndarray | None = None


def chunk_rows(ids: Sequence[int], one_plane: bool) -> ChunkRows:
    """Plan one chunk's CPU copy: its runs, plus an index where the blocks form GATHER_RUNS runs or
    more and a layer is one plane (a gather into one plane of a split page would be strided, and
    numpy buffers such an output)."""
    runs = block_runs(ids)
    if one_plane and len(runs) >= GATHER_RUNS:
        return ChunkRows(runs, np.array(ids, dtype=np.intp))
    return ChunkRows(runs)


class BlockCopier:
    """Copies whole blocks of every layer between the KV cache and a slot buffer."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        num_blocks: int,
        blocks_per_chunk: int,
        helper_cpus: frozenset[int] | None = None,
        overlap_loads: bool | None = None,
    ):
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered")
        self.layers = [block_planes(kv, num_blocks) for kv in kv_caches]
        shapes = {tuple(p.shape[1] for p in planes) for planes in self.layers}
        if len(shapes) != 1:
            raise LayoutError(f"layers have different page shapes: {sorted(shapes)}")
        self.layout = PageLayout(shapes.pop())
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = num_blocks
        self.device = kv_caches[0].device
        self.num_layers = len(self.layers)
        self._gpu: CudaCopier | None = None
        # The copier's thread for work that ends after the caller returns. CPU: every second
        # chunk's copy, which pays off only with a second CPU to run it. CUDA: waiting for each
        # save batch's copies to end, then reporting them.
        self._helper: CopyThread | None = None
        # CPU, with a second CPU: save batches, at a lower priority, so a save neither takes cores
        # from the prompt whose first token is due nor queues a hit's load behind it.
        self._saver: CopyThread | None = None
        self._np_layers: list[list[np.ndarray]] = []
        if self.device.type == "cuda":
            from kvtier.connector.copy_cuda import CudaCopier, CudaLayoutError

            try:
                self._gpu = CudaCopier(self.layers, blocks_per_chunk, num_blocks)
            except CudaLayoutError as exc:
                raise LayoutError(str(exc)) from exc
            self._helper = cuda_save_waiter(self.device, helper_cpus)
        else:
            # numpy views sharing the KV tensors' memory (see the module docstring for why).
            self._np_layers = [[p.numpy() for p in planes] for planes in self.layers]
            if helper_cpus is not None and len(helper_cpus) > 1:
                self._helper = CopyThread(helper_cpus)
                self._saver = CopyThread(helper_cpus, name="kvtier-saves", background=True)
        self._turn = 0  # chunks copied since the last fence
        # CPU: load_layers copies on the copy thread (overlapping the forward) or in the caller;
        # None decides by the CPUs the model's threads leave free (loads_overlap).
        if overlap_loads is None:
            overlap_loads = loads_overlap(helper_cpus, torch.get_num_threads())
        self.overlap_loads = overlap_loads and self._helper is not None and self._gpu is None

    def run_all(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run tasks, every second one on the copy thread where there is one (CPU, a second CPU),
        returning once all have ended; CopyError if one run on the thread raised."""
        if self._helper is None or self._gpu is not None or len(tasks) < 2:
            for task in tasks:
                task()
            return
        for task in tasks[1::2]:
            self._helper.submit(task)
        try:
            for task in tasks[::2]:
                task()
        finally:
            self._helper.wait()

    @property
    def host_planes(self) -> list[list[np.ndarray]] | None:
        """Each layer's planes as numpy views of the KV cache in host memory; None on CUDA."""
        return self._np_layers if self._gpu is None else None

    @property
    def cpu_threads(self) -> int:
        """Threads a CPU copy runs on: 2 with the copy thread, else 1 (and 1 on CUDA)."""
        return 1 if self._helper is None or self._gpu is not None else 2

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk."""
        return self.num_layers * self.blocks_per_chunk * self.layout.page_bytes

    def slot_view(self, buf: memoryview | bytearray) -> torch.Tensor:
        """A uint8 tensor ``[layer, block, page]`` over a slot buffer (no copy)."""
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        if flat.numel() != self.chunk_bytes:
            raise LayoutError(f"slot has {flat.numel()} bytes, a chunk needs {self.chunk_bytes}")
        return flat.view(self.num_layers, self.blocks_per_chunk, self.layout.page_bytes)

    def save(self, slot: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy the blocks (every layer) into the first ``len(block_ids)`` block rows of the slot."""
        if self._gpu is not None:
            self._gpu.save([(slot, block_ids)])
            return
        self._on_cpu(self._save_cpu, slot.numpy(), self._rows(block_ids), 0)

    @property
    def defers_saves(self) -> bool:
        """True when save_batch() returns before its copies end (save thread, or CUDA)."""
        return self._helper is not None

    def save_batch(
        self,
        chunks: Sequence[tuple[torch.Tensor, Sequence[int]]],
        done: Callable[[BaseException | None], object],
    ) -> None:
        """save() each (slot, block_ids), then call done(None), or done(error) if a copy failed.

        With a second CPU the copies and done() run on the save thread, in order with the other
        batches, and this returns at once: a step's saves then cost its forward nothing (a miss's
        first token no longer waits for the copy of its prompt, nor for cores the copy takes, as
        the thread runs at a lower priority), and wait() still fences them. The caller must keep the
        blocks unchanged until then (the worker fences before any block is reused).
        On CUDA the copies are issued here and a waiter thread calls done() once they end.
        On one CPU they run here, fenced, and done() is called before this returns.
        """
        if self._gpu is not None and self._helper is not None:
            try:
                ended = self._gpu.save(chunks)
            except Exception as exc:  # save() left no copy of the batch running
                # Reported in order with the earlier batches, which may still be copying: done()
                # ends a batch, and the worker frees blocks once every earlier batch has ended.
                self._helper.submit(_report, done, exc)
                return
            self._helper.submit(_await_save, ended, done)
            return
        if self._saver is None:  # one CPU
            error: BaseException | None = None
            try:
                for slot, block_ids in chunks:
                    self.save(slot, block_ids)
                self.wait()
            except Exception as exc:
                error = exc
            _report(done, error)
            return
        try:
            work = [(slot.numpy(), self._rows(ids)) for slot, ids in chunks]
        except ValueError as exc:  # a bad block id: nothing was copied; reported in order, as above
            self._saver.submit(_report, done, exc)
            return
        self._saver.submit(self._save_all, work, done)

    def _save_all(
        self, work: list[tuple[np.ndarray, ChunkRows]], done: Callable[[BaseException | None], object]
    ) -> None:
        """save_batch's copies on the save thread; never raises (done() gets the error), so a
        failed save cannot fail an unrelated load at the next fence."""
        error: BaseException | None = None
        try:
            for slot, rows in work:
                self._save_cpu(0, self.num_layers, slot, rows, 0)
        except Exception as exc:
            error = exc
        _report(done, error)

    def _rows(self, block_ids: Sequence[int]) -> ChunkRows:
        """Plan a CPU copy of these blocks (ValueError for an id outside the cache)."""
        ids = check_block_ids(block_ids, self.num_blocks)
        return chunk_rows(ids, one_plane=len(self.layout.plane_bytes) == 1)

    def _on_cpu(self, copy: _LayerCopy, slot: np.ndarray, rows: ChunkRows, first: int) -> None:
        """Run a CPU copy of every layer of one chunk: every second chunk between fences goes to the
        copy thread. Whole chunks, not halves: splitting one chunk costs more in hand-offs and GIL
        switches than the second core gives back."""
        self._turn += 1
        if self._helper is None or self._turn % 2:
            copy(0, self.num_layers, slot, rows, first)
        else:
            self._helper.submit(copy, 0, self.num_layers, slot, rows, first)

    # One slice assignment per run of blocks and plane (a memcpy per row; fancy indexing into a
    # temporary would copy twice). Scattered chunks are gathered (chunk_rows) with mode="clip",
    # because "raise" buffers the whole output (the ids were checked).
    def _save_cpu(self, lo: int, hi: int, slot: np.ndarray, rows: ChunkRows, first: int) -> None:
        for layer in range(lo, hi):
            dest = slot[layer]
            if rows.index is not None:
                out = dest[first : first + len(rows.index)]
                np.take(self._np_layers[layer][0], rows.index, axis=0, out=out, mode="clip")
                continue
            offset = 0
            for plane in self._np_layers[layer]:
                width = plane.shape[1]
                for j, n, blocks in rows.runs:
                    dest[first + j : first + j + n, offset : offset + width] = plane[blocks]
                offset += width

    def _load_cpu(self, lo: int, hi: int, slot: np.ndarray, rows: ChunkRows, first: int) -> None:
        for layer in range(lo, hi):
            src = slot[layer]
            if rows.index is not None:
                self._np_layers[layer][0][rows.index] = src[first : first + len(rows.index)]
                continue
            offset = 0
            for plane in self._np_layers[layer]:
                width = plane.shape[1]
                for j, n, blocks in rows.runs:
                    plane[blocks] = src[first + j : first + j + n, offset : offset + width]
                offset += width

    def load(self, slot: torch.Tensor, first: int, block_ids: Sequence[int]) -> None:
        """Copy slot block rows ``[first, first + len(block_ids))`` of every layer into the blocks;
        what runs next on the current stream (CUDA) or after wait() (CPU) sees them."""
        if self._gpu is not None:
            events = self._gpu.load([(slot, first, block_ids)])
            torch.cuda.current_stream(self.device).wait_event(events[-1])
            return
        self._on_cpu(self._load_cpu, slot.numpy(), self._rows(block_ids), first)

    def load_layers(self, chunks: Sequence[tuple[torch.Tensor, int, Sequence[int]]]) -> LayerLoads:
        """Start loading each (slot, first slot row, block ids) as load() would, layer by layer.

        On the CPU without overlap_loads (one CPU, or no CPU the model's threads leave free) the
        copies run here and the answer is already complete.
        The caller must keep the slots mapped and the blocks unread by anything but the forward's
        waited-for layers until finish() (or wait()) returns.
        """
        if self._gpu is not None:
            return _CudaLayerLoads(self._gpu.load(chunks), self.device)
        work = [(slot.numpy(), first, self._rows(ids)) for slot, first, ids in chunks]

        def copy_layer(layer: int) -> None:
            for slot, first, rows in work:
                self._load_cpu(layer, layer + 1, slot, rows, first)

        progress = _CpuLayerLoads(self.num_layers, copy_layer)
        if self._helper is not None and self.overlap_loads:
            self._helper.submit(progress.run)
        else:
            progress.run()
        return progress

    def wait(self) -> None:
        """Block until every copy issued so far has finished; CopyError if a CPU copy failed."""
        if self._gpu is not None:
            self._gpu.synchronize()
        self._turn = 0
        for thread in self._threads():
            thread.wait()

    def close(self) -> None:
        """Finish pending copies and stop the copier's threads (if any); safe to call twice."""
        for thread in self._threads():
            thread.close()

    def _threads(self) -> list[CopyThread]:
        return [t for t in (self._helper, self._saver) if t is not None]


def cuda_save_waiter(device: torch.device, cpus: frozenset[int] | None) -> CopyThread:
    """The thread that waits for a CUDA copier's save batches to end (``_await_save``), bound to the
    copier's device first: an event's synchronize on an unbound thread opens a context on device 0."""
    return CopyThread(cpus, name="kvtier-cuda-saves", on_start=functools.partial(bind_device, device))


def _report(done: Callable[[BaseException | None], object], error: BaseException | None) -> None:
    try:
        done(error)
    except Exception:  # the callback's own failure must not pass for a copy's
        log.exception("kvtier: save completion callback failed")


def _await_save(ended: torch.cuda.Event, done: Callable[[BaseException | None], object]) -> None:
    """Report a CUDA save batch once its copies have ended (save waiter thread; the GIL is free
    while it waits). Never raises: done() gets the error."""
    error: BaseException | None = None
    try:
        ended.synchronize()
    except Exception as exc:
        error = exc
    _report(done, error)
