"""vLLM's own KV cache config and per-layer views, built on the CPU as vLLM's GPU worker builds them.

``get_kv_cache_config_from_groups`` lives in ``vllm.v1.core.kv_cache_utils`` up to vLLM 0.32 and in
``vllm.v1.core.kv_cache_planning`` from 0.33 on; the import takes whichever the installed vLLM has.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups


def vllm_config_for(layout: KVCacheLayout, num_blocks: int) -> Any:  # stands in for a VllmConfig
    """The settings ``get_kv_cache_config_from_groups`` reads: the layout, a fixed block count."""
    cache = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=num_blocks,
        prefix_cache_retention_interval=None,
    )
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache)


def kv_cache_config(
    names: list[str], spec: KVCacheSpec, layout: KVCacheLayout, num_blocks: int
) -> KVCacheConfig:
    """vLLM's KV cache config of one group of these layers (its KVCacheTensor strides included)."""
    groups = [KVCacheGroupSpec(names, spec)]
    return get_kv_cache_config_from_groups(
        vllm_config_for(layout, num_blocks), groups, available_memory=1 << 30
    )


def views_of(
    config: KVCacheConfig,
    spec: KVCacheSpec,
    layout: KVCacheLayout,
    seed: int = 0,
    kernel_block_size: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat int8 buffer of random bytes and its per-layer views, as allocate_kv_cache makes them."""
    (tensor,) = config.kv_cache_tensors
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (tensor.size,), dtype=torch.int8, generator=gen)
    views = create_kv_cache_views(raw, spec, config.num_blocks, layout, tensor, kernel_block_size)
    return raw, views
