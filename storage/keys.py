"""Key derivation: namespace digests, chunk keys, and their renderings for Redis and disk.

Everything here is stable across processes and restarts: digests come from a canonical encoding of the
namespace fields or from file contents, never from Python's ``hash()`` or a file's mtime.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path
from typing import cast

from kvtier.storage.base import ChunkKey, NamespaceSpec

NAMESPACE_HEX_CHARS = 16
REDIS_PREFIX = "kvtier"
DISK_SUFFIX = ".kvt"
_new_tuple = tuple.__new__  # ChunkKey without its Python-level __new__

# Files of a model directory that never change its KV for given token ids: tokenizers and chat
# templates (they change the token ids, which the block hashes hold), generation defaults, docs.
NOT_KV_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "generation_config.json",
    "chat_template*",
    "*.md",
    "LICENSE*",
    ".*",
)
WHOLE_FILE_BYTES = 1 << 20  # smaller files are hashed whole
TENSORS_PER_FILE = 1024  # safetensors: tensors sampled per file, evenly spread over the file
TENSOR_SAMPLE = 512  # bytes read at the start and at the end of each sampled tensor
SPREAD_PIECES = 64  # other large files: pieces read, evenly spaced from start to end
SPREAD_PIECE = 4096
SAFETENSORS_MAX_HEADER = 100 << 20  # the format's own limit


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


def model_files_digest(path: Path) -> str:
    """Digest of the files that decide a model's KV (a directory's top level, or one file).

    Cheap at any size: small files whole; a safetensors file's header and both ends of each tensor
    (so replaced or retrained weights of the same shapes change it); other large files sampled. Raises
    OSError when a file cannot be read.
    """
    digest = hashlib.sha256()
    if path.is_dir():
        entries = sorted(p for p in path.iterdir() if p.is_file() and not _not_kv_file(p.name))
    else:
        entries = [path]
    for entry in entries:
        with open(entry, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(f"{entry.name}\0{size}\0".encode())
            _digest_file(f.fileno(), size, entry.name, digest)
    return digest.hexdigest()[:32]


def _not_kv_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in NOT_KV_FILES)


def _digest_file(fd: int, size: int, name: str, digest: hashlib._Hash) -> None:
    if size <= WHOLE_FILE_BYTES:
        digest.update(os.pread(fd, size, 0))
        return
    if name.endswith(".safetensors") and _digest_safetensors(fd, size, digest):
        return
    for i in range(SPREAD_PIECES):
        digest.update(os.pread(fd, SPREAD_PIECE, (size - SPREAD_PIECE) * i // (SPREAD_PIECES - 1)))


def _digest_safetensors(fd: int, size: int, digest: hashlib._Hash) -> bool:
    """Header and both ends of (up to TENSORS_PER_FILE) tensors; False if the header is not one."""
    header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
    if not 0 < header_len <= min(size - 8, SAFETENSORS_MAX_HEADER):
        return False
    header = os.pread(fd, header_len, 8)
    base = 8 + header_len
    try:
        tensors = json.loads(header)
        spans = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]))
            for k, v in tensors.items()
            if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False
    if any(not 0 <= start <= end <= size - base for start, end in spans):
        return False
    digest.update(header)
    step = max(1, len(spans) / TENSORS_PER_FILE)
    for i in range(min(len(spans), TENSORS_PER_FILE)):
        start, end = spans[int(i * step)]
        head = min(TENSOR_SAMPLE, end - start)
        tail = min(TENSOR_SAMPLE, end - start - head)
        digest.update(os.pread(fd, head, base + start))
        digest.update(os.pread(fd, tail, base + end - tail))
    return True
