"""The layout round trips of ``tools.gpu_check``, and the byte bookkeeping its other checks share.

A round trip builds vLLM's views of one layout (``bench.kv_views``) on the device, fills them with
random bytes, saves chunks of block ids into a host slot and checks every slot row against the page
the views' strides say it holds; then loads random slot rows into blocks and checks that the whole
raw buffer changed exactly there. Runs on CUDA (pinned slots) and on the CPU alike.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvtier.bench.kv_views import LAYOUTS, kv_cache_views, mla_kv_cache_views, page_addresses
from kvtier.connector.copy import BlockCopier
from kvtier.connector.pinning import pin_host_buffer, unpin_host_buffer

NUM_LAYERS, NUM_BLOCKS, BLOCKS_PER_CHUNK = 3, 16, 4
HEADS, HEAD_SIZE, MLA_HEAD_SIZE = 2, 64, 576
# Chunks of block ids as the scheduler hands them out; the last one fills only part of a chunk.
ID_LISTS = {
    "ascending": [3, 4, 5, 6],
    "descending": [9, 8, 7, 6],
    "scattered": [12, 0, 7, 3],
    "partial": [5, 2],
}


# page_addresses of each (layer, block).
Table = dict[tuple[int, int], torch.Tensor]


class CheckFailed(AssertionError):
    """A check found the copier doing something other than its contract says."""


class Skipped(Exception):
    """A check cannot run here (its reason is the message)."""


def expect(ok: bool, why: str) -> None:
    """Fail the check with ``why`` unless ``ok``."""
    if not ok:
        raise CheckFailed(why)


# An fp8 MLA page as DeepSeek's sparse attention keeps it: 656 bytes a token (the latent in fp8, its
# scales, the rope part in bf16), padded to a multiple of 576 bytes (41,984 of 42,048 at block 64).
FP8_MLA_TOKEN_BYTES, FP8_MLA_ALIGNMENT = 656, 576


@dataclass(frozen=True)
class Case:
    """One way vLLM lays out a model's KV: full attention or MLA, a layout, a kernel block size, the
    KV dtype (fp8 is kept in one-byte elements), the KV heads, and MLA's page alignment."""

    mla: bool
    layout: str
    block_size: int = 16
    kernel_block_size: int | None = None
    fp8: bool = False
    heads: int = HEADS
    padded: bool = False  # MLA: DeepSeek's fp8 page, padded to FP8_MLA_ALIGNMENT

    @property
    def name(self) -> str:
        split = f"-kernel{self.kernel_block_size}" if self.kernel_block_size else ""
        more = f"-block{self.block_size}" if self.block_size != 16 else ""
        more += "-fp8" if self.fp8 else ""
        more += f"-{self.heads}heads" if self.heads != HEADS and not self.mla else ""
        more += "-padded" if self.padded else ""
        return f"{'mla' if self.mla else 'full'}-{self.layout}{split}{more}"

    def build(
        self, device: torch.device, num_blocks: int = NUM_BLOCKS
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """vLLM's raw int8 buffer and per-layer views for this case, on ``device``."""
        dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        if self.padded:
            return mla_kv_cache_views(
                NUM_LAYERS, num_blocks, self.block_size, FP8_MLA_TOKEN_BYTES, torch.uint8, self.layout,
                device, alignment=FP8_MLA_ALIGNMENT,
            )  # fmt: skip
        if self.mla:
            return mla_kv_cache_views(
                NUM_LAYERS, num_blocks, self.block_size, MLA_HEAD_SIZE, dtype, self.layout,
                device, self.kernel_block_size,
            )  # fmt: skip
        return kv_cache_views(
            NUM_LAYERS, num_blocks, self.block_size, self.heads, HEAD_SIZE, dtype, self.layout,
            device, self.kernel_block_size,
        )  # fmt: skip


# vLLM splits blocks into kernel blocks only where a block is one dense page: LBHNC and LBNHC.
CASES = [
    *(Case(False, layout) for layout in LAYOUTS),
    Case(False, "LBHNC", 32, 16),
    Case(False, "LBNHC", 32, 16),
    *(Case(True, layout) for layout in LAYOUTS),
    # What GPU engines run beyond the defaults: fp8 KV in blocks of 64, DeepSeek's padded fp8 MLA
    # page, and many KV heads where each head's rows lie apart (one plane per head).
    Case(False, "LBNHC", 64, fp8=True),
    Case(True, "LBNHC", 64, fp8=True),
    Case(True, "LBNHC", 64, padded=True),
    Case(True, "BLHNC", 64, padded=True),
    Case(False, "LHBNC", heads=8),
    Case(False, "BHLNC", 64, fp8=True, heads=8),
]


def address_table(views: list[torch.Tensor], num_blocks: int, blocks: list[int]) -> Table:
    """page_addresses of each (layer, block) of these blocks."""
    return {
        (layer, block): page_addresses(view, num_blocks, block)
        for layer, view in enumerate(views)
        for block in blocks
    }


def random_bytes(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    """Random uint8 bytes, the same for a seed on any device."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)


@contextlib.contextmanager
def host_slots(copier: BlockCopier, count: int) -> Iterator[list[torch.Tensor]]:
    """``count`` slots in one host buffer, registered as pinned where CUDA is (as the worker's arena
    is). A bytearray, not a mapping: the slots may outlive the block, and a mapping cannot close
    under a tensor."""
    buf = bytearray(count * copier.chunk_bytes)
    view = memoryview(buf)
    pinned = pin_host_buffer(view, copier.device, copier.chunk_bytes)
    try:
        size = copier.chunk_bytes
        yield [copier.slot_view(view[i * size : (i + 1) * size]) for i in range(count)]
    finally:
        unpin_host_buffer(pinned, copier.device)


def check_saved(
    slot: torch.Tensor,
    raw: torch.Tensor,
    table: Table,
    ids: list[int],
    what: str,
) -> None:
    """Every row of the slot holds the page of its block, in every layer."""
    layers = slot.shape[0]
    for layer in range(layers):
        for row, block in enumerate(ids):
            page = raw[table[layer, block]].view(torch.uint8).cpu()
            expect(
                torch.equal(slot[layer, row], page), f"{what}: layer {layer} row {row} is not block {block}"
            )


def roundtrip(case: Case, device: torch.device) -> None:
    """Save each chunk of ID_LISTS and check the slot's bytes; load random rows and check the KV's."""
    raw, views = case.build(device)
    raw.view(torch.uint8).copy_(random_bytes(tuple(raw.shape), device, seed=0))
    table = address_table(views, NUM_BLOCKS, list(range(NUM_BLOCKS)))
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    try:
        expect(copier.layout.page_bytes == table[0, 0].numel(), f"page of {copier.layout.page_bytes} bytes")
        with host_slots(copier, 1) as (slot,):
            for seed, (pattern, ids) in enumerate(ID_LISTS.items(), start=1):
                _save_one(copier, slot, raw, table, ids, f"save {pattern}", seed)
                _load_one(copier, slot, raw, table, ids, f"load {pattern}", seed)
    finally:
        copier.close()


def _save_one(
    copier: BlockCopier,
    slot: torch.Tensor,
    raw: torch.Tensor,
    table: Table,
    ids: list[int],
    what: str,
    seed: int,
) -> None:
    slot.copy_(random_bytes(tuple(slot.shape), torch.device("cpu"), seed))
    untouched = slot[:, len(ids) :].clone()
    before = raw.clone()
    copier.save(slot, ids)
    copier.wait()
    check_saved(slot, raw, table, ids, what)
    expect(torch.equal(slot[:, len(ids) :], untouched), f"{what}: rows past the chunk's blocks changed")
    expect(torch.equal(raw, before), f"{what}: the save changed the KV")


def _load_one(
    copier: BlockCopier,
    slot: torch.Tensor,
    raw: torch.Tensor,
    table: Table,
    ids: list[int],
    what: str,
    seed: int,
) -> None:
    slot.copy_(random_bytes(tuple(slot.shape), torch.device("cpu"), seed + 100))
    first = copier.blocks_per_chunk - len(ids)  # a partial chunk loads from a row past the first
    want = raw.clone()
    for layer in range(slot.shape[0]):
        for row, block in enumerate(ids, start=first):
            want[table[layer, block]] = slot[layer, row].view(torch.int8).to(raw.device)
    copier.load(slot, first, ids)
    copier.wait()
    expect(torch.equal(raw, want), f"{what}: the KV differs from the slot's rows in its blocks, or elsewhere")


def layout_checks() -> list[tuple[str, Callable[[torch.device], None]]]:
    """One round trip check per case, named after it."""
    return [(f"roundtrip {case.name}", functools.partial(roundtrip, case)) for case in CASES]
