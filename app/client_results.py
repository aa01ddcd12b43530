"""What a ServiceClient call returns (re-exported by kvtier.app.client), and how each wire answer
becomes it.

Replies arrive with their slots already decoded as ``SlotRef`` objects, except a lookup's, which
come as offsets and lengths and are made into SlotRefs on access (``SlotList``); the conversions
below only wrap them, on whichever thread read the reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.app import protocol as p
from kvtier.storage.base import ArenaInfo, LookupResult, SlotList, SlotRef, StageResult


@dataclass(frozen=True, slots=True)
class HelloReply:
    """Handshake answer: the service instance, its arena, and the namespace registered (if any)."""

    instance_id: str
    arena: ArenaInfo
    namespace: str = ""
    chunk_bytes: int = 0
    version: int = p.PROTOCOL_VERSION
    files: bool = False  # the service serves its disk files over the file channel

    @property
    def arena_path(self) -> str:
        """Path of the arena file to map."""
        return self.arena.path

    @property
    def arena_size(self) -> int:
        """Size of the arena file in bytes."""
        return self.arena.size


class LookupReply(msgspec.Struct, frozen=True):
    """A lookup's result and the service instance whose slots it names."""

    result: LookupResult
    instance_id: str


class StageReply(msgspec.Struct, frozen=True):
    """A stage's result and the service instance whose slots it names."""

    result: StageResult
    instance_id: str


class ReserveReply(msgspec.Struct, frozen=True):
    """Slots to fill (None where stored already or out of space) and their service instance."""

    slots: list[SlotRef | None]
    instance_id: str


class HealthReply(msgspec.Struct, frozen=True):
    """Whether the service can serve, and each tier's state."""

    serving: bool
    tiers: dict[str, bool]
    instance_id: str


def _hello(msg: p.HelloOk) -> HelloReply:
    return HelloReply(
        msg.instance_id,
        ArenaInfo(msg.arena_path, msg.arena_size),
        msg.namespace,
        msg.chunk_bytes,
        msg.version,
        msg.files,
    )


def _lookup(msg: p.LookupOk) -> LookupReply:
    tiers = msg.tiers
    if not isinstance(tiers, list):  # every hit is in this tier (see protocol.LookupOk)
        tiers = [tiers] * msg.num_hit
    slots = SlotList.from_packed(msg.offsets, msg.lengths)
    return LookupReply(LookupResult(msg.num_hit, tiers, slots), msg.instance_id)


def _stage(msg: p.StageOk) -> StageReply:
    return StageReply(StageResult(msg.slots, msg.tiers, msg.failed), msg.instance_id)


def _reserve(msg: p.ReserveOk) -> ReserveReply:
    return ReserveReply(msg.slots, msg.instance_id)


def _none(msg: p.OkReply) -> None:
    return None


def _count(msg: p.CountReply) -> int:
    return msg.count


def _stats(msg: p.StatsOk) -> dict[str, Any]:
    return msg.stats


def _health(msg: p.HealthOk) -> HealthReply:
    return HealthReply(msg.serving, msg.tiers, msg.instance_id)


# For each request the client waits on: the wire answer that completes it, and what turns that
# answer into the call's result. (A Release gets no answer: see ServiceClient.release.)
CONVERT: dict[type, tuple[type, Callable[[Any], Any]]] = {
    p.Hello: (p.HelloOk, _hello),
    p.Lookup: (p.LookupOk, _lookup),
    p.Stage: (p.StageOk, _stage),
    p.Reserve: (p.ReserveOk, _reserve),
    p.Commit: (p.OkReply, _none),
    p.Abort: (p.OkReply, _none),
    p.DiskReads: (p.OkReply, _none),
    p.Delete: (p.CountReply, _count),
    p.Clear: (p.CountReply, _count),
    p.Stats: (p.StatsOk, _stats),
    p.Health: (p.HealthOk, _health),
    p.Report: (p.OkReply, _none),
}

# What a message sent with no reply expects (a Release with reply=False): nothing ever answers it.
NO_REPLY: tuple[type, Callable[[Any], Any]] = (type(None), _none)
