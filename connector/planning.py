"""Pure planning: which chunks to look up, how many tokens are external, which blocks to load or save.

Plain functions over vLLM's numbers, with no I/O and no vLLM objects, so tests call them directly.
Units: tokens, blocks (vLLM's ``block_size`` tokens), chunks (``chunk_size`` tokens, a whole number of
blocks). Chunk ``i`` covers tokens ``[i*chunk_size, (i+1)*chunk_size)`` and is named by the chained hash
of its last block, ``block_hashes[(i+1)*blocks_per_chunk - 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True, slots=True)
class Geometry:
    """Token, block and chunk sizes of one engine."""

    block_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must be a positive multiple of vLLM's block size "
                f"({self.block_size})"
            )

    @property
    def blocks_per_chunk(self) -> int:
        """vLLM blocks in one chunk."""
        return self.chunk_size // self.block_size


def chunk_hashes(block_hashes: Sequence[bytes], geo: Geometry) -> list[bytes]:
    """Hash of every full chunk whose last block has a hash, in order."""
    bpc = geo.blocks_per_chunk
    return [bytes(block_hashes[(i + 1) * bpc - 1]) for i in range(len(block_hashes) // bpc)]


def external_tokens(num_hit_chunks: int, num_computed_tokens: int, num_tokens: int, geo: Geometry) -> int:
    """Tokens vLLM may take from kvtier (Invariant 3).

    Block-aligned, never negative, and never the whole sequence: at least one token is left to compute
    so the engine can sample the next one. ``num_computed_tokens`` is vLLM's block-aligned local hit.
    """
    if num_tokens <= 1 or num_hit_chunks <= 0:
        return 0
    last_loadable = ((num_tokens - 1) // geo.block_size) * geo.block_size
    hit_end = min(num_hit_chunks * geo.chunk_size, last_loadable)
    return max(0, hit_end - num_computed_tokens)


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Blocks ``[first, first + count)`` of chunk ``chunk``; ``table_start`` indexes the block table."""

    chunk: int
    first: int
    count: int
    table_start: int


def load_spans(num_computed_tokens: int, num_external_tokens: int, geo: Geometry) -> list[ChunkSpan]:
    """The chunk pieces that cover the external tokens, block by block."""
    if num_external_tokens <= 0:
        return []
    if num_computed_tokens % geo.block_size or num_external_tokens % geo.block_size:
        raise ValueError("loads are block-aligned")
    bpc = geo.blocks_per_chunk
    start = num_computed_tokens // geo.block_size
    end = start + num_external_tokens // geo.block_size
    spans = []
    block = start
    while block < end:
        chunk, first = divmod(block, bpc)
        count = min(bpc - first, end - block)
        spans.append(ChunkSpan(chunk, first, count, block))
        block += count
    return spans


@dataclass(frozen=True, slots=True)
class SaveRange:
    """Chunks ``[lo, hi)`` to save now, and the watermark to remember for the next step."""

    lo: int
    hi: int

    @property
    def chunks(self) -> range:
        """Indices of the chunks to save."""
        return range(self.lo, self.hi)


