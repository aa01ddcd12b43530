"""How one layer's KV tensor splits into whole blocks: the dense rows ("planes") that make up a page.

Copying a block's planes row by row copies its page as opaque bytes, whatever vLLM's layout.
Design: docs/internals.md#kv-layouts-layoutpy
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# A layout that splits a block into more rows than this would copy in pieces too small to pay.
MAX_PLANES = 64
# The layouts vLLM offers, for the message of a refused view (each one is copied as planes).
WORKING_LAYOUT = "LBNHC"


class LayoutError(ValueError):
    """The KV tensors do not have a layout kvtier can copy as whole blocks."""


@dataclass(frozen=True)
class PageLayout:
    """Bytes of one block of one layer, and how they split across planes."""

    plane_bytes: tuple[int, ...]

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return sum(self.plane_bytes)


def block_planes(kv: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """The layer's KV as uint8 planes ``[num_blocks, row_bytes]`` in address order (views, no copy).

    The first dimension holds the blocks, or ``ratio`` kernel blocks per block where the attention
    kernel splits vLLM's blocks; a ``[2, num_blocks, ...]`` tensor is taken plane by plane.
    """
    if kv.dim() >= 2 and kv.shape[1] == num_blocks and kv.shape[0] <= 4 and kv.shape[0] % num_blocks:
        return [plane for part in kv.unbind(0) for plane in block_planes(part, num_blocks)]
    if kv.dim() < 1 or num_blocks <= 0 or kv.shape[0] % num_blocks:
        raise LayoutError(
            f"KV tensor of shape {tuple(kv.shape)} has no leading block dimension of {num_blocks} blocks"
        )
    item = kv.element_size()
    ratio = kv.shape[0] // num_blocks
    block_stride = ratio * kv.stride(0) * item
    # Every dimension inside a block as (size, byte stride), the kernel-block split included.
    inner = [(ratio, kv.stride(0) * item)]
    inner += [(kv.shape[d], kv.stride(d) * item) for d in range(1, kv.dim())]
    inner = sorted(((n, s) for n, s in inner if n > 1), key=lambda dim: dim[1])
    row, k = item, 0
    while k < len(inner) and inner[k][1] == row:
        row *= inner[k][0]
        k += 1
    outer = inner[k:]
    planes = 1
    for n, _ in outer:
        planes *= n
    if planes > MAX_PLANES or not _disjoint(row, [*outer, (num_blocks, block_stride)]):
        raise LayoutError(
            f"KV tensor of shape {tuple(kv.shape)}, strides {tuple(kv.stride())} does not hold each block "
            f"as at most {MAX_PLANES} dense rows; set VLLM_KV_CACHE_LAYOUT={WORKING_LAYOUT}"
        )
    offsets = sorted(sum(i * s for i, (_, s) in zip(index, outer, strict=True)) for index in _grid(outer))
    flat = _storage_bytes(kv)
    base = kv.storage_offset() * item
    return [flat.as_strided((num_blocks, row), (block_stride, 1), base + offset) for offset in offsets]


def _grid(dims: list[tuple[int, int]]) -> Iterator[tuple[int, ...]]:
    """Every index of the dimensions (size, stride)."""
    return itertools.product(*(range(n) for n, _ in dims))


def _disjoint(row: int, dims: list[tuple[int, int]]) -> bool:
    """Whether rows of ``row`` bytes at every index of ``dims`` (size, byte stride) never overlap:
    each dimension, by stride, steps past everything the smaller ones span."""
    extent = row
    for n, stride in sorted(dims, key=lambda dim: dim[1]):
        if n > 1 and stride < extent:
            return False
        extent += stride * (n - 1)
    return True


def _storage_bytes(kv: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``kv`` as a flat uint8 tensor (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=kv.device)
    flat.set_(kv.untyped_storage())
    return flat
