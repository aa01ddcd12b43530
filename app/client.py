"""Client of the kvtier service, for vLLM's synchronous hooks.

Who owns what: a ``ServiceClient`` owns one background thread running its own event loop, and that
loop owns the connection, the reconnect schedule and the timeout sweep. Public methods may be
called from any thread: each encodes its request and, while connected, writes it to the socket
itself (non-blocking, under the client's lock, with any remainder flushed by the loop), then
returns a ``concurrent.futures.Future``. ``release_nowait`` returns nothing and gets no reply: the
lease id rides in the next lookup that ends no lease of its own (as its ``replaces``: one frame for
both, and the new lease can take over the old one's pins when they hold the same chunks); failing
that it goes out as a Release frame in the same send as the next call's, or with the loop's next
sweep, within SWEEP_IDLE_PERIOD_S, if no call comes.
Writing from the calling thread saves a wake-up of the loop thread per call, and reading is
symmetric: a thread that blocks on a future (``result()`` or ``exception()``, with no timeout or a
positive one) reads the socket itself while no other thread does, so its reply wakes it directly,
not the loop thread that would then wake it (app/channel.py). Replies for other calls that it
reads on the way complete their futures in its thread. The loop thread reads whenever no caller
blocks reading: at once for a caller that polls (``done()``, ``result(0)``), and for a reply that
nobody waits for, at once while it watches the socket, else (a caller read last) with its next
sweep, within SWEEP_IDLE_PERIOD_S, and always before that reply's call could be found late.
The sweep runs by the first deadline of a call in flight and otherwise rarely, as each wake-up of
the loop thread costs vLLM's forward (see SWEEP_IDLE_PERIOD_S).
While the service is unreachable every call fails immediately with ``ServiceUnavailable`` (a
connector turns it into a miss); the loop keeps reconnecting with backoff, calls
``on_unavailable`` (embedded mode respawns the service there), and after a reconnect registers
every namespace again before serving calls.

The lock guards the socket's writes, the table of calls in flight and the connection state; the
loop thread takes it only briefly and never blocks while holding it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import msgspec

from kvtier.app import protocol as p
from kvtier.app.address import Address, parse_url
from kvtier.app.channel import FINISHED, PENDING, Call, Channel, fail, fail_calls, failed
from kvtier.app.client_types import (
    CONVERT,
    NO_REPLY,
    AuthFailed,
    Backoff,
    CallTimeout,
    ClientClosed,
    ConstantBackoff,
    ExponentialBackoff,
    HealthReply,
    HelloReply,
    LookupReply,
    RemoteError,
    ReserveReply,
    ServiceError,
    ServiceUnavailable,
    StageReply,
    StaleInstance,
    remote_error,
)
from kvtier.runtime.affinity import engine_cpus, run_on
from kvtier.runtime.event_loop import new_event_loop
from kvtier.storage.base import ArenaInfo, NamespaceSpec, SlotRef, Tier

__all__ = [
    "AuthFailed",
    "Backoff",
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

log = logging.getLogger("kvtier.client")

DEFAULT_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0
SWEEP_PERIOD_S = 0.01  # timeouts fire within this much of their deadline, held lookups go out within it
# Between those, the sweep wakes only this often: to send the releases no call took along, and to
# watch for replies again that nobody waits for. Every wake-up of the loop thread lands in the
# middle of vLLM's forward, on its cores: waking every SWEEP_PERIOD_S instead (two clients in an
# engine, 30 wake-ups in a 1537-token prefill) made that prefill 2.2% slower (median of 40 pairs).
SWEEP_IDLE_PERIOD_S = 0.2
# The sweep goes on this long after the client was last busy, so that a call or release_nowait()
# made meanwhile need not start one: starting a sweep wakes the loop thread, and on a 2-core VM that
# wake-up ran the loop thread on the caller's core, in the middle of vLLM's step.
SWEEP_LINGER_S = 1.0
# Held lookups (see lookup's hold) go out once this many bytes wait, about 20 of them: in a burst
# of arrivals the service answers the first ones while later ones are still being made.
HOLD_BYTES = 4096
_DOWN, _CONNECTING, _READY, _CLOSED = "down", "connecting", "ready", "closed"


class _Forks:
    """How many times this process is a forked child: a client made before a fork serves only the
    process that made it, and comparing a count costs less than os.getpid() (a system call) per call."""

    count = 0

    @classmethod
    def bump(cls) -> None:
        """Run in every forked child."""
        cls.count += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Forks.bump)


class ServiceClient:
    """Thread-safe client of one kvtier service; every call returns a concurrent Future."""

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
        self._address: Address = parse_url(url)
        self.url = url
        self._token = auth_token
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._backoff: Backoff = backoff or ExponentialBackoff()
        self._on_unavailable = on_unavailable
        self._on_connect = on_connect
        self._forks = _Forks.count  # differs in a forked child: see _Forks
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._lock = threading.Lock()
        # Guarded by _lock: state, channel, calls in flight, calls queued while connecting.
        self._state = _CONNECTING
        self._down_reason = "not connected yet"
        self._channel: Channel | None = None
        self._pending: dict[int, Call] = {}
        self._queue: deque[Call] = deque()
        # Lease ids release_nowait() has not sent yet (see _call); a deque: any thread appends or
        # takes one without the lock.
        self._releases: deque[str] = deque()
        # By when (time.monotonic()) the sweep's next run is due, inf while it is off; any thread
        # reads it to decide whether it must wake the loop thread (see _sweep_by).
        self._sweep_due = math.inf
        self._sweep_timer: asyncio.TimerHandle | None = None  # loop thread
        self._timer_due = math.inf  # when _sweep_timer fires (loop thread)
        self._idle_since: float | None = None  # when the sweep first found nothing to do (loop thread)
        self._closed = False
        self._hello: HelloReply | None = None
        self._specs: dict[NamespaceSpec, None] = {}  # ordered set; read and written under _lock
        self._report: p.Report | None = None  # the last report(), sent again after every reconnect
        self._reconnect: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._loop = new_event_loop()
        self._cpus = engine_cpus()  # read here, in the caller's thread: see _run
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._loop_thread = self._thread.ident
        self._loop.call_soon_threadsafe(self._start_reconnect, 0.0)
        atexit.register(self.close)

    # ----------------------------------------------------------------------------------- public API
    def hello(self, spec: NamespaceSpec | None = None, timeout: float | None = None) -> Future[HelloReply]:
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
    ) -> Future[LookupReply]:
        """Count leading stored chunks and lease them under lease_id (replacing that lease); then
        end the lease replaces, when set, as a release of it right after would (one call, not two,
        and a lookup that finds the same chunks takes over their pins).

        hold: the answer is not needed yet. While another call is in flight (a burst of
        arrivals), the lookup then waits to go out with the next frame sent, when a thread waits
        on (or polls) its future, once HOLD_BYTES wait, or within SWEEP_PERIOD_S, so that a burst
        takes a few sends instead of one each (a send that wakes the service cost ~9 us of the
        caller's CPU on a 2-core VM). With nothing in flight it goes out at once, as Nagle's
        algorithm sends when nothing is unacknowledged: a lone arrival's answer is not delayed.
        """
        folded = ""
        if not replaces and self._releases:  # a lease release_nowait() kept rides along (see there)
            folded = replaces = self._take_release()
        msg = p.Lookup(
            id=next(self._ids), namespace=namespace, hashes=hashes, lease_id=lease_id, replaces=replaces
        )
        return self._call(msg, timeout, folded, hold)

    def stage(self, lease_id: str, timeout: float | None = None) -> Future[StageReply]:
        """Bring every chunk of the lease into arena slots."""
        return self._call(p.Stage(id=next(self._ids), lease_id=lease_id), timeout)

    def reserve(
        self, namespace: str, hashes: list[bytes], timeout: float | None = None
    ) -> Future[ReserveReply]:
        """Slots to fill for these chunks; each must end in commit() or abort()."""
        return self._call(p.Reserve(id=next(self._ids), namespace=namespace, hashes=hashes), timeout)

    def commit(
        self,
        namespace: str,
        hashes: list[bytes],
        slots: list[SlotRef],
        instance_id: str = "",
        timeout: float | None = None,
    ) -> Future[None]:
        """Publish filled slots; with instance_id, fails with StaleInstance after a restart."""
        msg = p.Commit(
            id=next(self._ids), namespace=namespace, hashes=hashes, slots=slots, instance_id=instance_id
        )
        return self._call(msg, timeout)

    def abort(
        self, slots: list[SlotRef], instance_id: str = "", timeout: float | None = None
    ) -> Future[None]:
        """Give reserved slots back unfilled."""
        return self._call(p.Abort(id=next(self._ids), slots=slots, instance_id=instance_id), timeout)

    def release(self, lease_id: str, timeout: float | None = None) -> Future[None]:
        """End a lease (idempotent); the future says when the service has."""
        return self._call(p.Release(id=next(self._ids), lease_id=lease_id), timeout)

    def release_nowait(self, lease_id: str) -> None:
        """End a lease without an answer (what the connector uses: it never waits for one).

        The service ends it with this client's next call (in the next lookup that ends no lease
        itself, as that lookup's ``replaces``) or within SWEEP_IDLE_PERIOD_S, and sends no reply frame,
        which spares a write there and a read here. Nothing can fail that the caller could act on:
        a lease taken on a connection that is gone was released with it by the service.
        """
        if not lease_id or self._closed or self._forks != _Forks.count or self._state is _DOWN:
            return  # no lease named; or (unlocked read, as in _call) the connection and the lease are gone
        self._releases.append(lease_id)  # before the sweep check: see _sweep
        with self._lock:
            self._sweep_by(time.monotonic() + SWEEP_IDLE_PERIOD_S)

    def delete(self, namespace: str, hashes: list[bytes], timeout: float | None = None) -> Future[int]:
        """Remove chunks from every tier; the future gives how many were found."""
        return self._call(p.Delete(id=next(self._ids), namespace=namespace, hashes=hashes), timeout)

    def clear(self, tiers: list[Tier] | None = None, timeout: float | None = None) -> Future[int]:
        """Drop every unleased chunk of these tiers (None = all); gives how many were dropped."""
        return self._call(p.Clear(id=next(self._ids), tiers=[int(t) for t in tiers or []]), timeout)

    def stats(self, timeout: float | None = None) -> Future[dict[str, Any]]:
        """The `kvtier stats --json` object."""
        return self._call(p.Stats(id=next(self._ids)), timeout)

    def health(self, timeout: float | None = None) -> Future[HealthReply]:
        """Whether the service can serve, and each tier's state."""
        return self._call(p.Health(id=next(self._ids)), timeout)

    def report(
        self, engine_id: str, role: str, active: bool, reason: str = "", timeout: float | None = None
    ) -> Future[None]:
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
        return self._state == _READY

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
        if self._forks != _Forks.count or not self._thread.is_alive():
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
    def _encode(self, msg: Any) -> bytes:
        """msg as a frame, by this thread's encoder (each keeps a buffer for the next frame)."""
        try:
            encode = self._local.encode
        except AttributeError:  # this thread's first call
            encode = self._local.encode = p.FrameEncoder().encode
        return encode(msg)  # type: ignore[no-any-return]

    def _call(self, msg: Any, timeout: float | None, folded: str = "", hold: bool = False) -> Future[Any]:
        """Send msg and return its future; folded is a kept release msg carries, hold says the
        frame may wait for company (see lookup)."""
        if self._closed or self._forks != _Forks.count:
            return failed(ClientClosed("the client is closed (or was created in another process)"))
        if self._state is _DOWN:  # unlocked read: failing fast must not wait for the lock
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
        call = Call(self, msg.id, frame, CONVERT[type(msg)], deadline)
        with self._lock:
            channel = self._channel
            if self._state is _READY and channel is not None:
                # The usual case: sent at once (queued behind what the socket did not take yet).
                self._pending[call.id] = call  # before the bytes leave: the reply may come at once
                if (
                    hold
                    and len(self._pending) > 1
                    and len(channel.held) + len(frame) <= HOLD_BYTES
                    and not channel.pending_out
                ):
                    channel.hold(frame)  # the sweep sends it if nothing else does first
                    sent = True
                else:
                    sent = channel.write(frame)
                if sent:
                    # A held frame goes out within SWEEP_PERIOD_S, a call fails at its deadline.
                    now = time.monotonic()
                    soon = SWEEP_PERIOD_S if channel.held else SWEEP_IDLE_PERIOD_S
                    self._sweep_by(min(deadline, now + soon))
                    return call
                del self._pending[call.id]
                error: ServiceError | None = self._unavailable("connection lost")
            else:
                error = self._queue_or_refuse(call)
        if error is not None:
            fail(call, error)
        return call

    def _take_release(self) -> str:
        """A lease id release_nowait() kept, or '' when another thread took the last one."""
        try:
            return self._releases.popleft()
        except IndexError:
            return ""

    def _send_releases(self) -> None:
        """Send the lease ids release_nowait() kept as Release frames that get no reply (not
        under the lock)."""
        while lease_id := self._take_release():
            self._send_only(p.Release(id=next(self._ids), lease_id=lease_id, reply=False))

    def _send_only(self, msg: Any) -> None:
        """Send a message that gets no reply: now, or once connected; dropped while down or closed."""
        if self._closed or self._forks != _Forks.count or self._state is _DOWN:
            return  # unlocked read, as in _call: the connection is gone and with it what msg names
        frame = self._encode(msg)
        with self._lock:
            channel = self._channel
            if self._state is _READY and channel is not None:
                # Out with the next call's frame (one send here, one read in the service), or
                # with the next sweep when none comes first.
                channel.hold(frame)
            elif self._state is _CONNECTING:  # after the calls queued before it, as sent in order
                self._queue.append(Call(None, msg.id, frame, NO_REPLY, time.monotonic() + self.timeout))
            else:
                return
            self._sweep_by(time.monotonic() + SWEEP_IDLE_PERIOD_S)

    def _queue_or_refuse(self, call: Call) -> ServiceError | None:
        """A call made while not connected (caller holds the lock): queued while the first connect
        is under way, else refused; returns the error to fail it with."""
        state = self._state
        if state == _CONNECTING:
            self._queue.append(call)
        elif state == _CLOSED:
            return ClientClosed("the client is closed")
        else:
            return self._unavailable()
        self._sweep_by(time.monotonic() + SWEEP_PERIOD_S)
        return None

    @property
    def _sweeping(self) -> bool:
        """Whether the sweep is on (it runs again by _sweep_due)."""
        return self._sweep_due < math.inf

    def _sweep_by(self, due: float) -> None:
        """Have the sweep run by due (time.monotonic()), waking the loop thread only when it would
        not (callers hold the lock, or run on the loop thread)."""
        if self._sweep_due <= due:  # on, and due by then already
            return
        self._sweep_due = due
        if threading.get_ident() == self._loop_thread:
            self._arm_sweep(due)
        else:
            with contextlib.suppress(RuntimeError):  # loop closed by close() meanwhile
                self._loop.call_soon_threadsafe(self._arm_sweep, due)

    def _arm_sweep(self, due: float) -> None:
        """Run the sweep at due, unless it runs sooner already (loop thread)."""
        if self._sweep_timer is not None:
            if self._timer_due <= due:
                return
            self._sweep_timer.cancel()
        self._timer_due = due
        self._sweep_timer = self._loop.call_later(max(0.0, due - time.monotonic()), self._sweep)

    def _unavailable(self, reason: str = "") -> ServiceUnavailable:
        return ServiceUnavailable(f"kvtier service {self.url}: {reason or self._down_reason}")

    # ------------------------------------------------------------------------------------ loop side
    def _run(self) -> None:
        # Off the cores vLLM binds its model to, or every reply waits behind the model (app/affinity.py).
        run_on(self._cpus)
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _sweep(self) -> None:
        """Fail calls past their deadline, send what is held and watch for replies again when no
        caller reads them; runs by the next deadline and every SWEEP_IDLE_PERIOD_S (SWEEP_PERIOD_S
        while calls wait for a connection) while any call is in flight or the loop thread is not
        watching, and for SWEEP_LINGER_S after that (loop thread)."""
        self._sweep_timer, self._timer_due = None, math.inf
        self._send_releases()  # release_nowait() appends before it checks that a sweep is on
        channel = self._channel
        if channel is not None and not channel.watched and channel.reading.acquire(blocking=False):
            # Replies that came while nobody watched go to their calls before any of those calls
            # can be found late (the sweep may come only at a deadline).
            self._read_and_leave(channel)
        now = time.monotonic()
        with self._lock:
            expired = self._take_expired(now)
            queued = [c for c in self._queue if c.deadline <= now]
            for call in queued:
                self._queue.remove(call)
            channel = self._channel
            if channel is not None and channel.held:
                channel.flush_held()
            if channel is not None and not channel.watched and not channel.reading.locked():
                channel.watch()  # replies nobody waits for, and a lost connection, get noticed
            idle = (
                not self._pending
                and not self._queue
                and not self._releases
                and (channel is None or channel.watched)
            )
            stop = False
            if not idle:
                self._idle_since = None
            elif self._idle_since is None:
                self._idle_since = now
            elif now - self._idle_since >= SWEEP_LINGER_S:
                stop, self._idle_since = True, None
            due = math.inf if stop else self._next_sweep(now)  # inf: off until a call needs it
            # Set under the lock: a caller that needs a sooner sweep sees it and wakes this thread.
            self._sweep_due = due
        for call in expired:
            fail(call, CallTimeout(f"no answer from {self.url} in time"))
        for call in queued:
            fail(call, CallTimeout(f"not connected to {self.url} in time"))
        if due < math.inf:
            self._arm_sweep(due)

    def _next_sweep(self, now: float) -> float:
        """When the sweep must run next (caller holds the lock): by the first deadline of a call in
        flight, soon while calls wait for a connection, else after an idle period."""
        if self._queue:
            return now + SWEEP_PERIOD_S
        # A copy made in one C call, as in _take_expired.
        first = min((c.deadline for c in list(self._pending.values())), default=math.inf)
        return min(now + SWEEP_IDLE_PERIOD_S, first)

    def _take_expired(self, now: float) -> list[Call]:
        """Remove and return the calls in flight past their deadline (caller holds the lock)."""
        # A reader pops its replies without the lock: iterate over a copy made in one C call (no
        # thread switch in between; iterating the dict itself raised "changed size during
        # iteration" and killed the sweep), and take only the calls still there.
        pending = self._pending
        late = [c for c in list(pending.values()) if c.deadline <= now]
        return [c for c in late if pending.pop(c.id, None) is not None]

    def _readable(self, channel: Channel) -> None:
        """Replies arrived and the loop thread watches for them (loop thread)."""
        if not channel.reading.acquire(blocking=False):
            # A caller reads them: stop watching until nobody does (see _sweep and await_reply), or
            # every reply would wake this thread too.
            channel.park()
            with self._lock:  # watched again once nobody reads them, by the reader or the sweep
                self._sweep_by(time.monotonic() + SWEEP_IDLE_PERIOD_S)
            return
        self._read_and_leave(channel)

    def _read_and_leave(self, channel: Channel) -> None:
        """Read and deliver what arrived, let go of reading, and reconnect if the connection is gone
        (loop thread, holding channel.reading)."""
        try:
            error = self._read(channel)
        finally:
            channel.leave()
        if error is not None:
            self._lost(channel, error)

    def _read(self, channel: Channel) -> str | None:
        """Read and deliver what arrived (holder of channel.reading); the error that lost it, if any."""
        try:
            replies = channel.receive()
        except (BlockingIOError, InterruptedError):
            return None
        except (OSError, EOFError) as exc:
            return f"connection lost ({exc})"
        except p.ProtocolError as exc:
            log.warning("bad frame from the service, reconnecting: %s", exc)
            return f"bad frame from the service ({exc})"
        pending = self._pending
        for reply in replies:
            call = pending.pop(reply.id, None)  # atomic; callers insert under the lock
            if call is None:
                self._late(reply)
                continue
            reply_type, convert = call.expect
            if type(reply) is reply_type:  # the usual answer, inline: this runs for every reply
                try:
                    call.set_result(convert(reply))
                except InvalidStateError:  # timed out meanwhile
                    pass
                except ValueError as exc:  # a reply that decodes but says nothing consistent
                    fail(call, ServiceError(f"bad {reply_type.__name__} from the service: {exc}"))
            else:
                self._refused(call, reply)
        return None

    def await_reply(self, future: Call, timeout: float | None) -> float | None:
        """Read replies in this thread until future is done, unless another thread reads them.

        Returns what is left of timeout, for the wait on the future itself (which another
        thread completes when this one cannot read: not connected, or someone else reads).
        A poll (timeout 0: done(), result(0)) reads nothing itself: see _watch_for.
        """
        channel = self._channel
        if channel is None or self._state is not _READY or threading.get_ident() == self._loop_thread:
            return timeout
        if channel.held:  # the call may be among the held frames: nobody answers what was not sent
            with self._lock:
                channel.flush_held()
        if timeout is not None and timeout <= 0.0:
            self._watch_for(channel)
            return timeout
        if not channel.reading.acquire(False):
            return timeout
        until = math.inf if timeout is None else time.monotonic() + timeout
        stop = until if until < future.deadline else future.deadline  # the sweep fails it then
        poll = channel.poll
        error = None
        try:
            while future._state is PENDING and not channel.closed:
                left = stop - time.monotonic()
                if poll(None if left == math.inf else left * 1000.0 if left > 0.0 else 0):
                    if error := self._read(channel):
                        break
                elif left <= 0.0:
                    break
        finally:
            channel.leave()
            if error is None and self._pending:
                self._watch_for(channel)  # other calls are in flight and nobody reads for them now
        if error is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._lost, channel, error)
        if timeout is None or future._state is FINISHED:
            return timeout  # nothing left to wait for, or no limit to it
        return max(0.0, until - time.monotonic())

    def _watch_for(self, channel: Channel) -> None:
        """Have the loop thread read replies again (it stops while a caller reads them)."""
        # Polls come here instead of reading: a read is a system call, which lets go of the GIL,
        # and a thread that lets go of the GIL and takes it back at once, as an engine loop that
        # polls its futures at every step does, keeps the process's other threads from ever
        # forcing a switch (seen: an in-process proxy starved into Redis timeouts).
        if not channel.watched and not channel.closed and not channel.watch_asked:
            channel.watch_asked = True
            with contextlib.suppress(RuntimeError):  # loop closed by close() meanwhile
                self._loop.call_soon_threadsafe(channel.watch)

    def _late(self, reply: Any) -> None:
        """A reply to a call that already timed out: give back what it reserved.

        The service owns reserved slots until commit, abort or the connection's end, so a dropped
        reserve answer would hold its slots for as long as this client stays connected. Leases need
        nothing here: the caller releases the lease id it chose whether or not the lookup answered.
        """
        if type(reply) is p.ReserveReply:
            slots = [s for s in reply.slots if s is not None]
            if slots:
                self._call(p.Abort(id=next(self._ids), slots=slots, instance_id=reply.instance_id), None)

    def _refused(self, call: Call, reply: Any) -> None:
        """Fail call with what its reply says went wrong (a reply not of the type it expects)."""
        kind = type(reply)
        if kind is p.ErrorReply:
            fail(call, remote_error(reply))
        else:
            fail(call, ServiceError(f"unexpected {kind.__name__} to a call"))

    def _flush(self, channel: Channel) -> None:
        """Write what the socket did not take before (loop thread, when it is writable)."""
        with self._lock:
            if channel.closed:
                return
            try:
                sent = channel.sock.send(channel.pending_out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                sent = len(channel.pending_out)  # broken: the reader reports it
            del channel.pending_out[:sent]
            if not channel.pending_out:
                channel.writer_armed = False
                self._loop.remove_writer(channel.fd)

    def _lost(self, channel: Channel, reason: str) -> None:
        with self._lock:
            if channel is not self._channel:
                return
            self._channel = None
            channel.close()
            calls = self._take_all()
            if self._state != _CLOSED:
                self._state, self._down_reason = _DOWN, reason
        self._ready.clear()
        fail_calls(calls, self._unavailable(reason))
        self._start_reconnect(0.0)

    def _take_all(self) -> list[Call]:
        """Every call in flight or queued, removed from the books (caller holds the lock)."""
        calls = [*self._pending.values(), *self._queue]
        self._pending, self._queue = {}, deque()
        return calls

    def _set_down(self, reason: str) -> list[Call]:
        with self._lock:
            if self._state != _CLOSED:
                self._state, self._down_reason = _DOWN, reason
            return self._take_all()

    def _start_reconnect(self, first_delay: float) -> None:
        if self._state == _CLOSED or (self._reconnect is not None and not self._reconnect.done()):
            return
        self._reconnect = self._loop.create_task(self._reconnect_loop(first_delay))

    async def _reconnect_loop(self, delay: float) -> None:
        attempt = 0
        while self._state != _CLOSED:
            if delay > 0:
                await asyncio.sleep(delay)
            if await self._connect_once():
                return
            fail_calls(self._set_down(self._down_reason), self._unavailable())
            if self._on_unavailable is not None and self._state != _CLOSED:
                await self._run_hook()
                if await self._connect_once():
                    return
            delay = self._backoff.delay(attempt)
            attempt += 1

    async def _run_hook(self) -> None:
        assert self._on_unavailable is not None
        try:
            # The hook may block (embedded mode spawns and waits for a service): not on this loop.
            await self._loop.run_in_executor(None, self._on_unavailable)
        except Exception as exc:
            log.warning("on_unavailable hook failed: %s", exc)

    async def _connect_once(self) -> bool:
        """One connect + handshake + re-registration; True when ready, else the state is down.

        Calls made during the very first attempt wait for it (queued, each with its timeout);
        during later attempts the state stays down, so calls keep failing fast until one succeeds.
        """
        with self._lock:
            if self._state == _CLOSED:
                return False
        try:
            channel = await asyncio.wait_for(self._open(), self._connect_timeout)
        except (OSError, TimeoutError) as exc:
            self._set_down_reason(f"cannot connect ({exc.__class__.__name__}: {exc})")
            return False
        try:
            hello = await self._handshake(channel)
        except ServiceError as exc:
            with self._lock:
                if self._channel is channel:
                    self._channel = None
                channel.close()
            self._set_down_reason(f"handshake failed ({exc})")
            return False
        with self._lock:
            if self._state == _CLOSED or self._channel is not channel:
                return False
            self._hello = hello
            self._state = _READY
            queued, self._queue = self._queue, deque()
            for call in queued:  # in the same critical section: no new call overtakes them
                if call.expect is not NO_REPLY:
                    self._pending[call.id] = call
                channel.write(call.frame)
        self._ready.set()
        if self._on_connect is not None:
            try:
                self._on_connect(hello)
            except Exception:
                log.exception("on_connect callback failed")
        return True

    def _set_down_reason(self, reason: str) -> None:
        with self._lock:
            if self._state != _CLOSED:
                self._state, self._down_reason = _DOWN, reason

    async def _open(self) -> Channel:
        address = self._address
        if address.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = address.path
        else:
            infos = await self._loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, target = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.setblocking(False)
            await self._loop.sock_connect(sock, target)
        except BaseException:
            sock.close()
            raise
        channel = Channel(self._loop, sock, lambda: self._flush(channel), self._readable)
        with self._lock:
            self._channel = channel
        channel.watch()
        return channel

    async def _handshake(self, channel: Channel) -> HelloReply:
        """Hello without a spec, then one per registered namespace, then the last report, all
        before any queued call."""
        with self._lock:
            specs: list[NamespaceSpec | None] = [None, *self._specs]
            report = self._report
        messages: list[Any] = [
            p.Hello(id=next(self._ids), version=p.PROTOCOL_VERSION, token=self._token, spec=spec)
            for spec in specs
        ]
        if report is not None:
            messages.append(msgspec.structs.replace(report, id=next(self._ids)))
        futures = []
        deadline = time.monotonic() + self._connect_timeout
        for msg in messages:
            call = Call(None, msg.id, self._encode(msg), CONVERT[type(msg)], deadline)
            with self._lock:
                self._pending[call.id] = call
                if not channel.write(call.frame):
                    raise ServiceUnavailable("connection lost during the handshake")
            futures.append(asyncio.wrap_future(call))
        try:
            replies = await asyncio.wait_for(asyncio.gather(*futures), self._connect_timeout)
        except TimeoutError:
            raise CallTimeout("no answer to hello") from None
        return replies[0]  # type: ignore[no-any-return]

    def _shutdown(self) -> None:
        with self._lock:
            self._state = _CLOSED
            channel, self._channel = self._channel, None
            if channel is not None:
                channel.close()
            calls = self._take_all()
        self._ready.clear()
        if self._reconnect is not None:
            self._reconnect.cancel()
        fail_calls(calls, ClientClosed("the client is closed"))
        # Let the reconnect task see its cancellation, then stop the loop.
        self._loop.call_soon(self._loop.stop)
