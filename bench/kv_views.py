"""vLLM's per-layer KV cache views, rebuilt with torch alone, for checks and benchmarks where vLLM is not.

Replicates what vLLM 0.32's ``allocate_kv_cache`` and ``create_kv_cache_views`` hand a connector for
one group of same-shaped layers, with pages padded to an alignment where asked (MLA's
``alignment``; only layouts whose page is the innermost three dimensions pad): one flat int8
buffer, and per layer a strided ``[B, H, N, C]`` view of it in the spec's dtype. Layer-outermost
layouts give each layer a region of its own; block-outermost ones pack every layer's page into each
block; LHBNC and BHLNC store each head's rows of a block apart. With a kernel block size below the
block size, each block is split into kernel blocks and the view's first dimension grows by that
ratio. tests/connector/test_kv_layouts.py checks these views against vLLM's own.
"""

from __future__ import annotations

import torch

# KVCacheLayout's stride permutations: logical axes [L, B, H, N, C] in physical (memory) order.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_B = 1  # the block axis

# Logical [L, B, H, N, C] strides in bytes, where one is fixed (None: packed by the layout's order).
_Fixed = tuple[int | None, int | None, int | None, int | None, int | None]


def kv_cache_views(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    layout_name: str,
    device: torch.device | str,
    kernel_block_size: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Full attention (a token's K then V per head): the raw int8 buffer and each layer's view."""
    content = 2 * head_size * dtype.itemsize
    return _views(
        num_layers, num_blocks, block_size, num_heads, content, dtype, layout_name, device, kernel_block_size
    )


def mla_kv_cache_views(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    layout_name: str,
    device: torch.device | str,
    kernel_block_size: int | None = None,
    alignment: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """MLA (one latent head of ``head_size`` elements per token): the raw buffer and each layer's
    view; with ``alignment``, each page padded to a multiple of it, as vLLM pads DeepSeek's."""
    content = head_size * dtype.itemsize
    page = block_size * content
    padded = -(-page // alignment) * alignment if alignment else page
    return _views(
        num_layers, num_blocks, block_size, 1, content, dtype, layout_name, device, kernel_block_size, padded
    )


def page_addresses(view: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    """Where in the view's storage each byte of one block's page lies, in increasing order: the
    block's dense rows in address order, derived from the view's strides alone."""
    as_bytes = view.view(torch.int8)
    ratio = as_bytes.shape[0] // num_blocks  # kernel blocks per block, consecutive in dim 0
    sub = as_bytes[block * ratio : (block + 1) * ratio]
    offsets = torch.tensor(sub.storage_offset(), dtype=torch.int64, device=view.device)
    for dim, (size, stride) in enumerate(zip(sub.shape, sub.stride(), strict=True)):
        shape = [1] * sub.dim()
        shape[dim] = size
        steps = torch.arange(size, dtype=torch.int64, device=view.device) * stride
        offsets = offsets + steps.view(shape)
    return offsets.flatten().sort().values


def _views(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    content: int,
    dtype: torch.dtype,
    layout_name: str,
    device: torch.device | str,
    kernel_block_size: int | None,
    padded_page: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    order = LAYOUTS[layout_name]
    page = num_heads * block_size * content
    padded = padded_page or page
    if padded != page and sorted(order[:2]) != [0, _B]:
        raise ValueError(f"{layout_name} does not hold a page as its innermost dimensions: it cannot pad it")
    bytes_per_block = num_layers * padded
    # The KVCacheTensor vLLM's config chooses: block-outermost layouts pack all layers into a block.
    shape = (num_layers, num_blocks, num_heads, block_size, content)
    if order[0] == _B:
        fixed: _Fixed = (padded if padded != page else None, bytes_per_block, None, None, None)
    else:
        fixed = (
            padded * num_blocks if padded != page else None,
            padded if padded != page else None,
            None,
            None,
            None,
        )
    layer_stride, block_stride = _strides(shape, order, fixed)[:2]
    kernel = kernel_block_size or block_size
    if block_size % kernel:
        raise ValueError(f"kernel block size {kernel} does not divide block size {block_size}")
    ratio = block_size // kernel
    if ratio > 1:
        # vLLM splits a block into kernel blocks only where the block is one dense page.
        if block_stride != page:
            raise ValueError(
                f"{layout_name} does not store blocks as dense pages (block stride {block_stride} "
                f"!= page {page}): a block cannot be split into {ratio} kernel blocks"
            )
        block_stride //= ratio
    shape = (num_layers, num_blocks * ratio, num_heads, kernel, content)
    strides = _strides(shape, order, (layer_stride, block_stride, None, None, None))
    raw = torch.zeros(bytes_per_block * num_blocks, dtype=torch.int8, device=device)
    view = torch.as_strided(raw, shape, strides, raw.storage_offset())
    return raw, [view[layer].view(dtype) for layer in range(num_layers)]


def _strides(shape: tuple[int, ...], order: tuple[int, ...], fixed: _Fixed) -> tuple[int, ...]:
    """Byte strides in logical axis order: innermost physical axis first, each packed over the last."""
    strides = [0] * len(shape)
    current = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)
