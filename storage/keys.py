"""Key derivation: namespace digests, chunk keys, and their renderings for Redis and disk.

Everything here is stable across processes and restarts: digests come from a canonical encoding of the
namespace fields, never from Python's ``hash()``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from itertools import repeat
from typing import cast

from kvtier.storage.base import ChunkKey, NamespaceSpec

NAMESPACE_HEX_CHARS = 16
REDIS_PREFIX = "kvtier"
DISK_SUFFIX = ".kvt"
_new_tuple = tuple.__new__  # ChunkKey without its Python-level __new__


def namespace_id(spec: NamespaceSpec) -> str:
    """Hex digest naming every engine whose chunk bytes are interchangeable with spec's."""
    _check_spec(spec)
    canonical = json.dumps(dataclasses.asdict(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:NAMESPACE_HEX_CHARS]


def _check_spec(spec: NamespaceSpec) -> None:
    if spec.block_size <= 0 or spec.chunk_size <= 0:
        raise ValueError(f"block_size and chunk_size must be positive, got {spec}")
    if spec.chunk_size % spec.block_size:
        raise ValueError(
            f"chunk_size {spec.chunk_size} is not a multiple of the block size {spec.block_size}"
        )
    if spec.num_layers <= 0 or spec.page_bytes <= 0:
        raise ValueError(f"num_layers and page_bytes must be positive, got {spec}")


def chunk_keys(namespace: str, hashes: Sequence[bytes]) -> list[ChunkKey]:
    """Keys for a list of prefix hashes, in order."""
    if set(map(type, hashes)) <= {bytes}:
        # Built in C: ChunkKey's own __new__ is Python code, run once per chunk otherwise.
        return cast("list[ChunkKey]", list(map(_new_tuple, repeat(ChunkKey), zip(repeat(namespace), hashes))))
    return [ChunkKey(namespace, bytes(h)) for h in hashes]


def redis_key(key: ChunkKey) -> str:
    """Readable Redis key: ``kvtier:<ns>:<hex>``."""
    return f"{REDIS_PREFIX}:{key.namespace}:{key.prefix_hash.hex()}"


def disk_relpath(key: ChunkKey) -> str:
    """Path below the disk tier's root, fanned out over two directory levels."""
    hexed = key.prefix_hash.hex()
    return f"{key.namespace}/{hexed[:2]}/{hexed[2:4]}/{hexed}{DISK_SUFFIX}"


def parse_disk_relpath(relpath: str) -> ChunkKey | None:
    """The key a disk path names, or None when the path is not one of ours."""
    parts = relpath.split("/")
    if len(parts) != 4 or not parts[3].endswith(DISK_SUFFIX):
        return None
    namespace, fan1, fan2, name = parts
    hexed = name[: -len(DISK_SUFFIX)]
    if len(namespace) != NAMESPACE_HEX_CHARS or not hexed or len(hexed) % 2:
        return None
    try:
        raw = bytes.fromhex(hexed)
        int(namespace, 16)
    except ValueError:
        return None
    if (fan1, fan2) != (hexed[:2], hexed[2:4]):
        return None
    return ChunkKey(namespace, raw)


def key_echo(key: ChunkKey) -> bytes:
    """The bytes a blob header stores to prove which key it belongs to."""
    return key.namespace.encode() + b":" + key.prefix_hash
