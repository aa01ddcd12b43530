"""Block copies between vLLM's paged KV tensors on a CUDA device and the pinned arena.

Who owns what: a ``CudaCopier`` owns its lanes (streams, staging ring, events); the caller
(``BlockCopier``) fences with ``synchronize()``.
Design: docs/internals.md#cuda-copies-copy_cudapy-stagingpy-pinningpy
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from kvtier.connector.block_ids import aligned_starts, block_runs, check_block_ids
from kvtier.connector.cuda_kernels import stage_blocks
from kvtier.connector.staging import RING, StagingError, layers_per_piece

# A chunk's block ids as the kernel takes them: (first id, step) where they step by 1 or -1, else the
# ids on the device.
_Ids = tuple[int, int] | torch.Tensor


class CudaLayoutError(ValueError):
    """The KV planes cannot be copied by the CUDA path."""


def _priorities() -> tuple[int, int]:
    """CUDA's (lowest, highest) stream priority; lower numbers run first."""
    try:
        low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        return int(low), int(high)
    except (AttributeError, RuntimeError):
        return 0, -1


class _Lane:
    """A kernel stream, a DMA stream and a staging ring: the resources of one direction of copies."""

    def __init__(self, device: torch.device, piece_bytes: int, priority: int) -> None:
        self.kernels = torch.cuda.Stream(device=device, priority=priority)
        self.dma = torch.cuda.Stream(device=device, priority=priority)
        self.ring = [torch.empty(piece_bytes, dtype=torch.uint8, device=device) for _ in range(RING)]
        self.ready = [torch.cuda.Event() for _ in range(RING)]  # piece in its buffer (staged or DMAed)
        self.free = [torch.cuda.Event() for _ in range(RING)]  # buffer no longer read
        self._turn = 0

    def next(self) -> int:
        """The ring buffer the next piece uses."""
        k = self._turn % RING
        self._turn += 1
        return k

    def ended(self) -> torch.cuda.Event:
        """A blocking event that fires once everything issued on both streams so far has ended."""
        self.dma.wait_stream(self.kernels)
        done = torch.cuda.Event(blocking=True)
        done.record(self.dma)
        return done


