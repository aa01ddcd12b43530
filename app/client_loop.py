"""The loop-thread half of a ServiceClient (kvtier.app.client): the state it shares with callers, the
connection's life, the sweep, and reading replies.

Who owns what: the client's own thread runs an event loop that owns the connection and the sweep;
``_lock`` guards the socket's writes, the calls in flight and the connection state, held briefly.
Design: docs/internals.md#service-client-clientpy-client_looppy-client_connectionpy-client_callpy
"""

from __future__ import annotations

import asyncio
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
from concurrent.futures import InvalidStateError
from typing import Any

import msgspec

from kvtier.app import protocol as p
from kvtier.app.address import Address, parse_url
from kvtier.app.client_call import Call, fail, fail_calls
from kvtier.app.client_connection import ClientConnection
from kvtier.app.client_errors import CallTimeout, ClientClosed, ServiceError, ServiceUnavailable, remote_error
from kvtier.app.client_reconnect import Backoff, Reconnector
from kvtier.app.client_results import CONVERT, NO_REPLY, HelloReply
from kvtier.runtime.affinity import engine_cpus, run_on
from kvtier.runtime.event_loop import new_event_loop
from kvtier.storage.base import NamespaceSpec

log = logging.getLogger("kvtier.client")

SWEEP_PERIOD_S = 0.01  # timeouts fire within this much of their deadline, held frames go out within it
# Between deadlines the sweep wakes only this often (to send releases no call took along, and to watch
# for replies nobody waits for again): each wake-up costs vLLM's forward (docs/performance.md).
SWEEP_IDLE_PERIOD_S = 0.2
# The sweep goes on this long after the client was last busy, so that a call made meanwhile need not
# start one: starting it wakes the loop thread, which may then run on the caller's core.
SWEEP_LINGER_S = 1.0
DOWN, CONNECTING, READY, CLOSED = "down", "connecting", "ready", "closed"


class Forks:
    """How many times this process is a forked child: a client made before a fork serves only the
    process that made it, and comparing a count costs less than os.getpid() (a system call) per call."""

    count = 0

    @classmethod
    def bump(cls) -> None:
        """Run in every forked child."""
        cls.count += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=Forks.bump)


