"""The engine shapes the connector serves: full attention and MLA in one KV cache group; the rest is
refused at start (the connector then stays idle) with an error that names what was found."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
)

from kvtier.connector.config import UnsupportedEngine, build_config, check_kv_spec

DENSE = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _engine(spec: Any) -> tuple[Any, KVCacheConfig]:
    """A vLLM config reduced to what build_config reads, and a one-group KV cache config."""
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_size": 32}, engine_id="e1", kv_load_failure_policy="recompute"
        ),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="tiny", revision=None),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=None,
    )
    group = KVCacheGroupSpec(layer_names=["layer0", "layer1"], kv_cache_spec=spec)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    return vllm_config, kv_cache_config


@pytest.mark.parametrize(
    "spec",
    [FullAttentionSpec(**DENSE), MLAAttentionSpec(**{**DENSE, "num_kv_heads": 1, "head_size": 576})],
    ids=["full", "mla"],
)
def test_full_attention_and_mla_are_served(spec: Any) -> None:
    check_kv_spec(spec)
    cfg = build_config(*_engine(spec), role_is_worker=False)
    assert cfg.layer_names == ("layer0", "layer1") and cfg.spec.page_bytes == spec.page_size_bytes


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (SlidingWindowSpec(**DENSE, sliding_window=128), "SlidingWindowSpec with a sliding window of 128"),
        (ChunkedLocalAttentionSpec(**DENSE, attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
        (RSWASpec(**DENSE, rswa_window=64), "RSWASpec"),
    ],
    ids=["sliding-window", "chunked-local", "r-swa"],
)
def test_specs_whose_blocks_vllm_frees_mid_request_are_refused(spec: Any, named: str) -> None:
    with pytest.raises(UnsupportedEngine, match=named):
        check_kv_spec(spec)
    with pytest.raises(UnsupportedEngine, match="FullAttentionSpec, MLAAttentionSpec"):
        build_config(*_engine(spec), role_is_worker=False)
