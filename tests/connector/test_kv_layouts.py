"""BlockCopier copies whole blocks of the KV views vLLM itself builds, in every KVCacheLayout.

The views come from vLLM's own ``get_kv_cache_config_from_groups`` (the KVCacheTensor strides) and
``create_kv_cache_views``, over a flat int8 buffer of random bytes. The expected page of (layer,
block) is derived here from the view's strides alone: the bytes of every element of that block, in
increasing address order, which is the block's dense rows concatenated in address order.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.bench.kv_views import kv_cache_views, mla_kv_cache_views
from kvtier.connector.copy import BlockCopier
from kvtier.connector.layout import LayoutError
from tests.connector.vllm_kv import kv_cache_config, views_of

NUM_LAYERS, NUM_BLOCKS, BLOCKS_PER_CHUNK = 3, 16, 4
HEADS, HEAD_SIZE, MLA_HEAD_SIZE = 2, 64, 576
TWO_CPUS = frozenset({0, 1})  # a copy thread beside the caller's (the binding is best effort)


@dataclass(frozen=True)
class Case:
    """One way vLLM lays out a model's KV: a spec, a layout and a kernel block size."""

    spec: str  # "full", "mla" or "mla-padded"
    layout: KVCacheLayout
    block_size: int = 16
    kernel_block_size: int | None = None

    @property
    def id(self) -> str:
        split = f"-kernel{self.kernel_block_size}" if self.kernel_block_size else ""
        return f"{self.spec}-{self.layout.name}-block{self.block_size}{split}"

    def kv_spec(self) -> KVCacheSpec:
        if self.spec == "full":
            return FullAttentionSpec(
                block_size=self.block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
            )
        # DeepSeek-V4's alignment pads each page (18 KiB here) to the next multiple of 4 KiB.
        alignment = 4096 if self.spec == "mla-padded" else None
        return MLAAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=1,
            head_size=MLA_HEAD_SIZE,
            dtype=torch.bfloat16,
            alignment=alignment,
        )


CASES = [
    *(Case("full", layout) for layout in KVCacheLayout),
    # vLLM splits blocks into kernel blocks only where a block is one dense page: LBHNC and LBNHC.
    Case("full", KVCacheLayout.LBHNC, 32, 16),
    Case("full", KVCacheLayout.LBNHC, 32, 16),
    *(Case("mla", layout) for layout in KVCacheLayout),
    Case("mla-padded", KVCacheLayout.LBNHC),
    Case("mla-padded", KVCacheLayout.BLHNC),
]
CASE_PARAMS = [pytest.param(case, id=case.id) for case in CASES]
# Chunks of block ids as the scheduler hands them out; the last one fills only part of a chunk.
ID_LISTS = {
    "ascending": [3, 4, 5, 6],
    "descending": [9, 8, 7, 6],
    "scattered": [12, 0, 7, 3],
    "partial": [5, 2],
}


