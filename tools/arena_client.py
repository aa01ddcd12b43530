"""Just enough of the service client for a worker, without a service: reserve hands out slots of a real
arena in order, and commits, aborts and lease releases are recorded. The device check and the worker
tests drive ``WorkerSide`` with it (a GPU machine has no kvtier service to talk to)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvtier.app.client import HelloReply, ReserveReply
from kvtier.storage.arena import Arena
from kvtier.storage.base import NamespaceSpec, SlotRef


def done(value: Any) -> Future[Any]:
    """A future that already holds value."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class ArenaClient:
    """A stand-in ServiceClient over one arena: slots handed out in order, everything else recorded."""

    def __init__(self, arena: Arena, chunk_bytes: int, instance_id: str = "inst-1") -> None:
        self.arena, self.chunk_bytes = arena, chunk_bytes
        self.connected, self.instance_id = True, instance_id
        self.commits: list[tuple[list[bytes], list[SlotRef]]] = []
        self.aborted: list[SlotRef] = []
        self.released: list[str] = []
        self.specs: list[NamespaceSpec | None] = []  # of each hello
        self.namespaces: list[tuple[str, str]] = []  # ("reserve" or "commit", namespace) of each call
        self._next = 0

    def hello(self, spec: NamespaceSpec | None = None, timeout: float | None = None) -> Future[HelloReply]:
        """The arena of this stand-in instance."""
        self.specs.append(spec)
        return done(HelloReply(self.instance_id, self.arena.info(), "ns", self.chunk_bytes))

    def reserve(self, namespace: str, hashes: list[bytes]) -> Future[ReserveReply]:
        """The next free slots, one per hash."""
        self.namespaces.append(("reserve", namespace))
        slots: list[SlotRef | None] = []
        for _ in hashes:
            slots.append(SlotRef(self._next, self.chunk_bytes))
            self._next += self.chunk_bytes
        return done(ReserveReply(slots, self.instance_id))

    def commit(
        self, namespace: str, hashes: list[bytes], slots: list[SlotRef], instance: str
    ) -> Future[None]:
        """Record the commit."""
        self.namespaces.append(("commit", namespace))
        self.commits.append((list(hashes), list(slots)))
        return done(None)

    def abort(self, slots: list[SlotRef], instance: str) -> None:
        """Record the slots given back."""
        self.aborted.extend(slots)

    def release(self, lease_id: str) -> None:
        """Record the lease ended."""
        self.released.append(lease_id)

    def report(self, engine_id: str, role: str, active: bool, reason: str) -> None:
        """The connector's state report: nothing to tell without a service."""
