"""A saved chunk's description equals what vLLM's own block pool publishes for the same blocks (its
GPU ``BlockStored``): token ids, parent hash, LoRA adapter and per-block extra keys (cache salt)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockStored
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvtier.app.chunk_description import decode_description
from kvtier.connector.describe import describe_chunk
from kvtier.connector.planning import Geometry

BLOCK, CHUNK = 16, 64
GEOMETRY = Geometry(BLOCK, CHUNK)


def _request(**extra: Any) -> Request:
    init_none_hash(sha256)
    return Request(
        "r1",
        list(range(1000, 1000 + 3 * CHUNK + 5)),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **extra,
    )


def _gpu_event(request: Request) -> BlockStored:
    """vLLM's own event for caching every full block of the request at once."""
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    full = len(request.block_hashes)
    pool.cache_full_blocks(request, pool.get_new_blocks(full), 0, full, BLOCK, 0)
    (event,) = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    return event


@pytest.mark.parametrize(
    "extra",
    [{}, {"cache_salt": "tenant-7"}, {"lora_request": LoRARequest("adapter", 3, "/adapters/a")}],
    ids=["plain", "cache-salt", "lora"],
)
def test_each_chunk_is_described_as_vllms_gpu_event_describes_its_blocks(extra: dict[str, Any]) -> None:
    request = _request(**extra)
    gpu = _gpu_event(request)
    bpc = GEOMETRY.blocks_per_chunk
    for chunk in range(3):
        desc = decode_description(describe_chunk(request, chunk, GEOMETRY))
        assert desc is not None
        first = chunk * bpc
        assert desc.token_ids() == gpu.token_ids[first * BLOCK : (first + bpc) * BLOCK]
        assert desc.parent == (bytes(request.block_hashes[first - 1]) if chunk else b"")
        assert (desc.lora_id, desc.lora_name) == (gpu.lora_id, gpu.lora_name)
        assert gpu.extra_keys is not None
        gpu_keys = gpu.extra_keys[first : first + bpc]
        if desc.extra_keys is None:  # the common request: events say None per block
            assert gpu_keys == [None] * bpc
        else:
            assert [None if k is None else tuple(k) for k in desc.extra_keys] == gpu_keys
    assert gpu.parent_block_hash is None  # a prompt's first chunk has no parent, as here