def vllm_views(case: Case, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM's raw int8 buffer (random bytes) and its per-layer views, as allocate_kv_cache makes them."""
    names = [f"model.layers.{i}.attn" for i in range(NUM_LAYERS)]
    spec = case.kv_spec()
    config = kv_cache_config(names, spec, case.layout, NUM_BLOCKS)
    return views_of(config, spec, case.layout, seed, case.kernel_block_size)


def page_addresses(raw: torch.Tensor, views: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[layer, block, page byte]``: where in ``raw`` each byte of each page lies, in address
    order within the page (computed from the views' strides, whatever kvtier makes of them)."""
    index = torch.arange(raw.numel(), dtype=torch.int64)
    pages = []
    for view in views:
        as_bytes = view.view(torch.int8)
        where = index.as_strided(
            as_bytes.shape, as_bytes.stride(), as_bytes.storage_offset() - raw.storage_offset()
        )
        blocks = where.reshape(NUM_BLOCKS, -1)  # a block's kernel blocks are consecutive rows of dim 0
        pages.append(blocks.sort(dim=1).values)
    table = torch.stack(pages)
    assert table.flatten().unique().numel() == table.numel()  # no byte in two pages
    return table


def _random_slot(copier: BlockCopier, seed: int) -> torch.Tensor:
    """A slot over a host buffer of its own (the tensor keeps the buffer alive), of random bytes."""
    slot = copier.slot_view(bytearray(copier.chunk_bytes))
    gen = torch.Generator().manual_seed(seed)
    slot.copy_(torch.randint(0, 256, slot.shape, dtype=torch.uint8, generator=gen))
    return slot


@pytest.mark.parametrize("ids", list(ID_LISTS.values()), ids=list(ID_LISTS))
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_a_saved_slot_row_is_the_block_page_in_address_order(case: Case, ids: list[int]) -> None:
    raw, views = vllm_views(case)
    before = raw.clone()
    table = page_addresses(raw, views)
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    try:
        assert copier.layout.page_bytes == table.shape[2]
        assert copier.chunk_bytes == NUM_LAYERS * BLOCKS_PER_CHUNK * table.shape[2]
        slot = _random_slot(copier, seed=1)
        untouched = slot[:, len(ids) :].clone()
        copier.save(slot, ids)
        copier.wait()
    finally:
        copier.close()
    for layer in range(NUM_LAYERS):
        for row, block in enumerate(ids):
            assert torch.equal(slot[layer, row], raw[table[layer, block]].view(torch.uint8)), (
                layer,
                row,
                block,
            )
    assert torch.equal(slot[:, len(ids) :], untouched)  # rows past the chunk's blocks stay as they were
    assert torch.equal(raw, before)  # a save only reads the KV


@pytest.mark.parametrize("ids", list(ID_LISTS.values()), ids=list(ID_LISTS))
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_a_loaded_slot_row_lands_in_its_block_and_nowhere_else(case: Case, ids: list[int]) -> None:
    raw, views = vllm_views(case)
    table = page_addresses(raw, views)
    first = BLOCKS_PER_CHUNK - len(ids)  # the partial chunk loads from a row past the first
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    try:
        slot = _random_slot(copier, seed=2)
        before = raw.clone()
        want = raw.clone()
        for layer in range(NUM_LAYERS):
            for row, block in enumerate(ids, start=first):
                want[table[layer, block]] = slot[layer, row].view(torch.int8)
        copier.load(slot, first, ids)
        copier.wait()
    finally:
        copier.close()
    assert not torch.equal(want, before)  # the load has bytes to change
    assert torch.equal(raw, want)  # the blocks hold the slot's rows; every other byte is unchanged


@pytest.mark.parametrize("helper_cpus", [None, TWO_CPUS], ids=["one-thread", "copy-thread"])
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_a_save_batch_then_layer_loads_move_blocks_to_other_blocks(
    case: Case, helper_cpus: frozenset[int] | None
) -> None:
    raw, views = vllm_views(case)
    table = page_addresses(raw, views)
    chunks = {(11, 3, 7, 0): (1, 2, 4, 5), (15, 14, 13): (8, 9, 10)}  # saved blocks: blocks loaded into
    copier = BlockCopier(views, NUM_BLOCKS, BLOCKS_PER_CHUNK, helper_cpus=helper_cpus, overlap_loads=True)
    outcomes: list[BaseException | None] = []
    try:
        slots = [_random_slot(copier, seed) for seed in range(len(chunks))]
        want = raw.clone()
        for saved, loaded in chunks.items():
            for layer in range(NUM_LAYERS):
                for src, dst in zip(saved, loaded, strict=True):
                    want[table[layer, dst]] = raw[table[layer, src]]
        copier.save_batch(
            [(slot, list(saved)) for slot, saved in zip(slots, chunks, strict=True)], outcomes.append
        )
        copier.wait()
        assert outcomes == [None]
        loads = copier.load_layers(
            [(slot, 0, list(loaded)) for slot, loaded in zip(slots, chunks.values(), strict=True)]
        )
        for layer in range(NUM_LAYERS):
            loads.wait_layer(layer)
            for loaded in chunks.values():
                for dst in loaded:  # layers 0..layer are in place once wait_layer(layer) returns
                    assert torch.equal(raw[table[layer, dst]], want[table[layer, dst]])
        assert loads.finish() is None
        copier.wait()
    finally:
        copier.close()
    assert torch.equal(raw, want)


def _overlapping_blocks() -> torch.Tensor:
    """Blocks 128 bytes apart, each spanning 8 KiB: every block shares bytes with the next ones."""
    raw = torch.zeros(64 << 10, dtype=torch.bfloat16)
    return raw.as_strided((NUM_BLOCKS, 2, 16, 128), (64, 16 * 128, 128, 1))


def _no_leading_block_dim() -> torch.Tensor:
    """A layer whose first dimension is not a multiple of the block count."""
    return torch.zeros(NUM_BLOCKS + 1, 2, 16, 128, dtype=torch.bfloat16)


@pytest.mark.parametrize("make", [_overlapping_blocks, _no_leading_block_dim])
def test_a_view_that_is_not_whole_blocks_is_refused_naming_its_shape(make) -> None:
    kv = make()
    with pytest.raises(LayoutError) as refused:
        BlockCopier([kv, kv], NUM_BLOCKS, BLOCKS_PER_CHUNK)
    message = str(refused.value)
    assert str(tuple(kv.shape)) in message
    if make is _overlapping_blocks:
        assert str(tuple(kv.stride())) in message


def _replica(case: Case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """bench.kv_views' rebuild of the views of one case."""
    if case.spec == "full":
        return kv_cache_views(
            NUM_LAYERS, NUM_BLOCKS, case.block_size, HEADS, HEAD_SIZE, torch.bfloat16, case.layout.name,
            "cpu", case.kernel_block_size,
        )  # fmt: skip
    return mla_kv_cache_views(
        NUM_LAYERS, NUM_BLOCKS, case.block_size, MLA_HEAD_SIZE, torch.bfloat16, case.layout.name, "cpu",
        case.kernel_block_size,
    )  # fmt: skip


@pytest.mark.parametrize("kernel_block_size", [None, 16], ids=["whole-blocks", "kernel16"])
@pytest.mark.parametrize("spec", ["full", "mla"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=[layout.name for layout in KVCacheLayout])
def test_the_torch_replica_builds_the_views_vllm_builds(
    layout: KVCacheLayout, spec: str, kernel_block_size: int | None
) -> None:
    case = Case(spec, layout, block_size=32, kernel_block_size=kernel_block_size)
    try:
        raw, views = vllm_views(case)
    except ValueError:  # vLLM refuses to split this layout's blocks: so must the replica
        with pytest.raises(ValueError):
            _replica(case)
        return
    their_raw, theirs = _replica(case)
    assert (their_raw.numel(), their_raw.dtype) == (raw.numel(), raw.dtype)
    for ours, vllms in zip(theirs, views, strict=True):
        assert ours.shape == vllms.shape
        assert ours.stride() == vllms.stride()
        assert ours.dtype == vllms.dtype
        assert ours.storage_offset() == vllms.storage_offset()


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC])
def test_the_torch_replica_pads_pages_as_vllm_does(layout: KVCacheLayout) -> None:
    """DeepSeek's fp8 MLA page (656 bytes a token, block 64) padded to a multiple of 576 bytes."""
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=656, dtype=torch.uint8, alignment=576)
    names = [f"model.layers.{i}.attn" for i in range(NUM_LAYERS)]
    raw, views = views_of(kv_cache_config(names, spec, layout, NUM_BLOCKS), spec, layout)
    their_raw, theirs = mla_kv_cache_views(
        NUM_LAYERS, NUM_BLOCKS, 64, 656, torch.uint8, layout.name, "cpu", alignment=576
    )
    assert their_raw.numel() == raw.numel() == NUM_LAYERS * NUM_BLOCKS * spec.page_size_bytes
    for ours, vllms in zip(theirs, views, strict=True):
        assert (ours.shape, ours.stride(), ours.dtype) == (vllms.shape, vllms.stride(), vllms.dtype)
        assert ours.storage_offset() == vllms.storage_offset()
