"""The Triton kernel that moves whole KV blocks between vLLM's per-layer planes and a staging buffer.

Imported only where CUDA is (``connector.copy_cuda``); vLLM's CUDA builds ship Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024  # int64 words per program: 8 KiB, four programs per 32 KiB plane row


@triton.jit
def _stage_blocks(
    planes_ptr,  # int64 [layers * P]: address of each layer's plane (row b at address + b * WB)
    ids_ptr,  # int64 [n]: the chunk's block ids
    stage_ptr,  # int64 words laid out [layer, row, plane, WB / 8], as the slot holds them
    n,  # rows (blocks) in the chunk
    lp0,  # first layer-plane of the piece
    WB,  # bytes of one block's row in one plane
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    TO_STAGE: tl.constexpr,
):
    row = tl.program_id(0)
    lp = tl.program_id(1)  # layer-plane within the piece
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    words = WB // 8
    layer = lp // P
    plane = lp % P
    block = tl.load(ids_ptr + row)
    kv = (tl.load(planes_ptr + lp0 + lp) + block * WB).to(tl.pointer_type(tl.int64))
    stage = stage_ptr + ((layer.to(tl.int64) * n + row) * P + plane) * words
    mask = cols < words
    if TO_STAGE:
        tl.store(stage + cols, tl.load(kv + cols, mask=mask), mask=mask)
    else:
        tl.store(kv + cols, tl.load(stage + cols, mask=mask), mask=mask)


def stage_blocks(
    planes: torch.Tensor,
    ids: torch.Tensor,
    stage: torch.Tensor,
    first_layer: int,
    layers: int,
    num_planes: int,
    row_bytes: int,
    to_stage: bool,
) -> None:
    """Copy the blocks ``ids`` of layers [first_layer, first_layer + layers) to (or from) ``stage``.

    ``stage`` holds ``[layers, len(ids), num_planes, row_bytes]`` bytes, the slot's own order;
    ``planes`` holds every layer-plane's base address. Runs on the current stream.
    """
    words = row_bytes // 8
    block = min(_MAX_BLOCK, triton.next_power_of_2(words))
    grid = (ids.numel(), layers * num_planes, triton.cdiv(words, block))
    _stage_blocks[grid](
        planes, ids, stage.view(torch.int64), ids.numel(), first_layer * num_planes, row_bytes,
        P=num_planes, BLOCK=block, TO_STAGE=to_stage, num_warps=4,
    )  # fmt: skip