class CudaCopier:
    """Moves whole chunks between KV planes on one CUDA device and host slots."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], blocks_per_chunk: int, num_blocks: int):
        widths = {plane.shape[1] for planes in layers for plane in planes}
        counts = {len(planes) for planes in layers}
        strides = {plane.stride(0) for planes in layers for plane in planes}
        if len(widths) != 1 or len(counts) != 1 or len(strides) != 1:
            raise CudaLayoutError(
                f"KV planes differ in width {sorted(widths)}, count {sorted(counts)} "
                f"or block stride {sorted(strides)}"
            )
        self.row_bytes, self.planes, self.block_stride = widths.pop(), counts.pop(), strides.pop()
        addresses = [plane.data_ptr() for planes in layers for plane in planes]
        if self.row_bytes % 8 or self.block_stride % 8 or any(a % 8 for a in addresses):
            raise CudaLayoutError(
                f"KV rows of {self.row_bytes} bytes, {self.block_stride} apart, are not 8-byte aligned"
            )
        self.device = layers[0][0].device
        self.num_layers = len(layers)
        self.num_blocks = num_blocks
        self.page_bytes = self.planes * self.row_bytes
        layer_chunk = blocks_per_chunk * self.page_bytes
        try:  # from the headroom vLLM leaves: its KV cache is sized before connectors register
            free = torch.cuda.mem_get_info(self.device)[0]
            self.layers_per_piece = layers_per_piece(layer_chunk, self.num_layers, free)
        except StagingError as exc:
            raise CudaLayoutError(str(exc)) from exc
        self._table = torch.tensor(addresses, dtype=torch.int64, device=self.device)
        piece = self.layers_per_piece * layer_chunk
        low, high = _priorities()
        self._saves = _Lane(self.device, piece, low)
        self._loads = _Lane(self.device, piece, high)
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the kernel now, not inside vLLM's first step (a Triton build takes seconds), for
        uploaded ids and for a run: each piece of block 0 goes to the stage and back, unchanged."""
        uploaded = torch.zeros(1, dtype=torch.int64, device=self.device)
        for lo, hi in self._pieces():
            stage = self._stage(self._saves, 0, hi - lo, 1)
            for ids in (uploaded, (0, 1)):
                for out in (True, False):
                    self._kernel(ids, 1, stage, lo, hi - lo, out)
        torch.cuda.synchronize(self.device)

    def _kernel(self, ids: _Ids, rows: int, stage: torch.Tensor, lo: int, layers: int, out: bool) -> None:
        stage_blocks(
            self._table, ids, rows, stage, lo, layers, self.planes, self.row_bytes, self.block_stride, out
        )

    def _device_ids(self, lane: _Lane, id_lists: Sequence[Sequence[int]]) -> list[_Ids]:
        """Each chunk's block ids for the kernel: (first id, step) where they step by 1 or -1 (no
        upload), else the ids, all uploaded in one copy on the lane's kernel stream. Checked first:
        the kernel does not bound-check, and a wrong id would write over another request's KV."""
        lists = [check_block_ids(block_ids, self.num_blocks) for block_ids in id_lists]
        firsts = [_run_of(ids) for ids in lists]
        scattered = [ids for ids, first in zip(lists, firsts, strict=True) if first is None]
        if not scattered:
            return firsts  # type: ignore[return-value]  # no None in it
        # Each chunk's ids start 16-byte aligned, as the warm-up's do: no kernel variant is met first
        # inside a step (aligned_starts).
        starts, total = aligned_starts([len(ids) for ids in scattered])
        padded = [0] * total
        for start, ids in zip(starts, scattered, strict=True):
            padded[start : start + len(ids)] = ids
        host = torch.tensor(padded, dtype=torch.int64).pin_memory()
        with torch.cuda.stream(lane.kernels):
            uploaded = host.to(self.device, non_blocking=True)
        out: list[_Ids] = []
        views = iter(uploaded[start : start + len(ids)] for start, ids in zip(starts, scattered, strict=True))
        for first in firsts:
            out.append(next(views) if first is None else first)
        return out

    def _pieces(self) -> list[tuple[int, int]]:
        """Layer ranges [lo, hi) of the pieces a chunk moves in."""
        step = self.layers_per_piece
        return [(lo, min(self.num_layers, lo + step)) for lo in range(0, self.num_layers, step)]

    def save(self, chunks: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> torch.cuda.Event:
        """Copy each (slot, block ids) into the slot's first rows; a blocking event that fires when
        done. If it raises, nothing it issued is still running."""
        with self._drained_on_error():
            return self._save(chunks)

    def load(self, chunks: Sequence[tuple[torch.Tensor, int, Sequence[int]]]) -> list[torch.cuda.Event]:
        """Copy each (slot, first row, block ids) into the blocks, layer piece by layer piece; one
        event per layer, recorded once that layer of every chunk is in place (the last one
        blocking). If it raises, nothing it issued is still running."""
        with self._drained_on_error():
            return self._load(chunks)

    @contextlib.contextmanager
    def _drained_on_error(self) -> Iterator[None]:
        # The caller gives the slots back (or lets the forward recompute the blocks) once a call
        # fails: a copy still queued would then write into memory that is no longer ours.
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.synchronize()
            raise

    def _save(self, chunks: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> torch.cuda.Event:
        lane = self._saves
        # The forward wrote these blocks on the compute stream: gather only after it.
        lane.kernels.wait_stream(torch.cuda.current_stream(self.device))
        ids = self._device_ids(lane, [block_ids for _, block_ids in chunks])
        with self._streams():
            for (slot, block_ids), chunk_ids in zip(chunks, ids, strict=True):
                n = len(block_ids)
                for lo, hi in self._pieces():
                    k = lane.next()
                    stage = self._stage(lane, k, hi - lo, n)
                    torch.cuda.set_stream(lane.kernels)
                    lane.kernels.wait_event(lane.free[k])
                    self._kernel(chunk_ids, n, stage, lo, hi - lo, True)
                    lane.ready[k].record(lane.kernels)
                    torch.cuda.set_stream(lane.dma)
                    lane.dma.wait_event(lane.ready[k])
                    _dma(slot[lo:hi, :n], stage)
                    lane.free[k].record(lane.dma)
        return lane.ended()

    def _load(self, chunks: Sequence[tuple[torch.Tensor, int, Sequence[int]]]) -> list[torch.cuda.Event]:
        lane = self._loads
        # vLLM may still be writing freshly allocated blocks on the compute stream: scatter after it.
        lane.kernels.wait_stream(torch.cuda.current_stream(self.device))
        ids = self._device_ids(lane, [block_ids for _, _, block_ids in chunks])
        events: list[torch.cuda.Event] = []
        with self._streams():
            for lo, hi in self._pieces():
                for (slot, first, block_ids), chunk_ids in zip(chunks, ids, strict=True):
                    n = len(block_ids)
                    k = lane.next()
                    stage = self._stage(lane, k, hi - lo, n)
                    torch.cuda.set_stream(lane.dma)
                    lane.dma.wait_event(lane.free[k])
                    _dma(stage, slot[lo:hi, first : first + n])
                    lane.ready[k].record(lane.dma)
                    torch.cuda.set_stream(lane.kernels)
                    lane.kernels.wait_event(lane.ready[k])
                    self._kernel(chunk_ids, n, stage, lo, hi - lo, False)
                    lane.free[k].record(lane.kernels)
                layer_done = torch.cuda.Event(blocking=hi == self.num_layers)
                layer_done.record(lane.kernels)
                events.extend([layer_done] * (hi - lo))
        return events

    @contextlib.contextmanager
    def _streams(self) -> Iterator[None]:
        """Give the caller's stream back after a batch that switched streams per piece with
        ``torch.cuda.set_stream``, which costs the issuing thread less than a stream context."""
        caller = torch.cuda.current_stream(self.device)
        try:
            yield
        finally:
            torch.cuda.set_stream(caller)

    def synchronize(self) -> None:
        """Block until every copy issued so far has ended (sleeping on blocking events)."""
        ended = [self._saves.ended(), self._loads.ended()]
        for event in ended:
            event.synchronize()

    def _stage(self, lane: _Lane, k: int, layers: int, rows: int) -> torch.Tensor:
        return lane.ring[k][: layers * rows * self.page_bytes].view(layers, rows, self.page_bytes)


def _run_of(ids: list[int]) -> tuple[int, int] | None:
    """(first id, step) when the ids are one run stepping by 1 or by -1 ((0, 1) for none), else None."""
    runs = block_runs(ids)
    if len(runs) > 1:
        return None
    rows = runs[0][2] if runs else slice(0, 0)
    return rows.start, rows.step or 1


def _dma(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One cudaMemcpyAsync when both sides are contiguous, else one per layer (each contiguous: a
    chunk's rows of one layer are consecutive in the slot and in the stage)."""
    if dst.is_contiguous() and src.is_contiguous():
        dst.copy_(src, non_blocking=True)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=True)
