"""The Triton kernel that moves whole KV blocks between vLLM's per-layer planes and a staging buffer.

Imported only where CUDA is (``kvtier.connector.copy_cuda``); vLLM's CUDA builds ship Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024  # int64 words per program: 8 KiB, four programs per 32 KiB plane row


# The integer arguments change from call to call (a chunk's first block id and step, its row count,
# the piece's first layer); Triton would otherwise compile a variant when one of them first equals 1
# or is first a multiple of 16, which is a compile of seconds inside one of vLLM's steps.
@triton.jit(do_not_specialize=["first", "step", "n", "lp0"])
def _stage_blocks(
    planes_ptr,  # int64 [layers * P]: address of each layer's plane (block b's row at address + b * BS)
    ids_ptr,  # int64 [n]: the chunk's block ids (read only when not RUN)
    first,  # the first block id when RUN: the chunk's blocks are first, first + step, ...
    step,  # 1 or -1 when RUN
    stage_ptr,  # int64 words laid out [layer, row, plane, WB / 8], as the slot holds them
    n,  # rows (blocks) in the chunk
    lp0,  # first layer-plane of the piece
    WB,  # bytes of one block's row in one plane
    BS,  # bytes from one block's row to the next block's in a plane (WB, or more where layers interleave)
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    TO_STAGE: tl.constexpr,
    RUN: tl.constexpr,
):
    row = tl.program_id(0)
    lp = tl.program_id(1)  # layer-plane within the piece
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    words = WB // 8
    layer = lp // P
    plane = lp % P
    if RUN:  # noqa: SIM108 (a statement: Triton resolves it at compile time)
        block = (first + step * row).to(tl.int64)  # 64-bit: block * BS passes 2**31 in a large cache
    else:
        block = tl.load(ids_ptr + row)
    kv = (tl.load(planes_ptr + lp0 + lp) + block * BS).to(tl.pointer_type(tl.int64))
    stage = stage_ptr + ((layer.to(tl.int64) * n + row) * P + plane) * words
    mask = cols < words
    if TO_STAGE:
        tl.store(stage + cols, tl.load(kv + cols, mask=mask), mask=mask)
    else:
        tl.store(kv + cols, tl.load(stage + cols, mask=mask), mask=mask)


def stage_blocks(
    planes: torch.Tensor,
    ids: torch.Tensor | tuple[int, int],
    rows: int,
    stage: torch.Tensor,
    first_layer: int,
    layers: int,
    num_planes: int,
    row_bytes: int,
    block_stride: int,
    to_stage: bool,
) -> None:
    """Copy ``rows`` blocks of layers [first_layer, first_layer + layers) to (or from) ``stage``.

    ``ids`` is a device tensor of the block ids, or (first id, step) of ``rows`` ids that step by 1
    or -1 (no upload needed). ``stage`` holds ``[layers, rows, num_planes, row_bytes]`` bytes, the slot's own
    order; ``planes`` holds every layer-plane's base address, whose blocks lie ``block_stride`` bytes
    apart. Runs on the current stream.
    """
    words = row_bytes // 8
    block = min(_MAX_BLOCK, triton.next_power_of_2(words))
    grid = (rows, layers * num_planes, triton.cdiv(words, block))
    run = isinstance(ids, tuple)
    first, step = ids if isinstance(ids, tuple) else (0, 1)
    _stage_blocks[grid](
        planes, planes if run else ids, first, step, stage.view(torch.int64),
        rows, first_layer * num_planes, row_bytes, block_stride,
        P=num_planes, BLOCK=block, TO_STAGE=to_stage, RUN=run, num_warps=4,
    )  # fmt: skip
