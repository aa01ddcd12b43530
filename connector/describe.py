"""Describe a chunk to be saved as vLLM's own KV events describe its blocks (token ids, parent hash,
LoRA, extra keys), from the request the scheduler side holds while it plans the save.

The fields are filled as vLLM's block pool fills a GPU ``BlockStored`` (``vllm/v1/core/block_pool.py``,
``cache_full_blocks``): the tokens of the chunk's blocks, the hash of the block before the first
(none for a prompt's first chunk), the request's LoRA adapter id and name, and per block the extra
keys its hash folds in (``generate_block_hash_extra_keys``, published untagged by
``to_event_extra_keys``). The service turns the bytes into events (``app/events.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.app.chunk_description import encode_description
from kvtier.connector.planning import Geometry

if TYPE_CHECKING:
    from vllm.v1.request import Request


def describe_chunk(request: Request, chunk: int, geometry: Geometry) -> bytes:
    """The description of the request's chunk ``chunk`` (its blocks must be hashed)."""
    bpc, size = geometry.blocks_per_chunk, geometry.chunk_size
    first = chunk * bpc
    parent = bytes(request.block_hashes[first - 1]) if first else b""
    tokens = request.all_token_ids[chunk * size : (chunk + 1) * size]
    lora = request.lora_request
    return encode_description(
        parent,
        tokens,
        lora.adapter_id if lora else None,
        lora.name if lora else None,
        _extra_keys(request, chunk, geometry),
    )


def _has_extra_keys(request: Request) -> bool:
    """Whether any block hash of the request folds in extra keys (the common request has none)."""
    return bool(
        request.lora_request
        or request.mm_features
        or request.cache_salt
        or getattr(request, "prompt_embeds", None) is not None
    )


def _extra_keys(request: Request, chunk: int, geometry: Geometry) -> list[Any] | None:
    """Per block of the chunk, the extra keys vLLM's events publish for it; None when the request
    has none (events then say None per block)."""
    if not _has_extra_keys(request):
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    block, keys, mm_idx = geometry.block_size, [], 0
    start = chunk * geometry.chunk_size
    for begin in range(start, start + geometry.chunk_size, block):
        extra, mm_idx = generate_block_hash_extra_keys(request, begin, begin + block, mm_idx)
        keys.append(extra)
    return to_event_extra_keys(keys)
