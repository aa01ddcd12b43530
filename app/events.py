"""KV events: every chunk that enters or leaves a tier, as vLLM's own ``KVEventBatch`` messages.

The structs here encode exactly as vLLM's (``vllm/distributed/kv_events.py``): a batch is an array
``[ts, events, data_parallel_rank]``, each event a map tagged ``"type": "BlockStored"`` (and so on)
with the fields that are not at their defaults, so a subscriber written for vLLM's events decodes
kvtier's unchanged (``tests/app/test_events.py`` checks the bytes against vLLM's classes). kvtier
defines its own so that nothing of the service imports vLLM.

``EventRecorder`` is the store's ``TierListener``: it keeps, per tier, which chunks are held and the
vLLM block hashes each covers, and turns the tiers' calls into events for those hashes. A block hash
is announced stored in a medium when the first chunk holding it there arrives and removed when the
last one leaves (two namespaces, e.g. two TP ranks, share block hashes). Events of one turn of the
event loop go out as one batch.

Who owns what: the service's event loop owns the recorder and calls it; the publisher
(``app/events_publisher.py``) owns the sockets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from kvtier.storage.base import ChunkKey, NamespaceSpec, Tier

# The medium each tier's events name. vLLM's own are GPU, CPU (its native CPU offloading) and
# STORAGE; kvtier's CPU tier is named apart from vLLM's so a router can tell the two caches apart.
MEDIUM = {Tier.CPU: "CPU_KVTIER", Tier.DISK: "DISK", Tier.REDIS: "REDIS", Tier.OBJECT: "OBJECT"}
OWNERSHIP = "kvtier"  # BlockStored/BlockRemoved.ownership: the secondary tier that sent the event

HashFormat = Literal["int", "bytes"]
ExternalHash = int | bytes


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (vLLM's ``KVCacheEvent``: a map tagged by its class name)."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    """vLLM's ``BlockStored``, with the fields kvtier sets (the rest decode as their defaults)."""

    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[ExternalHash]
    medium: str | None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared``: forget everything this publisher announced before."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: the events of one step (here: one turn of the service's loop)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


Sink = Callable[[KVEventBatch], None]


def external_hash(block_hash: bytes, fmt: HashFormat) -> ExternalHash:
    """A block hash as events carry it: vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) is
    the low 64 bits of the big-endian integer; "bytes" keeps the whole hash."""
    if fmt == "bytes":
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class EventRecorder:
    """TierListener that turns chunks entering and leaving tiers into KV events (see the module)."""

    def __init__(self, sink: Sink, hash_format: HashFormat = "int") -> None:
        self._sink = sink
        self._format: HashFormat = hash_format
        self.namespaces: Mapping[str, NamespaceSpec] = {}  # the service's registered specs
        self._held: dict[Tier, dict[ChunkKey, tuple[bytes, ...]]] = {t: {} for t in Tier}
        self._refs: dict[Tier, dict[bytes, int]] = {t: {} for t in Tier}
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._flush_scheduled = False

    # ------------------------------------------------------------------------------- TierListener
    def stored(self, tier: Tier, keys: Sequence[ChunkKey], covered: Sequence[Sequence[bytes]]) -> None:
        """These chunks are now held by tier: announce the block hashes new to it."""
        held, refs = self._held[tier], self._refs[tier]
        for key, hashes in zip(keys, covered, strict=True):
            if key in held:
                continue
            blocks = tuple(hashes) or self._known(key)
            held[key] = blocks
            new = [h for h in blocks if _incref(refs, h)]
            if new:
                self._emit(self._stored_event(tier, key.namespace, new))

    def removed(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        """These chunks left tier: announce the block hashes no other chunk there holds."""
        held, refs = self._held[tier], self._refs[tier]
        for key in keys:
            blocks = held.pop(key, None)
            if blocks is None:
                continue
            gone = [h for h in blocks if _decref(refs, h)]
            if gone:
                self._emit(BlockRemoved(self._ext(gone), MEDIUM[tier], OWNERSHIP))

    def cleared(self, tier: Tier) -> None:
        """tier holds nothing now: its blocks are announced removed."""
        self.removed(tier, list(self._held[tier]))

    def cleared_all(self) -> None:
        """Forget every tier and tell subscribers to (AllBlocksCleared: the service starts afresh)."""
        for tier in Tier:
            self._held[tier].clear()
            self._refs[tier].clear()
        self._emit(AllBlocksCleared())

    # ------------------------------------------------------------------------------- reading
    def held_hashes(self, tier: Tier) -> set[bytes]:
        """The block hashes announced as held by tier (what a subscriber rebuilds)."""
        return set(self._refs[tier])

    def flush(self) -> None:
        """Send the pending events as one batch now."""
        self._flush_scheduled = False
        if self._pending:
            events, self._pending = self._pending, []
            self._sink(KVEventBatch(time.time(), events))

    # ------------------------------------------------------------------------------- helpers
    def _known(self, key: ChunkKey) -> tuple[bytes, ...]:
        """key's block hashes as another tier announced them, else the one hash its key holds."""
        for chunks in self._held.values():
            blocks = chunks.get(key)
            if blocks:
                return blocks
        return (key.prefix_hash,)

    def _stored_event(self, tier: Tier, namespace: str, hashes: list[bytes]) -> BlockStored:
        spec = self.namespaces.get(namespace)
        block_size = spec.block_size if spec is not None else 0  # 0: no engine named it yet
        return BlockStored(self._ext(hashes), None, [], block_size, None, MEDIUM[tier], None, OWNERSHIP)

    def _ext(self, hashes: list[bytes]) -> list[ExternalHash]:
        fmt = self._format
        return [external_hash(h, fmt) for h in hashes]

    def _emit(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self._pending.append(event)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the loop (a synchronous shutdown path): send now
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)


def _incref(refs: dict[bytes, int], block_hash: bytes) -> bool:
    """Count one more holder; True when it is the first."""
    count = refs.get(block_hash, 0)
    refs[block_hash] = count + 1
    return count == 0


def _decref(refs: dict[bytes, int], block_hash: bytes) -> bool:
    """Count one holder less; True when it was the last."""
    count = refs.get(block_hash, 0)
    if count <= 1:
        refs.pop(block_hash, None)
        return count == 1
    refs[block_hash] = count - 1
    return False
