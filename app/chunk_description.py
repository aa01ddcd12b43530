"""A chunk's description: what its vLLM block hashes stand for, as a token-keyed router needs it.

vLLM's block hashes chain over tokens (and LoRA, multimodal inputs, cache salt), so a router that
keys blocks by their tokens (llm-d's indexer) can index a ``BlockStored`` only when it carries the
blocks' token ids and the hash of the block before them. The connector's scheduler side, which has
the ``Request``, describes each chunk it saves; the description travels with the commit
(``Commit.descriptions``), stays with the chunk in every tier (``codec.Covered``) and rests in the
blob's trailer, so a chunk found at a restart is announced in full. The storage layer keeps it as
opaque bytes; the service's events decode it (``app/events.py``).

Encoded once per chunk as msgpack with the token ids packed as u32 little-endian (4 bytes a token:
1 KiB for a 256-token chunk, against the megabytes of its KV).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

_TOKEN = "I"  # u32: every vocabulary fits
_SWAP = sys.byteorder != "little"  # the packed form is little-endian on every host
if array(_TOKEN).itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4-byte I
    raise ImportError("array('I') is not 4 bytes here")


class Description(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One chunk's description, with the fields of vLLM's ``BlockStored`` that its hashes fold in.

    parent: the block hash before the chunk's first block, b"" for a prompt's first chunk.
    tokens: the chunk's token ids, u32 little-endian.
    lora_id, lora_name: the request's LoRA adapter (vLLM's ``lora_request.adapter_id`` and ``name``).
    extra_keys: one entry per block as vLLM's events publish them (``to_event_extra_keys``), None
    when no block has any (events then carry one None per block, as vLLM's GPU events do).
    """

    parent: bytes = b""
    tokens: bytes = b""
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None

    def token_ids(self) -> list[int]:
        """The chunk's token ids."""
        ids = array(_TOKEN)
        ids.frombytes(self.tokens)
        if _SWAP:
            ids.byteswap()
        return ids.tolist()


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Description)


def encode_description(
    parent: bytes,
    token_ids: Sequence[int],
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
) -> bytes:
    """The bytes a commit carries and a blob keeps for one chunk; OverflowError for a token id
    outside u32."""
    ids = array(_TOKEN, token_ids)
    if _SWAP:
        ids.byteswap()
    tokens = ids.tobytes()
    return _encoder.encode(Description(parent, tokens, lora_id, lora_name, extra_keys))


def decode_description(data: bytes) -> Description | None:
    """The description data encodes; None for b"" (none sent) or bytes that are not one (a chunk
    written by another build): the chunk is then announced without tokens."""
    if not data:
        return None
    try:
        desc = _decoder.decode(data)
    except msgspec.DecodeError:
        return None
    if len(desc.tokens) % 4:
        return None
    return desc
