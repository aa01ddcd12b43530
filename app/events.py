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

A chunk whose block hashes arrive with a description (``app/chunk_description.py``: token ids,
parent hash, LoRA, extra keys) is announced self-describing, with the fields filled as vLLM's own GPU
events fill them for the same blocks, so a router that keys blocks by tokens indexes it without the
GPU's events. A chunk without one (written by an older build, or a client that sends none) is
announced by its hashes alone and counted in ``undescribed``.

Who owns what: the service's event loop owns the recorder and calls it; the publisher
(``app/events_publisher.py``) owns the sockets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import msgspec

from kvtier.app.chunk_description import Description, decode_description
from kvtier.app.events_order import ParentOrder
from kvtier.storage.base import ChunkKey, NamespaceSpec, Tier
from kvtier.storage.codec import description_of

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
    extra_keys: list[Any] | None = None
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
        self._held: dict[Tier, dict[ChunkKey, Sequence[bytes]]] = {t: {} for t in Tier}
        self._refs: dict[Tier, dict[bytes, int]] = {t: {} for t in Tier}
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._flush_scheduled = False
        self.undescribed = 0  # BlockStored events sent without token ids (no description known)
        self.order = ParentOrder(self._emit)  # self-describing events go out after their parent's

    # ------------------------------------------------------------------------------- TierListener
    def stored(self, tier: Tier, keys: Sequence[ChunkKey], covered: Sequence[Sequence[bytes]]) -> None:
        """These chunks are now held by tier: announce the block hashes new to it."""
        held, refs = self._held[tier], self._refs[tier]
        for key, hashes in zip(keys, covered, strict=True):
            if key in held:
                continue
            blocks = self._blocks(key, hashes)
            held[key] = blocks
            new = [i for i, h in enumerate(blocks) if _incref(refs, h)]
            if new:
                for event, parent, named in self._stored_events(tier, key.namespace, blocks, new):
                    self.order.stored((tier, key), parent, event, named)

    def removed(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        """These chunks left tier: announce the block hashes no other chunk there holds."""
        held, refs = self._held[tier], self._refs[tier]
        for key in keys:
            blocks = held.pop(key, None)
            if blocks is None:
                continue
            gone = [h for h in blocks if _decref(refs, h)]
            event = BlockRemoved(self._ext(gone), MEDIUM[tier], OWNERSHIP) if gone else None
            self.order.removed((tier, key), event, gone)

    def cleared(self, tier: Tier) -> None:
        """tier holds nothing now: its blocks are announced removed."""
        self.removed(tier, list(self._held[tier]))

    def cleared_all(self) -> None:
        """Forget every tier and tell subscribers to (AllBlocksCleared: the service starts afresh)."""
        for tier in Tier:
            self._held[tier].clear()
            self._refs[tier].clear()
        self.order.cleared(AllBlocksCleared())

    # ------------------------------------------------------------------------------- reading
    def held_hashes(self, tier: Tier) -> set[bytes]:
        """The block hashes announced as held by tier (what a subscriber rebuilds), those of events
        still waiting for their parent's included."""
        return set(self._refs[tier])

    def flush(self) -> None:
        """Send the pending events as one batch now."""
        self._flush_scheduled = False
        if self._pending:
            events, self._pending = self._pending, []
            self._sink(KVEventBatch(time.time(), events))

    # ------------------------------------------------------------------------------- helpers
    def _blocks(self, key: ChunkKey, hashes: Sequence[bytes]) -> Sequence[bytes]:
        """key's block hashes as they arrive, or as another tier holds them when that one knows
        more (a promotion names none; a tier's copy may lack the description the commit gave)."""
        if hashes and description_of(hashes):
            return hashes
        known = self._known(key)
        if not hashes or (description_of(known) and tuple(known) == tuple(hashes)):
            return known
        return hashes

    def _known(self, key: ChunkKey) -> Sequence[bytes]:
        """key's block hashes as another tier holds them (a described copy first), else the one
        hash its key holds."""
        plain: Sequence[bytes] = ()
        for chunks in self._held.values():
            blocks = chunks.get(key)
            if blocks and description_of(blocks):
                return blocks
            plain = plain or blocks or ()
        return plain or (key.prefix_hash,)

    def _stored_events(
        self, tier: Tier, namespace: str, blocks: Sequence[bytes], new: list[int]
    ) -> Iterator[tuple[BlockStored, bytes | None, Sequence[bytes]]]:
        """BlockStored for blocks[i] of every i in new: self-describing, one event per run of
        consecutive blocks (each with its own parent), when the chunk's description is known; with
        each, the parent's hash it must follow (None: none) and the hashes it names."""
        desc = _description(blocks)
        if desc is None:
            self.undescribed += 1
            spec = self.namespaces.get(namespace)
            block_size = spec.block_size if spec is not None else 0  # 0: no engine named it yet
            named = [blocks[i] for i in new]
            event = BlockStored(
                self._ext(named), None, [], block_size, None, MEDIUM[tier], None, None, OWNERSHIP
            )
            yield event, None, named
            return
        tokens = desc.token_ids()
        size = len(tokens) // len(blocks)
        for start, end in _runs(new):
            parent = desc.parent if start == 0 else blocks[start - 1]
            extra = desc.extra_keys[start:end] if desc.extra_keys is not None else [None] * (end - start)
            event = BlockStored(
                self._ext(list(blocks[start:end])),
                self._ext([parent])[0] if parent else None,
                tokens[start * size : end * size],
                size,
                desc.lora_id,
                MEDIUM[tier],
                desc.lora_name,
                extra,
                OWNERSHIP,
            )
            yield event, parent or None, blocks[start:end]

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


def _description(blocks: Sequence[bytes]) -> Description | None:
    """The description of a chunk's blocks when it is known and fits them (whole blocks of tokens,
    one extra-keys entry per block)."""
    desc = decode_description(description_of(blocks))
    if desc is None:
        return None
    count = len(desc.tokens) // 4
    if not count or count % len(blocks):
        return None
    if desc.extra_keys is not None and len(desc.extra_keys) != len(blocks):
        return None
    return desc


def _runs(indexes: list[int]) -> Iterator[tuple[int, int]]:
    """The runs of consecutive values of sorted indexes, as (first, last + 1)."""
    start = prev = indexes[0]
    for i in indexes[1:]:
        if i != prev + 1:
            yield start, prev + 1
            start = i
        prev = i
    yield start, prev + 1


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
