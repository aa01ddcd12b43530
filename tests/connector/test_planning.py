"""The pure planning rules: external tokens, load spans, save ranges."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.connector.planning import (
    Geometry,
    chunk_block_ids,
    chunk_hashes,
    combine_rank_hits,
    external_tokens,
    load_spans,
    rank_lease_id,
    save_range,
)

GEO = Geometry(block_size=32, chunk_size=128)  # 4 blocks per chunk


def test_geometry_rejects_chunk_not_multiple_of_block() -> None:
    with pytest.raises(ValueError, match="multiple of vLLM's block size"):
        Geometry(block_size=32, chunk_size=100)


def test_chunk_hashes_take_each_chunks_last_block() -> None:
    hashes = [bytes([i]) for i in range(10)]
    assert chunk_hashes(hashes, GEO) == [bytes([3]), bytes([7])]
    assert chunk_hashes(hashes[:3], GEO) == []


def test_external_tokens_leaves_one_token_to_compute() -> None:
    # 2 chunks hit (256 tokens) and the prompt is exactly 256 tokens: load all but the last block.
    assert external_tokens(2, 0, 256, GEO) == 224
    assert external_tokens(2, 0, 257, GEO) == 256
    assert external_tokens(2, 64, 300, GEO) == 192  # the local hit is subtracted
    assert external_tokens(1, 128, 300, GEO) == 0  # local hit covers it: never negative
    assert external_tokens(0, 0, 300, GEO) == 0
    assert external_tokens(3, 0, 1, GEO) == 0


@given(
    hits=st.integers(0, 20),
    local_blocks=st.integers(0, 80),
    num_tokens=st.integers(0, 3000),
)
def test_external_tokens_invariants(hits: int, local_blocks: int, num_tokens: int) -> None:
    local = min(local_blocks * GEO.block_size, max(0, num_tokens - 1) // 32 * 32)
    ext = external_tokens(hits, local, num_tokens, GEO)
    assert ext >= 0
    assert ext % GEO.block_size == 0
    assert ext == 0 or local + ext < num_tokens
    assert local + ext <= max(local, hits * GEO.chunk_size)


def test_load_spans_split_at_chunk_boundaries() -> None:
    spans = load_spans(64, 256, GEO)  # blocks 2..9
    assert [(s.chunk, s.first, s.count, s.table_start) for s in spans] == [
        (0, 2, 2, 2),
        (1, 0, 4, 4),
        (2, 0, 2, 8),
    ]
    assert load_spans(0, 0, GEO) == []
    with pytest.raises(ValueError):
        load_spans(10, 32, GEO)


def test_save_range_prefill_then_decode() -> None:
    # Prefill of 300 tokens in one step: chunks 0 and 1 become valid and hashed (9 blocks hashed).
    r = save_range(0, 300, 9, 0, GEO)
    assert list(r.chunks) == [0, 1]
    # Decode steps: valid tokens grow one at a time; chunk 2 ends at token 384.
    assert list(save_range(300, 1, 9, r.hi, GEO).chunks) == []
    r3 = save_range(383, 1, 12, 2, GEO)
    assert list(r3.chunks) == [2]


def test_save_range_waits_for_late_hash_under_async_scheduling() -> None:
    # The step that writes token 383 sees only 11 hashed blocks (placeholder token not hashed yet).
    late = save_range(383, 1, 11, 2, GEO)
    assert list(late.chunks) == []
    # One step later the hash is there; the KV was already valid, so chunk 2 is planned now.
    assert list(save_range(384, 1, 12, late.hi, GEO).chunks) == [2]


def test_save_range_replans_after_preemption() -> None:
    # Saved up to chunk 3, then preempted: vLLM restarts from a 128-token hit and recomputes.
    r = save_range(128, 300, 13, 3, GEO)
    assert list(r.chunks) == [1, 2]


def test_save_range_respects_prompt_limit_and_spec_tokens() -> None:
    assert list(save_range(0, 600, 20, 0, GEO, limit_tokens=300).chunks) == [0, 1]
    assert list(save_range(0, -5, 20, 0, GEO).chunks) == []


def test_chunk_block_ids() -> None:
    table = list(range(100, 112))
    assert chunk_block_ids(table, 1, GEO) == [104, 105, 106, 107]
    with pytest.raises(ValueError):
        chunk_block_ids(table, 3, GEO)


# --------------------------------------------------------------------------- more than one rank
def test_a_chunk_is_a_hit_only_when_every_rank_holds_it() -> None:
    assert combine_rank_hits([3, 2], [[0, 0, 0], [0, 1]]) == (2, [0, 1])
    assert combine_rank_hits([4], [[0, 2, 1, 0]]) == (4, [0, 2, 1, 0])  # one rank: its own answer
    assert combine_rank_hits([0, 5], [[], [0] * 5]) == (0, [])
    # Each chunk comes from the slowest tier any rank holds it in.
    assert combine_rank_hits([2, 2, 2], [[0, 0], [2, 0], [1, 0]]) == (2, [2, 0])
    with pytest.raises(ValueError, match="one answer per rank: 2 hit counts, 1 tier lists"):
        combine_rank_hits([1, 1], [[0]])


def test_rank_zero_keeps_the_lease_id_and_other_ranks_get_their_own() -> None:
    assert [rank_lease_id("e:r:1", rank) for rank in range(3)] == ["e:r:1", "e:r:1@1", "e:r:1@2"]
    assert rank_lease_id("", 1) == ""  # no lease: nothing to end on any rank
