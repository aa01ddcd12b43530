"""Block copies between vLLM's paged KV tensors on a CUDA device and the pinned arena.

A slot holds a chunk as ``[layer][block][page]`` with a block's planes (K, then V) side by side, so
no range of a slot is one range of GPU memory. Copying each (layer, plane, block) row with its own
cudaMemcpy is bound by launches, and torch's copy into a strided host view goes through pageable
memory (measured on an H100 with Llama-3.1-8B's KV: 0.05x of cudaMemcpy for saves, 0.34x for loads).

Here a chunk moves in pieces (a range of layers, every block of the chunk). A Triton kernel gathers
a piece into a GPU staging buffer laid out as the slot is, and the copy engine moves the buffer to
the slot in one cudaMemcpyAsync (loads: the same, reversed). Kernels run on one stream and DMAs on
another, over a ring of staging buffers, so the copy engine does not wait for the kernels: 0.95-0.98x
of a plain pinned cudaMemcpy both ways for a 16-chunk batch (``bench/gpu_copy.py``), against
0.85-0.91x for a kernel that reads or writes host memory itself, which also holds SMs for the whole
transfer.

A small batch is bound by the Python that issues it (each piece costs the issuing thread about
50 us against a 16 MiB DMA's 310 us), and nothing overlaps the time before its first DMA. Block
ids that step by 1 (a fresh engine's) or by -1 (vLLM's usual order once its prefix cache recycles
blocks, see ``connector.copy.block_runs``) go to the kernel as their first id and step, with no
upload; each piece switches streams with ``set_stream`` instead of a stream context. Measured on an
H200 with a 1-chunk batch, saves went from 0.68-0.70x to 0.78-0.83x of cudaMemcpy and loads from
0.76-0.77x to 0.88-0.89x. Descending ids, which used to be uploaded, then moved as fast as ascending
ones (H200, 1 chunk: saves 0.88x, loads 0.94x; uploaded ids 0.82x, 0.87x).

Who owns what: a ``CudaCopier`` owns its two streams, its staging ring and its events; the caller
(``BlockCopier``) fences with ``synchronize()``. The arena must be registered as pinned memory
(``pin_host_buffer``), or the DMAs run from pageable memory, correct but slow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from connector.copy import block_runs, check_block_ids
from connector.cuda_kernels import stage_blocks

# Staging bytes per piece, and buffers in the ring (one filling while the other is in the DMA).
# Swept on the H100 (worst of save/load, consecutive/scattered ids): 4 MiB 0.80-0.86x, 8 MiB
# 0.92x, 16 MiB 0.93x, 32 MiB 0.93-0.95x; a third buffer changed nothing. 16 MiB keeps the
# staging at 32 MiB of GPU memory and still splits an 8B model's chunk into two layer pieces, so
# the forward's first layers start while the second half loads.
PIECE_BYTES = 16 << 20
RING = 2
# A chunk's block ids as the kernel takes them: (first id, step) where they step by 1 or -1, else the
# ids on the device.
_Ids = tuple[int, int] | torch.Tensor


class CudaLayoutError(ValueError):
    """The KV planes cannot be copied by the CUDA path."""


class CudaCopier:
    """Moves whole chunks between KV planes on one CUDA device and host slots."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], blocks_per_chunk: int, num_blocks: int):
        widths = {plane.shape[1] for planes in layers for plane in planes}
        counts = {len(planes) for planes in layers}
        if len(widths) != 1 or len(counts) != 1:
            raise CudaLayoutError(f"KV planes differ in width {sorted(widths)} or count {sorted(counts)}")
        self.row_bytes = widths.pop()
        self.planes = counts.pop()
        if self.row_bytes % 8:
            raise CudaLayoutError(f"a KV plane row has {self.row_bytes} bytes; a multiple of 8 is needed")
        self.device = layers[0][0].device
        self.num_layers = len(layers)
        self.num_blocks = num_blocks
        self.page_bytes = self.planes * self.row_bytes
        layer_chunk = blocks_per_chunk * self.page_bytes
        self.layers_per_piece = max(1, min(self.num_layers, PIECE_BYTES // layer_chunk))
        self._table = torch.tensor(
            [plane.data_ptr() for planes in layers for plane in planes], dtype=torch.int64, device=self.device
        )
        self._kernels = torch.cuda.Stream(device=self.device)
        self._dma = torch.cuda.Stream(device=self.device)
        piece = self.layers_per_piece * layer_chunk
        self._ring = [torch.empty(piece, dtype=torch.uint8, device=self.device) for _ in range(RING)]
        self._ready = [torch.cuda.Event() for _ in range(RING)]  # piece in its buffer (staged or DMAed)
        self._free = [torch.cuda.Event() for _ in range(RING)]  # buffer no longer read
        self._turn = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the kernel now, not inside vLLM's first step (a Triton build takes seconds), for
        uploaded ids and for a run: each piece of block 0 goes to the stage and back, unchanged.
        (The integer arguments are not specialized on, so one row compiles what every chunk runs.)"""
        uploaded = torch.zeros(1, dtype=torch.int64, device=self.device)
        for lo, hi in self._pieces():
            stage = self._stage(0, hi - lo, 1)
            for ids in (uploaded, (0, 1)):
                for out in (True, False):
                    stage_blocks(self._table, ids, 1, stage, lo, hi - lo, self.planes, self.row_bytes, out)
        torch.cuda.synchronize(self.device)

    def _device_ids(self, id_lists: Sequence[Sequence[int]]) -> list[_Ids]:
        """Each chunk's block ids for the kernel: (first id, step) where they step by 1 or -1 (a
        prompt's usually do: no upload), else the ids, all uploaded in one copy on the kernel stream.
        Checked first: the kernel does not bound-check, and a wrong id would write over another
        request's KV."""
        lists = [check_block_ids(block_ids, self.num_blocks) for block_ids in id_lists]
        firsts = [_run_of(ids) for ids in lists]
        scattered = [b for ids, first in zip(lists, firsts, strict=True) if first is None for b in ids]
        if not scattered:
            return firsts  # type: ignore[return-value]  # no None in it
        host = torch.tensor(scattered, dtype=torch.int64).pin_memory()
        with torch.cuda.stream(self._kernels):
            uploaded = host.to(self.device, non_blocking=True)
        out: list[_Ids] = []
        at = 0
        for ids, first in zip(lists, firsts, strict=True):
            if first is None:
                out.append(uploaded[at : at + len(ids)])
                at += len(ids)
            else:
                out.append(first)
        return out

    def _pieces(self) -> list[tuple[int, int]]:
        """Layer ranges [lo, hi) of the pieces a chunk moves in."""
        step = self.layers_per_piece
        return [(lo, min(self.num_layers, lo + step)) for lo in range(0, self.num_layers, step)]

    def save(self, chunks: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> torch.cuda.Event:
        """Copy each (slot, block ids) into the slot's first rows; an event that fires when done.
        If it raises, nothing it issued is still running."""
        with self._drained_on_error():
            return self._save(chunks)

    def load(self, chunks: Sequence[tuple[torch.Tensor, int, Sequence[int]]]) -> list[torch.cuda.Event]:
        """Copy each (slot, first row, block ids) into the blocks, layer piece by layer piece; one
        event per layer, recorded once that layer of every chunk is in place. If it raises, nothing
        it issued is still running."""
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
        # The forward wrote these blocks on the compute stream: gather only after it.
        self._kernels.wait_stream(torch.cuda.current_stream(self.device))
        ids = self._device_ids([block_ids for _, block_ids in chunks])
        with self._streams():
            for (slot, block_ids), chunk_ids in zip(chunks, ids, strict=True):
                n = len(block_ids)
                for lo, hi in self._pieces():
                    k = self._next()
                    stage = self._stage(k, hi - lo, n)
                    torch.cuda.set_stream(self._kernels)
                    self._kernels.wait_event(self._free[k])
                    stage_blocks(
                        self._table, chunk_ids, n, stage, lo, hi - lo, self.planes, self.row_bytes, True
                    )
                    self._ready[k].record(self._kernels)
                    torch.cuda.set_stream(self._dma)
                    self._dma.wait_event(self._ready[k])
                    _dma(slot[lo:hi, :n], stage)
                    self._free[k].record(self._dma)
        done = torch.cuda.Event()
        done.record(self._dma)
        return done

    def _load(self, chunks: Sequence[tuple[torch.Tensor, int, Sequence[int]]]) -> list[torch.cuda.Event]:
        # vLLM may still be writing freshly allocated blocks on the compute stream: scatter after it.
        self._kernels.wait_stream(torch.cuda.current_stream(self.device))
        ids = self._device_ids([block_ids for _, _, block_ids in chunks])
        events: list[torch.cuda.Event] = []
        with self._streams():
            for lo, hi in self._pieces():
                for (slot, first, block_ids), chunk_ids in zip(chunks, ids, strict=True):
                    n = len(block_ids)
                    k = self._next()
                    stage = self._stage(k, hi - lo, n)
                    torch.cuda.set_stream(self._dma)
                    self._dma.wait_event(self._free[k])
                    _dma(stage, slot[lo:hi, first : first + n])
                    self._ready[k].record(self._dma)
                    torch.cuda.set_stream(self._kernels)
                    self._kernels.wait_event(self._ready[k])
                    stage_blocks(
                        self._table, chunk_ids, n, stage, lo, hi - lo, self.planes, self.row_bytes, False
                    )
                    self._free[k].record(self._kernels)
                layer_done = torch.cuda.Event()
                layer_done.record(self._kernels)
                events.extend([layer_done] * (hi - lo))
        return events

    @contextlib.contextmanager
    def _streams(self) -> Iterator[None]:
        """Give the caller's stream back after a batch that switched streams per piece with
        ``torch.cuda.set_stream`` (a stream context, an event wait and a record took 12 us together
        on the issuing thread, twice per piece)."""
        caller = torch.cuda.current_stream(self.device)
        try:
            yield
        finally:
            torch.cuda.set_stream(caller)

    def synchronize(self) -> None:
        """Block until every copy issued so far has ended."""
        self._kernels.synchronize()
        self._dma.synchronize()

    def _next(self) -> int:
        k = self._turn % RING
        self._turn += 1
        return k

    def _stage(self, k: int, layers: int, rows: int) -> torch.Tensor:
        return self._ring[k][: layers * rows * self.page_bytes].view(layers, rows, self.page_bytes)


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
