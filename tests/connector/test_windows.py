"""Sliding-window groups of hybrid engines: which blocks a chunk holds, which a save may read and which
a load fills, against vLLM's own rule for the blocks a window frees (its SlidingWindowManager)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

from kvtier.connector.copy import BlockCopier
from kvtier.connector.group_copy import GroupedCopier
from kvtier.connector.planning import (
    NULL_BLOCK,
    Geometry,
    external_tokens,
    group_load_ids,
    group_save_ids,
    load_spans,
    stored_first_block,
    window_first_block,
)

# Block size, blocks per chunk, sliding window, extra retained tokens.
GEOMETRY_AND_WINDOW = (st.sampled_from([16, 32]), st.integers(1, 8), st.integers(1, 600), st.integers(0, 3))


def _vllm_first_block(num_tokens: int, window: int, extra: int, block_size: int) -> int:
    """The first block vLLM keeps after ``num_tokens``: its own get_num_skipped_tokens, whole blocks."""
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=extra)
    return SlidingWindowManager.get_num_skipped_tokens(manager, num_tokens) // block_size  # type: ignore[arg-type]


@given(st.integers(0, 5000), st.integers(1, 700), st.integers(0, 4), st.sampled_from([16, 32, 64]))
def test_the_first_kept_block_is_vllms(num_tokens: int, window: int, extra: int, block: int) -> None:
    assert window_first_block(num_tokens, window - 1 + extra, block) == _vllm_first_block(
        num_tokens, window, extra, block
    )
    assert window_first_block(num_tokens, None, block) == 0  # full attention frees nothing


@given(*GEOMETRY_AND_WINDOW, st.integers(2, 2000), st.integers(1, 40), st.integers(0, 10))
def test_every_block_vllm_allocates_for_a_load_is_one_a_chunk_holds(
    block: int, bpc: int, window: int, extra: int, num_tokens: int, hit_chunks: int, local_blocks: int
) -> None:
    """Whatever the prompt, the hit and vLLM's own prefix-cache hit, the blocks vLLM allocates inside
    the window of the loaded prefix's end lie where the chunks keep their windowed blocks."""
    geo = Geometry(block, block * bpc)
    hit_chunks = min(hit_chunks, num_tokens // geo.chunk_size)
    local = min(local_blocks * block, (num_tokens - 1) // block * block)
    ext = external_tokens(hit_chunks, local, num_tokens, geo)
    if ext == 0:
        return
    end = local + ext
    reach = window - 1 + extra
    kept = _vllm_first_block(end, window, extra, block)
    # vLLM's block table for the request: nulls outside the window, block ids from 1 inside it.
    table = [NULL_BLOCK if b < kept else 1 + b for b in range(end // block)]
    for span in load_spans(local, ext, geo):
        ids = table[span.table_start : span.table_start + span.count]
        first, loaded = group_load_ids(ids, span.first, span.chunk, geo, reach)
        assert NULL_BLOCK not in loaded and len(loaded) == sum(b != NULL_BLOCK for b in ids)
        if loaded:
            assert first >= stored_first_block(span.chunk, geo, reach)


@given(*GEOMETRY_AND_WINDOW, st.integers(0, 30), st.integers(0, 3000))
def test_a_save_reads_only_blocks_vllm_still_holds(
    block: int, bpc: int, window: int, extra: int, chunk: int, computed: int
) -> None:
    """A chunk is saved only if none of the blocks it holds were freed by the time of the save, and
    its copy reads only those blocks (the rest of its rows repeat the first held block)."""
    geo = Geometry(block, block * bpc)
    reach = window - 1 + extra
    freed = _vllm_first_block(computed, window, extra, block)
    table = [NULL_BLOCK if b < freed else 100 + b for b in range((chunk + 1) * bpc)]
    ids = table[chunk * bpc :]
    held = stored_first_block(chunk, geo, reach)
    got = group_save_ids(ids, chunk, geo, reach, computed)
    if chunk * bpc + held < freed:
        assert got is None
        return
    assert got is not None and len(got) == bpc
    assert got[held:] == ids[held:] and set(got[:held]) <= {ids[held]}
    assert NULL_BLOCK not in got


def test_a_chunk_holds_the_window_of_its_end_and_of_one_block_short() -> None:
    geo = Geometry(32, 256)  # 8 blocks a chunk
    # A window of 128 tokens (reach 127): a load ending at chunk 1's end, or a block short of it.
    assert stored_first_block(1, geo, 127) == 3  # (512 - 32 - 127) // 32 - 8
    assert stored_first_block(1, geo, None) == 0
    assert stored_first_block(0, Geometry(32, 64), 63) == 0  # the e2e model's geometry: every block


def test_full_attention_groups_save_and_load_every_block_as_given() -> None:
    geo = Geometry(16, 64)
    assert group_save_ids([0, 5, 6, 7], 0, geo, None, 10_000) == [0, 5, 6, 7]
    assert group_load_ids([0, 5, 6], 1, 0, geo, None) == (1, [0, 5, 6])


def test_a_load_that_would_read_blocks_no_chunk_holds_is_refused() -> None:
    geo = Geometry(32, 256)
    with pytest.raises(
        ValueError, match="chunk 1 holds blocks from 3 of a group whose load starts at block 1"
    ):
        group_load_ids([NULL_BLOCK, 7, 8, 9], 0, 1, geo, 127)


# ------------------------------------------------------------------------------ the grouped copier
NUM_BLOCKS, BPC = 12, 2


def _layers(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, 16, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(n)]


def test_a_grouped_chunk_holds_each_groups_blocks_in_turn_and_loads_them_back() -> None:
    windowed, full = _layers(2, 1), _layers(1, 2)
    copier = GroupedCopier([BlockCopier(windowed, NUM_BLOCKS, BPC), BlockCopier(full, NUM_BLOCKS, BPC)])
    try:
        slot = bytearray(copier.chunk_bytes)
        saved: list[BaseException | None] = []
        copier.save_batch([(copier.slot_view(slot), [[3, 3], [4, 5]])], saved.append)
        copier.wait()
        assert saved == [None]
        page = windowed[0][0].numel() * 2

        def rows(layers: list[torch.Tensor], ids: list[int]) -> bytes:
            return b"".join(t[b].view(torch.uint8).numpy().tobytes() for t in layers for b in ids)

        assert bytes(slot) == rows(windowed, [3, 3]) + rows(full, [4, 5])
        assert len(slot) == 3 * BPC * page
        # Back into other blocks: the windowed group only its second block (the first is outside).
        copier.load(copier.slot_view(slot), [(1, [9]), (0, [10, 11])])
        copier.wait()
        assert rows(windowed, [9]) == rows(windowed, [3])
        assert rows(full, [10, 11]) == rows(full, [4, 5])
    finally:
        copier.close()


def test_a_grouped_save_reports_once_after_every_group_with_the_first_error() -> None:
    copier = GroupedCopier(
        [BlockCopier(_layers(1, 3), NUM_BLOCKS, BPC), BlockCopier(_layers(1, 4), NUM_BLOCKS, BPC)]
    )
    try:
        slot = bytearray(copier.chunk_bytes)
        done: list[BaseException | None] = []
        copier.save_batch([(copier.slot_view(slot), [[1, 2], [NUM_BLOCKS, 2]])], done.append)
        copier.wait()
        assert len(done) == 1 and isinstance(done[0], ValueError) and "block id out of range" in str(done[0])
    finally:
        copier.close()
