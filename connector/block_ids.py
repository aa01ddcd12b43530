"""Block ids as the copiers take them: checked against the cache, and grouped into runs."""

from __future__ import annotations

from collections.abc import Sequence

# A run of block ids that step by +1 or -1: (index of its first id, length, its blocks' rows in the
# ids' order, as a slice of a layer's plane).
Run = tuple[int, int, slice]


def block_runs(ids: Sequence[int]) -> list[Run]:
    """Runs of block ids that step by +1 (a fresh engine's) or by -1, as (index of the run's first
    id, length, the rows of its blocks in the ids' order).

    vLLM frees a request's blocks last one first and hands out the longest-free blocks first, so
    once its never-used blocks are gone, a new request's blocks mostly come in descending order
    (seen with its prefix cache on): one copy per run instead of one per block.
    """
    runs: list[Run] = []
    i, count = 0, len(ids)
    while i < count:
        first = ids[i]
        step = -1 if i + 1 < count and ids[i + 1] == first - 1 else 1
        end = i + 1
        while end < count and ids[end] == ids[end - 1] + step:
            end += 1
        n = end - i
        if step == 1:
            rows = slice(first, first + n)
        else:  # first, first - 1, ..., first - n + 1; a stop of -1 would mean the last row
            rows = slice(first, first - n if first - n >= 0 else None, -1)
        runs.append((i, n, rows))
        i = end
    return runs


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """The ids as ints; ValueError where one lies outside the cache's blocks (a copy must never
    touch another request's blocks, and numpy's clipping gathers and CUDA kernels do not check)."""
    ids = [int(b) for b in block_ids]
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        raise ValueError(f"block id out of range 0..{num_blocks - 1}: {min(ids)}..{max(ids)}")
    return ids


# int64 ids per 16 bytes: Triton specializes a kernel on whether each pointer argument is 16-byte
# aligned, so a chunk's ids that start 8 bytes into a line would compile a variant of their own.
IDS_ALIGN = 2


def aligned_starts(lengths: Sequence[int], align: int = IDS_ALIGN) -> tuple[list[int], int]:
    """Where each chunk's ids start in one buffer of them, every start a multiple of ``align``
    (padding between chunks), and the buffer's length."""
    starts: list[int] = []
    at = 0
    for n in lengths:
        starts.append(at)
        at += -(-n // align) * align
    return starts, at