def save_range(
    num_computed_before: int,
    num_new_valid_tokens: int,
    num_hashed_blocks: int,
    watermark: int,
    geo: Geometry,
    limit_tokens: int | None = None,
) -> SaveRange:
    """Chunks whose KV is valid after this step and whose hash is known, not planned before (Inv. 1).

    ``num_computed_before`` is vLLM's ``num_computed_tokens`` before the step and
    ``num_new_valid_tokens`` the tokens this step writes for certain (scheduled minus speculative
    ones). ``watermark`` is ``hi`` of the previous plan: chunks below it were already planned, unless
    vLLM moved ``num_computed_tokens`` back (preemption, a failed load), which re-plans them.
    ``limit_tokens`` stops saving past that many tokens (the prompt, when decode saving is off).
    Under async scheduling a chunk's hash can appear a step after its KV was written: it is planned
    when the hash appears, since the request still holds the block.
    """
    chunk = geo.chunk_size
    valid_before = num_computed_before // chunk
    valid_after = (num_computed_before + max(0, num_new_valid_tokens)) // chunk
    hashed = num_hashed_blocks // geo.blocks_per_chunk
    hi = min(valid_after, hashed)
    if limit_tokens is not None:
        hi = min(hi, limit_tokens // chunk)
    lo = min(valid_before, watermark, hi)
    return SaveRange(max(0, lo), max(0, hi))


def chunk_block_ids(block_table: Sequence[int], chunk: int, geo: Geometry) -> list[int]:
    """vLLM block ids of one whole chunk."""
    bpc = geo.blocks_per_chunk
    ids = list(block_table[chunk * bpc : (chunk + 1) * bpc])
    if len(ids) != bpc:
        raise ValueError(f"chunk {chunk} needs {bpc} blocks; the table has {len(block_table)}")
    return ids


def rank_lease_id(lease_id: str, rank: int) -> str:
    """The lease of one rank's lookup: rank 0 holds the request's lease id, rank r that id and ``@r``."""
    if not lease_id or rank == 0:
        return lease_id
    return f"{lease_id}@{rank}"


TierT = TypeVar("TierT", bound=int)  # a tier as the lookup answers name it (kvtier.storage.base.Tier)


def combine_rank_hits(num_hits: Sequence[int], tiers: Sequence[Sequence[TierT]]) -> tuple[int, list[TierT]]:
    """One hit for every rank from each rank's lookup: the fewest leading chunks any rank holds (a
    chunk counts only if every rank holds it), each at the slowest tier a rank found it in (tiers
    are ordered fastest first)."""
    if len(num_hits) != len(tiers) or not num_hits:
        raise ValueError(f"one answer per rank: {len(num_hits)} hit counts, {len(tiers)} tier lists")
    hit = min(num_hits)
    if len(tiers) == 1:  # one rank: its own answer, with no per-chunk work
        return hit, list(tiers[0][:hit])
    return hit, [max(rank_tiers[i] for rank_tiers in tiers) for i in range(hit)]


# vLLM's null block: the id a block table holds where a sliding-window group freed (or never
# allocated) a block outside its window.
NULL_BLOCK = 0


def window_first_block(num_tokens: int, reach: int | None, block_size: int) -> int:
    """First block a group still holds once ``num_tokens`` are computed: vLLM frees every block that
    lies wholly before ``num_tokens - reach`` (``reach``: a sliding window's tokens behind the next
    one, ``sliding_window - 1 + extra_retained_tokens``; None for full attention, which frees none)."""
    if reach is None:
        return 0
    return max(0, num_tokens - reach) // block_size


def stored_first_block(chunk: int, geo: Geometry, reach: int | None) -> int:
    """The first of chunk ``chunk``'s blocks (0-based in the chunk) that it holds for a group.

    A load that ends in the chunk ends at its end or one block short (the last token is always left
    to compute, see ``external_tokens``), and a sliding-window group then needs only the blocks
    inside the window of that end; the chunk holds those, and earlier chunks hold the rest.
    """
    end = (chunk + 1) * geo.chunk_size - geo.block_size
    return max(0, window_first_block(end, reach, geo.block_size) - chunk * geo.blocks_per_chunk)


def group_save_ids(
    ids: Sequence[int], chunk: int, geo: Geometry, reach: int | None, num_computed: int
) -> list[int] | None:
    """The block ids to copy into chunk ``chunk`` for one group, or None when vLLM may have freed a
    block the chunk must hold (``num_computed``: the request's computed tokens before this step).

    Blocks before ``stored_first_block`` are never loaded back; their places are filled from the
    first held block, so the copy never reads a block vLLM may have handed to another request.
    """
    if reach is None:  # full attention: every block stays with the request
        return list(ids)
    held = stored_first_block(chunk, geo, reach)
    freed = window_first_block(num_computed, reach, geo.block_size) - chunk * geo.blocks_per_chunk
    if freed > held or NULL_BLOCK in ids[held:]:
        return None
    return [ids[held]] * held + list(ids[held:])


def group_load_ids(
    ids: Sequence[int], first: int, chunk: int, geo: Geometry, reach: int | None
) -> tuple[int, list[int]]:
    """(first block in the chunk, block ids) of one group's part of a load: the blocks vLLM allocated,
    past the null blocks outside a sliding window (full attention has none). ValueError where a block
    it allocated lies before the blocks the chunk holds (the load would read bytes never stored)."""
    skip = 0
    while reach is not None and skip < len(ids) and ids[skip] == NULL_BLOCK:
        skip += 1
    if skip < len(ids) and first + skip < stored_first_block(chunk, geo, reach):
        raise ValueError(
            f"chunk {chunk} holds blocks from {stored_first_block(chunk, geo, reach)} of a group whose "
            f"load starts at block {first + skip}"
        )
    return first + skip, list(ids[skip:])