class ClientLoop:
    """What a ServiceClient's loop thread runs, and the state it shares with the callers' threads."""

    def __init__(
        self,
        url: str,
        auth_token: str,
        timeout: float,
        connect_timeout: float,
        backoff: Backoff,
        on_unavailable: Callable[[], object] | None,
        on_connect: Callable[[HelloReply], object] | None,
        name: str,
    ) -> None:
        self._address: Address = parse_url(url)
        self.url = url
        self._token = auth_token
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._on_connect = on_connect
        self._forks = Forks.count  # differs in a forked child: see Forks
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._lock = threading.Lock()
        # Guarded by _lock: state, connection, calls in flight, calls queued while connecting.
        self._state = CONNECTING
        self._down_reason = "not connected yet"
        self._conn: ClientConnection | None = None
        self._pending: dict[int, Call] = {}
        self._queue: deque[Call] = deque()
        # Lease ids release() has not sent yet; a deque: any thread appends or takes one without the lock.
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
        self._ready = threading.Event()
        self._loop = new_event_loop()
        self._reconnector = Reconnector(
            self._loop, self._connect_once, self._attempt_failed, self._is_closed, backoff, on_unavailable
        )
        self._cpus = engine_cpus()  # read here, in the caller's thread: see _run
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._loop_thread = self._thread.ident
        self._loop.call_soon_threadsafe(self._reconnector.start, 0.0)

    # ---------------------------------------------------------------------------------- both sides
    def _encode(self, msg: Any) -> bytes:
        """msg as a frame, by this thread's encoder (each keeps a buffer for the next frame)."""
        try:
            encode = self._local.encode
        except AttributeError:  # this thread's first call
            encode = self._local.encode = p.FrameEncoder().encode
        return encode(msg)  # type: ignore[no-any-return]

    def _unavailable(self, reason: str = "") -> ServiceUnavailable:
        return ServiceUnavailable(f"kvtier service {self.url}: {reason or self._down_reason}")

    # ------------------------------------------------------------------- frames that get no reply
    def _take_release(self) -> str:
        """A lease id release() kept, or '' when another thread took the last one."""
        try:
            return self._releases.popleft()
        except IndexError:
            return ""

    def _send_releases(self) -> None:
        """Send the lease ids release() kept as Release frames that get no reply (not under the lock).
        While the service is unreachable they stay kept: a lease may outlive its connection."""
        while self._state is not DOWN and (lease_id := self._take_release()):
            if not self._send_only(p.Release(id=next(self._ids), lease_id=lease_id, reply=False)):
                self._releases.appendleft(lease_id)  # down (or closed) meanwhile
                return

    def _send_only(self, msg: Any) -> bool:
        """Send a message nobody waits on: now, or once connected; False (not sent) while down or closed."""
        if self._forks != Forks.count or self._state is DOWN:
            return False  # unlocked read, as in ServiceClient._call
        frame = self._encode(msg)
        with self._lock:
            conn = self._conn
            if self._state is READY and conn is not None:
                # Out with the next call's frame (one send here, one read in the service), or
                # with the next sweep when none comes first.
                conn.hold(frame)
            elif self._state is CONNECTING:  # after the calls queued before it, as sent in order
                self._queue.append(Call(None, msg.id, frame, NO_REPLY, time.monotonic() + self.timeout))
            else:
                return False
            self._sweep_later()
        return True

    def _late(self, reply: Any) -> None:
        """A reply to a call that already timed out: give back what it reserved.

        The service owns reserved slots until commit, abort or the connection's end, so a dropped
        reserve answer would hold its slots for as long as this client stays connected. Leases need
        nothing here: the caller releases the lease id it chose whether or not the lookup answered.
        """
        if type(reply) is p.ReserveOk:
            slots = [s for s in reply.slots if s is not None]
            if slots:
                self._send_only(p.Abort(id=next(self._ids), slots=slots, instance_id=reply.instance_id))

    # ---------------------------------------------------------------------------------- the sweep
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

    def _sweep_soon(self, deadline: float = math.inf) -> None:
        """Have the sweep run within SWEEP_PERIOD_S, or by deadline (caller holds the lock)."""
        self._sweep_by(min(deadline, time.monotonic() + SWEEP_PERIOD_S))

    def _sweep_later(self, deadline: float = math.inf) -> None:
        """Have the sweep run within SWEEP_IDLE_PERIOD_S, or by deadline (caller holds the lock)."""
        self._sweep_by(min(deadline, time.monotonic() + SWEEP_IDLE_PERIOD_S))

    def _arm_sweep(self, due: float) -> None:
        """Run the sweep at due, unless it runs sooner already (loop thread)."""
        if self._sweep_timer is not None:
            if self._timer_due <= due:
                return
            self._sweep_timer.cancel()
        self._timer_due = due
        self._sweep_timer = self._loop.call_later(max(0.0, due - time.monotonic()), self._sweep)

    def _sweep(self) -> None:
        """Fail calls past their deadline, send what is held and watch for replies again when no
        caller reads them; runs by the next deadline and every SWEEP_IDLE_PERIOD_S (SWEEP_PERIOD_S
        while calls wait for a connection) while any call is in flight or the loop thread is not
        watching, and for SWEEP_LINGER_S after that (loop thread)."""
        self._sweep_timer, self._timer_due = None, math.inf
        self._send_releases()  # release() appends before it checks that a sweep is on
        conn = self._conn
        if conn is not None and not conn.watched and conn.reading.acquire(blocking=False):
            # Replies that came while nobody watched go to their calls before any of those calls
            # can be found late (the sweep may come only at a deadline).
            self._read_and_leave(conn)
        now = time.monotonic()
        with self._lock:
            expired = self._take_expired(now)
            queued = [c for c in self._queue if c.deadline <= now]
            for call in queued:
                self._queue.remove(call)
            conn = self._conn
            if conn is not None and conn.held:
                conn.flush_held()
            if conn is not None and not conn.watched and not conn.reading.locked():
                conn.watch()  # replies nobody waits for, and a lost connection, get noticed
            due = self._next_sweep(now, conn)
            # Set under the lock: a caller that needs a sooner sweep sees it and wakes this thread.
            self._sweep_due = due
        for call in expired:
            fail(call, CallTimeout(f"no answer from {self.url} in time"))
        for call in queued:
            fail(call, CallTimeout(f"not connected to {self.url} in time"))
        if due < math.inf:
            self._arm_sweep(due)

    def _next_sweep(self, now: float, conn: ClientConnection | None) -> float:
        """When the sweep must run next, inf once it found nothing to do for SWEEP_LINGER_S (caller
        holds the lock): by the first deadline of a call in flight, soon while calls wait for a
        connection, else after an idle period."""
        # Kept releases need no sweep while the service is unreachable: the reconnect starts one.
        releases = self._releases and self._state is not DOWN
        idle = not self._pending and not self._queue and not releases and (conn is None or conn.watched)
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= SWEEP_LINGER_S:
            self._idle_since = None
            return math.inf  # off until a call needs it
        if self._queue:
            return now + SWEEP_PERIOD_S
        # A copy made in one C call, as in _take_expired.
        first = min((c.deadline for c in list(self._pending.values())), default=math.inf)
        return min(now + SWEEP_IDLE_PERIOD_S, first)

    def _take_expired(self, now: float) -> list[Call]:
        """Remove and return the calls in flight past their deadline (caller holds the lock)."""
        # A reader pops its replies without the lock: iterate over a copy made in one C call (the
        # dict itself may change size meanwhile), and take only the calls still there.
        pending = self._pending
        late = [c for c in list(pending.values()) if c.deadline <= now]
        return [c for c in late if pending.pop(c.id, None) is not None]

    # -------------------------------------------------------------------------------- the replies
    def _readable(self, conn: ClientConnection) -> None:
        """Replies arrived and the loop thread watches for them (loop thread)."""
        if not conn.reading.acquire(blocking=False):
            # A caller reads them: stop watching until nobody does (see _sweep and await_reply), or
            # every reply would wake this thread too.
            conn.park()
            with self._lock:  # watched again once nobody reads them, by the reader or the sweep
                self._sweep_later()
            return
        self._read_and_leave(conn)

    def _read_and_leave(self, conn: ClientConnection) -> None:
        """Read and deliver what arrived, let go of reading, and reconnect if the connection is gone
        (loop thread, holding conn.reading)."""
        try:
            error = self._read(conn)
        finally:
            conn.leave()
        if error is not None:
            self._lost(conn, error)

    def _read(self, conn: ClientConnection) -> str | None:
        """Read and deliver what arrived (holder of conn.reading); the error that lost it, if any."""
        try:
            replies = conn.receive()
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
            elif type(reply) is p.ErrorReply:
                fail(call, remote_error(reply))
            else:
                fail(call, ServiceError(f"unexpected {type(reply).__name__} to a call"))
        return None

    def await_reply(self, future: Call, timeout: float | None) -> float | None:
        """Read replies in this thread until future is done, unless another thread reads them.

        Returns what is left of timeout, for the wait on the future itself (which another
        thread completes when this one cannot read: not connected, or someone else reads).
        A poll (timeout 0: done(), result(0)) reads nothing itself: see _watch_for.
        """
        conn = self._conn
        if conn is None or self._state is not READY or threading.get_ident() == self._loop_thread:
            return timeout
        if conn.held:  # the call may be among the held frames: nobody answers what was not sent
            with self._lock:
                conn.flush_held()
        if timeout is not None and timeout <= 0.0:
            self._watch_for(conn)
            return timeout
        if not conn.reading.acquire(False):
            return timeout
        until = math.inf if timeout is None else time.monotonic() + timeout
        stop = until if until < future.deadline else future.deadline  # the sweep fails it then
        poll = conn.poll
        error = None
        try:
            while not future.finished() and not conn.closed:
                left = stop - time.monotonic()
                if poll(None if left == math.inf else left * 1000.0 if left > 0.0 else 0):
                    if error := self._read(conn):
                        break
                elif left <= 0.0:
                    break
        finally:
            conn.leave()
            if error is None and self._pending:
                self._watch_for(conn)  # other calls are in flight and nobody reads for them now
        if error is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._lost, conn, error)
        if timeout is None or future.finished():
            return timeout  # nothing left to wait for, or no limit to it
        return max(0.0, until - time.monotonic())

    def _watch_for(self, conn: ClientConnection) -> None:
        """Have the loop thread read replies again (it stops while a caller reads them)."""
        # Polls come here instead of reading: a read lets go of the GIL, and a thread that polls in
        # a busy loop (an engine polling its futures every step) would starve the other threads.
        if not conn.watched and not conn.closed and not conn.watch_asked:
            conn.watch_asked = True
            with contextlib.suppress(RuntimeError):  # loop closed by close() meanwhile
                self._loop.call_soon_threadsafe(conn.watch)

    def _flush(self, conn: ClientConnection) -> None:
        """Write what the socket did not take before (loop thread, when it is writable)."""
        with self._lock:
            if conn.closed:
                return
            try:
                sent = conn.sock.send(conn.pending_out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                sent = len(conn.pending_out)  # broken: the reader reports it
            del conn.pending_out[:sent]
            if not conn.pending_out:
                conn.writer_armed = False
                self._loop.remove_writer(conn.fd)

    # ------------------------------------------------------------------------- the connection's life
    def _run(self) -> None:
        # Off the cores vLLM binds its model to, or every reply waits behind the model (runtime/affinity.py).
        run_on(self._cpus)
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _is_closed(self) -> bool:
        return self._state == CLOSED

    def _lost(self, conn: ClientConnection, reason: str) -> None:
        with self._lock:
            if conn is not self._conn:
                return
            self._conn = None
            conn.close()
            calls = self._take_all()
            if self._state != CLOSED:
                self._state, self._down_reason = DOWN, reason
        self._ready.clear()
        fail_calls(calls, self._unavailable(reason))
        self._reconnector.start(0.0)

    def _take_all(self) -> list[Call]:
        """Every call in flight or queued, removed from the books (caller holds the lock)."""
        calls = [*self._pending.values(), *self._queue]
        self._pending, self._queue = {}, deque()
        return calls

    def _set_down(self, reason: str) -> None:
        with self._lock:
            if self._state != CLOSED:
                self._state, self._down_reason = DOWN, reason

    def _attempt_failed(self) -> None:
        """A connect attempt failed: the calls waiting for it fail, later ones fail fast."""
        with self._lock:
            if self._state != CLOSED:
                self._state = DOWN
            calls = self._take_all()
        fail_calls(calls, self._unavailable())

    async def _connect_once(self) -> bool:
        """One connect + handshake + re-registration; True when ready, else the state is down.

        Calls made during the very first attempt wait for it (queued, each with its timeout);
        during later attempts the state stays down, so calls keep failing fast until one succeeds.
        """
        if self._is_closed():
            return False
        try:
            conn = await asyncio.wait_for(self._open(), self._connect_timeout)
        except (OSError, TimeoutError) as exc:
            self._set_down(f"cannot connect ({exc.__class__.__name__}: {exc})")
            return False
        try:
            hello = await self._handshake(conn)
        except ServiceError as exc:
            with self._lock:
                if self._conn is conn:
                    self._conn = None
                conn.close()
            self._set_down(f"handshake failed ({exc})")
            return False
        with self._lock:
            if self._state == CLOSED or self._conn is not conn:
                return False
            self._hello = hello
            self._state = READY
            queued, self._queue = self._queue, deque()
            for call in queued:  # in the same critical section: no new call overtakes them
                if call.expect is not NO_REPLY:
                    self._pending[call.id] = call
                conn.write(call.frame)
            if self._releases:  # kept while the service was unreachable
                self._sweep_soon()
        self._ready.set()
        if self._on_connect is not None:
            try:
                self._on_connect(hello)
            except Exception:
                log.exception("on_connect callback failed")
        return True

    async def _open(self) -> ClientConnection:
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
        conn = ClientConnection(self._loop, sock, lambda: self._flush(conn), self._readable)
        with self._lock:
            self._conn = conn
        conn.watch()
        return conn

    async def _handshake(self, conn: ClientConnection) -> HelloReply:
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
            call: Call[Any] = Call(None, msg.id, self._encode(msg), CONVERT[type(msg)], deadline)
            with self._lock:
                self._pending[call.id] = call
                if not conn.write(call.frame):
                    raise ServiceUnavailable("connection lost during the handshake")
            futures.append(call.to_asyncio(self._loop))
        try:
            replies = await asyncio.wait_for(asyncio.gather(*futures), self._connect_timeout)
        except TimeoutError:
            raise CallTimeout("no answer to hello") from None
        return replies[0]  # type: ignore[no-any-return]

    def _shutdown(self) -> None:
        self._send_releases()  # a lease may outlive its connection: what release() kept goes out first
        with self._lock:
            self._state = CLOSED
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.flush_held()
                conn.close()
            calls = self._take_all()
        self._ready.clear()
        self._reconnector.cancel()
        fail_calls(calls, ClientClosed("the client is closed"))
        # Let the reconnect task see its cancellation, then stop the loop.
        self._loop.call_soon(self._loop.stop)
