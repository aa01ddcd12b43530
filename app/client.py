"""Client of the kvtier service, for vLLM's synchronous hooks.

Who owns what: a ``ServiceClient`` owns one background thread running its own event loop, and that
loop owns the connection, the reconnect schedule and the sweep (kvtier.app.client_loop). Public
methods may be called from any thread; each returns a ``Call``, a future.
Design: docs/internals.md#service-client-clientpy-client_looppy-client_connectionpy-client_callpy
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.app import protocol as p
from kvtier.app.client_call import Call, fail, failed
from kvtier.app.client_errors import (
    AuthFailed,
    CallTimeout,
    ClientClosed,
    RemoteError,
    ServiceError,
    ServiceUnavailable,
    StaleInstance,
)
from kvtier.app.client_loop import CLOSED, CONNECTING, DOWN, READY, ClientLoop, Forks
from kvtier.app.client_reconnect import Backoff, ConstantBackoff, ExponentialBackoff
from kvtier.app.client_results import CONVERT, HealthReply, HelloReply, LookupReply, ReserveReply, StageReply
from kvtier.storage.base import ArenaInfo, NamespaceSpec, SlotRef, Tier

__all__ = [
    "AuthFailed",
    "Backoff",
    "Call",
    "CallTimeout",
    "ClientClosed",
    "ConstantBackoff",
    "ExponentialBackoff",
    "HealthReply",
    "HelloReply",
    "LookupReply",
    "RemoteError",
    "ReserveReply",
    "ServiceClient",
    "ServiceError",
    "ServiceUnavailable",
    "StageReply",
    "StaleInstance",
]

DEFAULT_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0
# Held lookups (see lookup's hold) go out once this many bytes wait, about 20 of them: in a burst
# of arrivals the service answers the first ones while later ones are still being made.
HOLD_BYTES = 4096


class ServiceClient(ClientLoop):
    """Thread-safe client of one kvtier service; every call returns a Call (a future)."""

    def __init__(
        self,
        url: str,
        auth_token: str = "",
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        backoff: Backoff | None = None,
        on_unavailable: Callable[[], object] | None = None,
        on_connect: Callable[[HelloReply], object] | None = None,
        name: str = "kvtier-client",
    ) -> None:
        backoff = backoff or ExponentialBackoff()
        super().__init__(url, auth_token, timeout, connect_timeout, backoff, on_unavailable, on_connect, name)
        atexit.register(self.close)

    # ----------------------------------------------------------------------------------- public API
    def hello(self, spec: NamespaceSpec | None = None, timeout: float | None = None) -> Call[HelloReply]:
        """Register spec's namespace (kept across reconnects); learn the arena and instance id."""
        if spec is not None:
            with self._lock:
                self._specs[spec] = None  # registered again after every reconnect
        msg = p.Hello(id=next(self._ids), version=p.PROTOCOL_VERSION, token=self._token, spec=spec)
        return self._call(msg, timeout)

    def lookup(
        self,
        namespace: str,
        hashes: list[bytes],
        lease_id: str,
        timeout: float | None = None,
        *,
        replaces: str = "",
        hold: bool = False,
        stage: bool = False,
        direct_disk: bool = False,
    ) -> Call[LookupReply]:
        """Count leading stored chunks and lease them under lease_id (replacing that lease); then
        end the lease replaces, when set, as a release of it right after would (one call, not two,
        and a lookup that finds the same chunks takes over their pins).

        hold: the answer is not needed yet. While another call is in flight (a burst of
        arrivals), the lookup then waits to go out with the next frame sent, when a thread waits
        on (or polls) its future, once HOLD_BYTES wait, or within SWEEP_PERIOD_S, so that a burst
        takes a few sends instead of one each (each send wakes the service, at a cost to the
        caller's CPU). With nothing in flight it goes out at once, as Nagle's algorithm sends when
        nothing is unacknowledged: a lone arrival's answer is not delayed.

        stage: when the hit has chunks in lower tiers, the service starts staging them right after
        it answers, within its prestage budget, so the reads run while the request waits; a later
        stage() of the lease joins them. direct_disk: the engine reads disk hits itself (file
        channel), so only a hit with Redis chunks is read ahead.
        """
        folded = ""
        if not replaces and self._releases:  # a lease release() kept rides along (see the module doc)
            folded = replaces = self._take_release()
        msg = p.Lookup(
            id=next(self._ids),
            namespace=namespace,
            hashes=hashes,
            lease_id=lease_id,
            replaces=replaces,
            stage=stage,
            direct_disk=direct_disk,
        )
        return self._call(msg, timeout, folded, hold)

    def stage(self, lease_id: str, timeout: float | None = None) -> Call[StageReply]:
        """Bring every chunk of the lease into arena slots."""
        return self._call(p.Stage(id=next(self._ids), lease_id=lease_id), timeout)

    def disk_reads(
        self, namespace: str, hashes: list[bytes], nbytes: int, corrupt: list[bytes]
    ) -> Call[None]:
        """Tell the service which disk chunks this engine read from their files itself (hits, nbytes
        in all) and which of them were corrupt (the service counts and removes those)."""
        msg = p.DiskReads(
            id=next(self._ids), namespace=namespace, hashes=hashes, nbytes=nbytes, corrupt=corrupt
        )
        return self._call(msg, None)

    def reserve(
        self, namespace: str, hashes: list[bytes], timeout: float | None = None
    ) -> Call[ReserveReply]:
        """Slots to fill for these chunks; each must end in commit() or abort()."""
        return self._call(p.Reserve(id=next(self._ids), namespace=namespace, hashes=hashes), timeout)

    def commit(
        self,
        namespace: str,
        hashes: list[bytes],
        slots: list[SlotRef],
        instance_id: str = "",
        timeout: float | None = None,
        block_hashes: list[list[bytes]] | None = None,
        descriptions: list[bytes] | None = None,
    ) -> Call[None]:
        """Publish filled slots; with instance_id, fails with StaleInstance after a restart.
        block_hashes: each chunk's vLLM block hashes, named by the service's KV events;
        descriptions: each chunk's (app/chunk_description.py), which make those events self-describing."""
        msg = p.Commit(
            id=next(self._ids),
            namespace=namespace,
            hashes=hashes,
            slots=slots,
            instance_id=instance_id,
            block_hashes=block_hashes or [],
            descriptions=descriptions or [],
        )
        return self._call(msg, timeout)

    def abort(self, slots: list[SlotRef], instance_id: str = "", timeout: float | None = None) -> Call[None]:
        """Give reserved slots back unfilled."""
        return self._call(p.Abort(id=next(self._ids), slots=slots, instance_id=instance_id), timeout)

    def release(self, lease_id: str) -> None:
        """End a lease (idempotent), with this client's next call or within SWEEP_IDLE_PERIOD_S;
        while the service is unreachable, once it is reached again.

        No reply comes, which spares a write in the service and a read here, and nothing can fail
        that the caller could act on (a release of a lease that is gone does nothing).
        """
        if not lease_id or self._closed or self._forks != Forks.count:
            return  # no lease named, or no connection of this client will ever send it
        self._releases.append(lease_id)  # before the sweep check: see _sweep
        with self._lock:
            self._sweep_later()

    def delete(self, namespace: str, hashes: list[bytes], timeout: float | None = None) -> Call[int]:
        """Remove chunks from every tier; the future gives how many were found."""
        return self._call(p.Delete(id=next(self._ids), namespace=namespace, hashes=hashes), timeout)

    def clear(self, tiers: list[Tier] | None = None, timeout: float | None = None) -> Call[int]:
        """Drop every unleased chunk of these tiers (None = all); gives how many were dropped."""
        return self._call(p.Clear(id=next(self._ids), tiers=[int(t) for t in tiers or []]), timeout)

    def stats(self, timeout: float | None = None) -> Call[dict[str, Any]]:
        """The `kvtier stats --json` object."""
        return self._call(p.Stats(id=next(self._ids)), timeout)

    def health(self, timeout: float | None = None) -> Call[HealthReply]:
        """Whether the service can serve, and each tier's state."""
        return self._call(p.Health(id=next(self._ids)), timeout)

    def report(
        self, engine_id: str, role: str, active: bool, reason: str = "", timeout: float | None = None
    ) -> Call[None]:
        """Tell the service whether this side (role) of the engine serves, and why not. The service
        lists it while this client is connected; it is told again after every reconnect."""
        msg = p.Report(
            id=next(self._ids),
            engine_id=engine_id[: p.MAX_NAME_CHARS],
            role=role[: p.MAX_NAME_CHARS],
            active=active,
            reason=reason[: p.MAX_REASON_CHARS],  # a longer one would not decode there
        )
        with self._lock:
            self._report = msg
        return self._call(msg, timeout)

    @property
    def connected(self) -> bool:
        """True while connected and handshaken."""
        return self._state == READY

    @property
    def instance_id(self) -> str:
        """The connected (or last known) service instance; '' before the first handshake."""
        hello = self._hello
        return hello.instance_id if hello is not None else ""

    @property
    def arena(self) -> ArenaInfo | None:
        """The arena of the connected (or last known) service instance."""
        hello = self._hello
        return hello.arena if hello is not None else None

    def wait_connected(self, timeout: float) -> bool:
        """Block until connected and handshaken (or timeout); for tools and tests, not for hooks."""
        return self._ready.wait(timeout)

    def close(self) -> None:
        """Fail outstanding calls, close the connection and stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self._forks != Forks.count or not self._thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._shutdown)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- caller side
    def _call(self, msg: Any, timeout: float | None, folded: str = "", hold: bool = False) -> Call[Any]:
        """Send msg and return its future; folded is a kept release msg carries, hold says the
        frame may wait for company (see lookup)."""
        if self._closed or self._forks != Forks.count:
            return failed(ClientClosed("the client is closed (or was created in another process)"))
        if self._state is DOWN:  # unlocked read: failing fast must not wait for the lock
            return failed(self._unavailable())
        try:
            frame = self._encode(msg)
        except p.ProtocolError as exc:
            if folded:
                self._releases.appendleft(folded)  # not sent: the next call takes it
            return failed(ServiceError(str(exc)))
        if self._releases:  # ids no lookup took: Release frames, held to go out ahead of this one
            self._send_releases()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        call: Call[Any] = Call(self, msg.id, frame, CONVERT[type(msg)], deadline)
        with self._lock:
            conn = self._conn
            if self._state is READY and conn is not None:
                # The usual case: sent at once (queued behind what the socket did not take yet).
                self._pending[call.id] = call  # before the bytes leave: the reply may come at once
                if (
                    hold
                    and len(self._pending) > 1
                    and len(conn.held) + len(frame) <= HOLD_BYTES
                    and not conn.pending_out
                ):
                    conn.hold(frame)  # the sweep sends it if nothing else does first
                    sent = True
                else:
                    sent = conn.write(frame)
                if sent:
                    # A held frame goes out within SWEEP_PERIOD_S, a call fails at its deadline.
                    if conn.held:
                        self._sweep_soon(deadline)
                    else:
                        self._sweep_later(deadline)
                    return call
                del self._pending[call.id]
                error: ServiceError | None = self._unavailable("connection lost")
            else:
                error = self._queue_or_refuse(call)
        if error is not None:
            fail(call, error)
        return call

    def _queue_or_refuse(self, call: Call) -> ServiceError | None:
        """A call made while not connected (caller holds the lock): queued while the first connect
        is under way, else refused; returns the error to fail it with."""
        state = self._state
        if state == CONNECTING:
            self._queue.append(call)
        elif state == CLOSED:
            return ClientClosed("the client is closed")
        else:
            return self._unavailable()
        self._sweep_soon()
        return None
