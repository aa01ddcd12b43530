"""Engines whose KV pages vLLM pads: the connector serves them by the real (unpadded) page, which is
what vLLM's views hold, and a chunk holds those bytes only, never the padding.

The spec is vLLM's own: an MLA page of 656 bytes per token (an fp8 latent with its scales) in blocks of
64 tokens, aligned to 576 bytes, so ``page_size_bytes`` is 42,048 while the views hold 41,984.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.connector.config import build_config
from kvtier.connector.metadata import KVTierMetadata, SaveJob
from kvtier.connector.worker import WorkerSide
from kvtier.storage.arena import Arena
from tests.connector.vllm_kv import kv_cache_config, views_of
from tools.arena_client import ArenaClient

BLOCK, CHUNK, NUM_BLOCKS = 64, 128, 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
PADDED = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=656, dtype=torch.uint8, alignment=576)


def _vllm_config() -> Any:
    """A vLLM config reduced to what build_config reads."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_size": CHUNK},
            engine_id="e1",
            kv_load_failure_policy="recompute",
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="fp8", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="tiny-mla", revision=None),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=None,
    )


def _engine(spec: Any) -> tuple[KVCacheConfig, torch.Tensor, list[torch.Tensor]]:
    """vLLM's KV cache config of the layers (LBNHC, the GPU default) and its views of random bytes."""
    config = kv_cache_config(LAYERS, spec, KVCacheLayout.LBNHC, NUM_BLOCKS)
    raw, views = views_of(config, spec, KVCacheLayout.LBNHC, seed=3)
    return config, raw, views


def _page(view: torch.Tensor, block: int) -> bytes:
    """A block's page as it lies in memory (the view's dimensions in the order of their strides)."""
    page = view[block]
    order = sorted(range(page.dim()), key=lambda d: -page.stride(d))
    return page.permute(order).contiguous().view(torch.uint8).numpy().tobytes()


def test_vllms_padded_page_is_larger_than_what_its_views_hold() -> None:
    assert (PADDED.page_size_bytes, PADDED.real_page_size_bytes) == (42_048, 41_984)
    _, _, views = _engine(PADDED)
    # Each view's block is the real page; the next block starts after the padding.
    assert views[0][0].numel() == 41_984 and views[0].stride(0) == 42_048


@pytest.mark.parametrize(
    "spec",
    [PADDED, FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)],
    ids=["mla-padded", "dense"],
)
def test_a_worker_serves_the_real_page_and_saves_no_padding(spec: Any, tmp_path: Path) -> None:
    config, _, views = _engine(spec)
    cfg = build_config(_vllm_config(), config, role_is_worker=True)
    assert cfg.spec.page_bytes == spec.real_page_size_bytes
    chunk_bytes = cfg.spec.chunk_bytes
    arena = Arena.create(tmp_path, 4 * chunk_bytes, prefault=False)
    client = ArenaClient(arena, chunk_bytes)
    worker = WorkerSide(cfg, client)  # type: ignore[arg-type]
    try:
        worker.register_kv_caches(dict(zip(LAYERS, views, strict=True)))
        assert worker.ready and worker.copier is not None
        assert worker.copier.chunk_bytes == chunk_bytes
        worker.bind(KVTierMetadata(saves=[SaveJob("r1", [b"a"], [[5, 2]])]))
        worker.wait_for_save()
        worker.copier.wait()
        (slot,) = client.commits[0][1]
        want = b"".join(_page(view, b) for view in views for b in (5, 2))
        assert len(want) == chunk_bytes and bytes(arena.view(slot)) == want
    finally:
        worker.shutdown()
        arena.close()
