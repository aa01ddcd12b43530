"""What kvtier's client returns and raises, and its reconnect policies (re-exported by kvtier.app.client).

Replies arrive with their slots already decoded as ``SlotRef`` objects, except a lookup's, which
come as offsets and lengths and are made into SlotRefs on access (``SlotList``); the conversion
functions below only wrap them, on whichever thread read the reply (see kvtier.app.client).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvtier.app import protocol as p
from kvtier.storage.base import ArenaInfo, LookupResult, SlotList, SlotRef, StageResult


# ------------------------------------------------------------------------------------------- errors
class ServiceError(Exception):
    """Base of every error a client call can fail with."""


class ServiceUnavailable(ServiceError):
    """The service cannot be reached now (not connected, connection lost, reconnecting)."""


class ClientClosed(ServiceUnavailable):
    """The client was closed, or is used in a process it was not created in (after fork)."""


class CallTimeout(ServiceError, TimeoutError):
    """The service did not answer within the call's timeout."""


class RemoteError(ServiceError):
    """The service refused the call; ``code`` is one of protocol.ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class StaleInstance(RemoteError):
    """Slots named in the call belong to an earlier service instance (the service restarted)."""


class AuthFailed(RemoteError):
    """The service wants a different auth token (or a different protocol version)."""


def remote_error(reply: p.ErrorReply) -> RemoteError:
    """The typed exception for an ErrorReply."""
    if reply.code == p.ErrorCode.STALE_INSTANCE:
        return StaleInstance(reply.code, reply.message)
    if reply.code in (p.ErrorCode.AUTH, p.ErrorCode.VERSION):
        return AuthFailed(reply.code, reply.message)
    return RemoteError(reply.code, reply.message)


# ------------------------------------------------------------------------------------------ replies
@dataclass(frozen=True, slots=True)
class HelloReply:
    """Handshake answer: the service instance, its arena, and the namespace registered (if any)."""

    instance_id: str
    arena: ArenaInfo
    namespace: str = ""
    chunk_bytes: int = 0
    version: int = p.PROTOCOL_VERSION

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


def _hello(msg: p.HelloReply) -> HelloReply:
    return HelloReply(
        msg.instance_id,
        ArenaInfo(msg.arena_path, msg.arena_size),
        msg.namespace,
        msg.chunk_bytes,
        msg.version,
    )


def _lookup(msg: p.LookupReply) -> LookupReply:
    tiers = msg.tiers
    if not isinstance(tiers, list):  # every hit is in this tier (see protocol.LookupReply)
        tiers = [tiers] * msg.num_hit
    slots = SlotList.from_packed(msg.offsets, msg.lengths)
    return LookupReply(LookupResult(msg.num_hit, tiers, slots), msg.instance_id)


def _stage(msg: p.StageReply) -> StageReply:
    return StageReply(StageResult(msg.slots, msg.tiers, msg.failed), msg.instance_id)


def _reserve(msg: p.ReserveReply) -> ReserveReply:
    return ReserveReply(msg.slots, msg.instance_id)


def _none(msg: p.OkReply) -> None:
    return None


def _count(msg: p.CountReply) -> int:
    return msg.count


def _stats(msg: p.StatsReply) -> dict[str, Any]:
    return msg.stats


def _health(msg: p.HealthReply) -> HealthReply:
    return HealthReply(msg.serving, msg.tiers, msg.instance_id)


CONVERT: dict[type, tuple[type, Callable[[Any], Any]]] = {
    p.Hello: (p.HelloReply, _hello),
    p.Lookup: (p.LookupReply, _lookup),
    p.Stage: (p.StageReply, _stage),
    p.Reserve: (p.ReserveReply, _reserve),
    p.Commit: (p.OkReply, _none),
    p.Abort: (p.OkReply, _none),
    p.Release: (p.OkReply, _none),
    p.Delete: (p.CountReply, _count),
    p.Clear: (p.CountReply, _count),
    p.Stats: (p.StatsReply, _stats),
    p.Health: (p.HealthReply, _health),
    p.Report: (p.OkReply, _none),
}


# What a message sent with no reply expects (a Release with reply=False): nothing ever answers it.
NO_REPLY: tuple[type, Callable[[Any], Any]] = (type(None), _none)


# ------------------------------------------------------------------------------------------ backoff
class Backoff(Protocol):
    """Reconnect schedule: seconds to wait before reconnect attempt number ``attempt`` (0-based)."""

    def delay(self, attempt: int) -> float:
        """Seconds before this attempt."""


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """initial * factor**attempt, capped, with +-jitter so many clients do not reconnect in step."""

    initial: float = 0.05
    factor: float = 2.0
    maximum: float = 2.0
    jitter: float = 0.2

    def delay(self, attempt: int) -> float:
        """Seconds before this attempt."""
        base = min(self.maximum, self.initial * self.factor ** min(attempt, 32))
        return max(0.0, base * (1.0 + random.uniform(-self.jitter, self.jitter)))


@dataclass(frozen=True, slots=True)
class ConstantBackoff:
    """The same short wait before every attempt (tests)."""

    seconds: float = 0.01

    def delay(self, attempt: int) -> float:
        """Seconds before this attempt."""
        return self.seconds
