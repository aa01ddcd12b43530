"""The kvtier service's request handling: connections, handshake, dispatch, and who owns what.

Who owns what: everything here runs on the service's one event loop, and nothing else touches it.
``Service`` owns the store, the connections, and two ownership maps: lease id -> connection and
reserved slot -> connection. A lease or a reserved slot belongs to the connection that took it; when
that connection drops (the client exited or was killed), its in-flight calls finish first and then
its leases are released and its reserved slots aborted, so a vanished client leaks nothing. A
connection also holds the last Report its connector sent (whether that side of its engine serves),
which the stats list under ``engines`` for as long as the connection is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any, cast

from kvtier.app import protocol as p
from kvtier.app.metrics import ServiceMetrics, stats_dict
from kvtier.storage.base import (
    ArenaFullError,
    ImmediateStoreAPI,
    LookupResult,
    NamespaceSpec,
    SlotList,
    SlotRef,
    SlotStateError,
    StorageError,
    StoreAPI,
    Tier,
    UnknownNamespaceError,
)

log = logging.getLogger("kvtier.service")

CALL_NAMES = tuple(kind.__name__.lower() for kind in p.REQUEST_TYPES)  # as metrics count calls

CLOSE_GRACE_S = 2.0  # a closed connection's unread replies may take this long before it is cut
# C-level getters for map(): a 64-slot call costs no Python frame per slot.
_first = itemgetter(0)  # a slot's offset; an ownership entry's SlotRef
_second = itemgetter(1)  # an ownership entry's connection


def _wire_slots(slots: Sequence[SlotRef | None]) -> tuple[bytes, list[int] | int]:
    """A lookup's slots as LookupReply carries them: packed offsets and lengths."""
    if type(slots) is not SlotList:  # TieredStore answers in that form already
        known = {s.length for s in slots if s is not None}
        offsets = [None if s is None else s.offset for s in slots]
        lengths: list[int] | int = (
            known.pop() if len(known) == 1 else [0 if s is None else s.length for s in slots] if known else 0
        )
        slots = SlotList(offsets, lengths)
    return slots.packed, slots.lengths


def _replaced(msg: p.Lookup) -> str:
    """The lease a lookup ends besides its own lease_id's, or ''."""
    return msg.replaces if msg.replaces != msg.lease_id else ""


class CallError(Exception):
    """A call refused with a protocol error code (becomes an ErrorReply)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Connection(asyncio.Protocol):
    """One client connection: frames in, replies out, and the leases and slots it owns."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.transport: asyncio.Transport | None = None
        self.decoder = p.request_decoder(service.max_frame)
        self.peer = "?"
        self.authed = False
        self.closed = False
        self.leases: set[str] = set()
        self.slots: set[int] = set()  # offsets of the reserved slots it owns
        self.inflight: set[asyncio.Task[None]] = set()
        self.last_hello: asyncio.Task[None] | None = None
        self.held: list[bytes] | None = None  # replies held while one read's calls are served
        self.report: p.Report | None = None  # the connector's state, as it last reported it

    # --------------------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Register with the service."""
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer) if peer else "unix"
        self.service.attach(self)

    def data_received(self, data: bytes) -> None:
        """Decode every complete frame and dispatch it."""
        try:
            messages = self.decoder.feed(data)
        except p.ProtocolError as exc:
            kind = "oversized" if isinstance(exc, p.FrameTooLarge) else "malformed"
            self.abort_protocol(kind, str(exc))
            return
        if len(messages) > 1:
            # Several calls in one read (a burst of lookups as requests arrive): their immediate
            # replies go out in one write, which wakes the client once instead of once per reply.
            self.held = []
        try:
            for msg in messages:
                if self.closed or (self.transport is not None and self.transport.is_closing()):
                    return  # refused or shut: the rest of the batch is not served
                self.service.dispatch(self, msg)
        finally:
            if self.held is not None:
                self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        """Hand the connection's leases and slots back once its in-flight calls are done."""
        self.closed = True
        self.service.detach(self)

    def pause_writing(self) -> None:
        """The client is not reading its replies: stop reading its requests."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """The client caught up."""
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # --------------------------------------------------------------------------- helpers
    def send(self, frame: bytes) -> None:
        """Write one encoded frame unless the connection is gone (held for flush() while a read's
        calls are served)."""
        if self.held is not None:
            self.held.append(frame)
        elif not self.closed and self.transport is not None:
            self.transport.write(frame)

    def flush(self) -> None:
        """Write the replies send() held, in one write, and stop holding them."""
        held, self.held = self.held, None
        if held and not self.closed and self.transport is not None:
            self.transport.write(b"".join(held))

    def abort_protocol(self, kind: str, reason: str) -> None:
        """Close this connection for a protocol violation, logging why; other clients go on."""
        log.warning("closing connection: %s", reason, extra={"peer": self.peer, "kind": kind})
        self.service.metrics.count_protocol_error(kind)
        self.close()

    def close(self) -> None:
        """Close after flushing what was written; abort if the peer does not read it in time."""
        self.flush()  # a refusal's reply goes out before the connection closes
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._force_close)

    def _force_close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.abort()


class Service:
    """Serves StoreAPI calls to many connections; see the module docstring for ownership."""

    def __init__(
        self,
        store: StoreAPI,
        *,
        auth_token: str = "",
        lease_ttl: float = 60.0,
        instance_id: str | None = None,
        max_frame: int = p.MAX_FRAME_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.instance_id = instance_id or secrets.token_hex(8)
        self.max_frame = max_frame
        self.metrics = ServiceMetrics(CALL_NAMES)
        self.connections: set[Connection] = set()
        self.draining = False
        self._token = auth_token.encode()
        self._lease_ttl = lease_ttl
        self._clock = clock
        self._encoder = p.FrameEncoder()
        self._leases: OrderedDict[str, tuple[Connection, float]] = OrderedDict()
        self._slots: dict[int, tuple[SlotRef, Connection]] = {}  # offset -> reserved slot, owner
        self._chunk_tokens: dict[str, int] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._closing: set[Connection] = set()  # dropped, with calls still in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._handlers: dict[type, Callable[[Connection, Any], Awaitable[p.Reply]]] = {
            p.Hello: self._hello,
            p.Lookup: self._lookup,
            p.Stage: self._stage,
            p.Reserve: self._reserve,
            p.Commit: self._commit,
            p.Abort: self._abort,
            p.Release: self._release,
            p.Delete: self._delete,
            p.Clear: self._clear,
            p.Stats: self._in_task,
            p.Health: self._in_task,
            p.Report: self._in_task,
        }
        # Calls answered in one step, without a Task, when nothing of the connection is in flight
        # (see dispatch). Only handlers that never await: a Task costs more than a CPU-tier lookup.
        # Each answers, or (a lookup that needs a lower tier) returns None having changed nothing.
        self._now: dict[type, Callable[[Connection, Any], p.Reply | None]] = {
            p.Stats: self._stats,
            p.Health: self._health,
            p.Report: self._report,
        }
        if isinstance(store, ImmediateStoreAPI):  # the one-step forms of the store's calls
            self._immediate = store
            self._now[p.Lookup] = self._lookup_now
            for kind, handler in (
                (p.Reserve, self._reserve_now),
                (p.Commit, self._commit_now),
                (p.Abort, self._abort_now),
                (p.Release, self._release_now),
            ):
                self._now[kind] = handler
                self._handlers[kind] = self._in_task  # queued behind an earlier call: same answer
        self._names = dict(zip(p.REQUEST_TYPES, CALL_NAMES, strict=True))

    # --------------------------------------------------------------------------- connections
    def attach(self, conn: Connection) -> None:
        """A new connection; refused while draining."""
        if self.draining:
            conn.close()
            return
        self.connections.add(conn)
        self.metrics.connections = len(self.connections)
        self.metrics.connections_total += 1
        self._idle.clear()

    def detach(self, conn: Connection) -> None:
        """A connection dropped; clean up now or after its last in-flight call."""
        self.connections.discard(conn)
        self.metrics.connections = len(self.connections)
        if conn.inflight:
            self._closing.add(conn)
        else:
            self._start_cleanup(conn)

    @property
    def connection_count(self) -> int:
        """Open client connections."""
        return len(self.connections)

    def _start_cleanup(self, conn: Connection) -> None:
        self._closing.discard(conn)
        leases = [lid for lid in conn.leases if self._leases.get(lid, (None,))[0] is conn]
        slots = [e[0] for o in conn.slots if (e := self._slots.get(o)) is not None and e[1] is conn]
        conn.leases.clear()
        conn.slots.clear()
        for lid in leases:
            del self._leases[lid]
        for slot in slots:
            del self._slots[slot.offset]
        if leases or slots:
            task = asyncio.get_running_loop().create_task(self._cleanup(conn.peer, leases, slots))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanup_done)
        else:
            self._check_idle()

    async def _cleanup(self, peer: str, leases: list[str], slots: list[SlotRef]) -> None:
        if slots:
            try:
                await self.store.abort(slots)
            except Exception:
                log.exception("aborting the slots of a closed connection failed", extra={"peer": peer})
        for lid in leases:
            try:
                await self.store.release(lid)
            except Exception:
                log.exception("releasing a lease of a closed connection failed", extra={"peer": peer})
        log.info(
            "released what a closed connection held",
            extra={"peer": peer, "leases": len(leases), "slots": len(slots)},
        )

    def _cleanup_done(self, task: asyncio.Task[None]) -> None:
        self._cleanups.discard(task)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self.connections and not self._cleanups and not self._closing:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no connection is open and every cleanup has run."""
        await self._idle.wait()

    # --------------------------------------------------------------------------- dispatch
    def dispatch(self, conn: Connection, msg: p.Request) -> None:
        """Answer one call now or run it as a Task; the first frame of a connection must be a Hello.

        A call is answered in place when its handler cannot wait (a lookup the CPU tier answers
        alone, a reserve, a commit...) and no earlier call of the connection is still in flight,
        so replies keep the order the Task path gives them. Everything else is a real Task: store
        and tier code uses asyncio.timeout(), which needs a current task (running calls eagerly
        with coro.send() broke every Redis call).
        """
        if not conn.authed and not self._handshake(conn, msg):
            return
        kind = type(msg)
        name = self._names[kind]
        self.metrics.calls[name] += 1
        now = self._now.get(kind)
        if now is not None and not conn.inflight and not self.draining:
            try:
                reply = now(conn, msg)
            except Exception as exc:
                reply = self._failure(conn, name, msg.id, exc)
            if reply is not None:
                self._send_reply(conn, name, msg, reply)
                return
        task = asyncio.get_running_loop().create_task(self._serve(conn, msg, name))
        conn.inflight.add(task)
        task.add_done_callback(lambda t: self._call_done(conn, t))
        if kind is p.Hello:
            conn.last_hello = task

    def _handshake(self, conn: Connection, msg: p.Request) -> bool:
        if type(msg) is not p.Hello:
            self._refuse(conn, msg.id, p.ErrorCode.HELLO_REQUIRED, "the first call must be hello")
            return False
        if msg.version != p.PROTOCOL_VERSION:
            self._refuse(
                conn,
                msg.id,
                p.ErrorCode.VERSION,
                f"protocol version {msg.version} not supported; this service speaks {p.PROTOCOL_VERSION}",
            )
            return False
        # Constant time, on bytes: compare_digest refuses non-ASCII str.
        if self._token and not hmac.compare_digest(msg.token.encode(), self._token):
            self._refuse(conn, msg.id, p.ErrorCode.AUTH, "missing or wrong auth token")
            return False
        conn.authed = True
        return True

    def _refuse(self, conn: Connection, req_id: int, code: str, message: str) -> None:
        conn.send(self._encoder.encode(p.ErrorReply(id=req_id, code=code, message=message)))
        conn.abort_protocol(code, message)

    def _call_done(self, conn: Connection, task: asyncio.Task[None]) -> None:
        conn.inflight.discard(task)
        if not conn.inflight and conn in self._closing:
            self._start_cleanup(conn)

    async def _serve(self, conn: Connection, msg: Any, name: str) -> None:
        kind = type(msg)
        try:
            if self.draining:
                raise CallError(p.ErrorCode.SHUTTING_DOWN, "the service is shutting down")
            hello = conn.last_hello
            if hello is not None and kind is not p.Hello and not hello.done():
                # A namespace registered earlier on this connection must exist before later calls.
                await asyncio.wait([hello])
            reply = await self._handlers[kind](conn, msg)
        except Exception as exc:
            reply = self._failure(conn, name, msg.id, exc)
        self._send_reply(conn, name, msg, reply)

    def _failure(self, conn: Connection, name: str, req_id: int, exc: Exception) -> p.ErrorReply:
        """The ErrorReply for a call that raised exc (logged by how unexpected it is)."""
        if isinstance(exc, CallError):
            return self._error(name, req_id, exc.code, str(exc))
        if isinstance(exc, UnknownNamespaceError):
            return self._error(name, req_id, p.ErrorCode.UNKNOWN_NAMESPACE, str(exc))
        if isinstance(exc, ArenaFullError):
            return self._error(name, req_id, p.ErrorCode.ARENA_FULL, str(exc))
        if isinstance(exc, ValueError | TypeError | SlotStateError):
            log.debug("bad request %s", name, exc_info=exc)
            return self._error(name, req_id, p.ErrorCode.BAD_REQUEST, str(exc))
        if isinstance(exc, StorageError):
            log.warning("storage error in %s: %s", name, exc, extra={"peer": conn.peer})
            return self._error(name, req_id, p.ErrorCode.INTERNAL, str(exc))
        log.error("internal error in %s", name, exc_info=exc, extra={"peer": conn.peer})
        return self._error(name, req_id, p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _send_reply(self, conn: Connection, name: str, msg: p.Request, reply: p.Reply) -> None:
        if type(msg) is p.Release and not msg.reply:
            return  # the caller wants no answer (a failure was logged and counted all the same)
        try:
            frame = self._encoder.encode(reply)
        except p.ProtocolError as exc:  # a reply over the frame limit
            frame = self._encoder.encode(self._error(name, msg.id, p.ErrorCode.INTERNAL, str(exc)))
        conn.send(frame)

    def _error(self, call: str, req_id: int, code: str, message: str) -> p.ErrorReply:
        self.metrics.count_call_error(call, code)
        return p.ErrorReply(id=req_id, code=code, message=message)

    # --------------------------------------------------------------------------- handlers
    async def _hello(self, conn: Connection, msg: p.Hello) -> p.Reply:
        arena = self.store.arena_info()
        namespace, chunk_bytes = "", 0
        if msg.spec is not None:
            spec: NamespaceSpec = msg.spec
            namespace = await self.store.register(spec)
            self._chunk_tokens[namespace] = spec.chunk_size
            chunk_bytes = spec.chunk_bytes
        return p.HelloReply(
            id=msg.id,
            version=p.PROTOCOL_VERSION,
            instance_id=self.instance_id,
            arena_path=arena.path,
            arena_size=arena.size,
            namespace=namespace,
            chunk_bytes=chunk_bytes,
        )

    async def _lookup(self, conn: Connection, msg: p.Lookup) -> p.Reply:
        start = time.perf_counter()
        try:
            result = await self.store.lookup(msg.namespace, msg.hashes, msg.lease_id, msg.replaces)
        except Exception:
            await self._end_replaced(msg)
            raise
        return self._looked_up(conn, msg, result, start)

    def _lookup_now(self, conn: Connection, msg: p.Lookup) -> p.Reply | None:
        start = time.perf_counter()
        try:
            result = self._immediate.lookup_now(msg.namespace, msg.hashes, msg.lease_id, msg.replaces)
        except Exception:
            if replaced := _replaced(msg):  # see _end_replaced
                with contextlib.suppress(Exception):
                    self._immediate.release_now(replaced)
                self._disown_lease(replaced)
            raise
        return None if result is None else self._looked_up(conn, msg, result, start)

    async def _end_replaced(self, msg: p.Lookup) -> None:
        """A lookup that failed still ends the lease it replaces: its caller has let go of it."""
        if replaced := _replaced(msg):
            with contextlib.suppress(Exception):  # the lookup's own error is the one to report
                await self.store.release(replaced)
            self._disown_lease(replaced)

    def _looked_up(self, conn: Connection, msg: p.Lookup, result: LookupResult, start: float) -> p.Reply:
        if result.num_hit:
            self._own_lease(conn, msg.lease_id)
        else:  # the store holds no lease for a miss (it dropped any earlier one)
            self._disown_lease(msg.lease_id)
        if replaced := _replaced(msg):
            self._disown_lease(replaced)
        self.metrics.count_hits(result.tiers, self._chunk_tokens.get(msg.namespace, 0))
        offsets, lengths = _wire_slots(result.slots)
        reply = p.LookupReply(
            id=msg.id,
            num_hit=result.num_hit,
            tiers=p.one_value(result.tiers),
            offsets=offsets,
            lengths=lengths,
            instance_id=self.instance_id,
        )
        self.metrics.observe("lookup", time.perf_counter() - start)
        return reply

    async def _stage(self, conn: Connection, msg: p.Stage) -> p.Reply:
        start = time.perf_counter()
        result = await self.store.stage(msg.lease_id)
        reply = p.StageReply(
            id=msg.id,
            slots=result.slots,
            tiers=result.tiers,
            failed=result.failed,
            instance_id=self.instance_id,
        )
        self.metrics.observe("stage", time.perf_counter() - start)
        return reply

    async def _release(self, conn: Connection, msg: p.Release) -> p.Reply:
        await self.store.release(msg.lease_id)
        self._disown_lease(msg.lease_id)
        return p.OkReply(id=msg.id)

    def _release_now(self, conn: Connection, msg: p.Release) -> p.Reply:
        self._immediate.release_now(msg.lease_id)
        self._disown_lease(msg.lease_id)
        return p.OkReply(id=msg.id)

    def _disown_lease(self, lease_id: str) -> None:
        entry = self._leases.pop(lease_id, None)
        if entry is not None:
            entry[0].leases.discard(lease_id)

    async def _reserve(self, conn: Connection, msg: p.Reserve) -> p.Reply:
        start = time.perf_counter()
        return self._reserved(conn, msg, await self.store.reserve(msg.namespace, msg.hashes), start)

    def _reserve_now(self, conn: Connection, msg: p.Reserve) -> p.Reply:
        start = time.perf_counter()
        return self._reserved(conn, msg, self._immediate.reserve_now(msg.namespace, msg.hashes), start)

    def _reserved(
        self, conn: Connection, msg: p.Reserve, slots: list[SlotRef | None], start: float
    ) -> p.Reply:
        granted = list(filter(None, slots))  # a SlotRef is a non-empty tuple: always true
        offsets = list(map(_first, granted))
        self._slots.update(zip(offsets, zip(granted, repeat(conn)), strict=True))
        conn.slots.update(offsets)
        self.metrics.observe("reserve", time.perf_counter() - start)
        return p.ReserveReply(id=msg.id, slots=slots, instance_id=self.instance_id)

    async def _commit(self, conn: Connection, msg: p.Commit) -> p.Reply:
        start = time.perf_counter()
        hashes, slots = self._to_commit(msg)
        if slots:
            await self.store.commit(msg.namespace, hashes, slots)
            self._disown(slots)  # only now: a refused commit leaves them owned
        return self._committed(msg, len(slots), start)

    def _commit_now(self, conn: Connection, msg: p.Commit) -> p.Reply:
        start = time.perf_counter()
        hashes, slots = self._to_commit(msg)
        if slots:
            self._immediate.commit_now(msg.namespace, hashes, slots)
            self._disown(slots)  # only now: a refused commit leaves them owned
        return self._committed(msg, len(slots), start)

    def _to_commit(self, msg: p.Commit) -> tuple[list[bytes], list[SlotRef]]:
        """The hashes and reserved SlotRefs of a commit, leaving out slots no longer reserved."""
        self._check_instance(msg.instance_id)
        if len(msg.hashes) != len(msg.slots):
            raise CallError(p.ErrorCode.BAD_REQUEST, "commit needs one slot per hash")
        found: list[Any] = list(map(self._slots.get, map(_first, msg.slots)))
        try:
            refs: list[SlotRef] = list(map(_first, found))
        except TypeError:  # a None: some slot is not reserved (any more); sort them out below
            return self._to_commit_each(msg)
        if refs != msg.slots:  # a wire slot is (offset, length): equal to its SlotRef, compared in C
            return self._to_commit_each(msg)
        return msg.hashes, refs

    def _to_commit_each(self, msg: p.Commit) -> tuple[list[bytes], list[SlotRef]]:
        """_to_commit(), slot by slot."""
        owned = self._slots
        hashes: list[bytes] = []
        slots: list[SlotRef] = []
        for h, (offset, length) in zip(msg.hashes, msg.slots, strict=True):
            entry = owned.get(offset)
            if entry is not None and entry[0].length == length:
                hashes.append(h)
                slots.append(entry[0])
        return hashes, slots

    def _committed(self, msg: p.Commit, committed: int, start: float) -> p.Reply:
        self.metrics.observe("commit", time.perf_counter() - start)
        if committed != len(msg.slots):
            raise CallError(
                p.ErrorCode.BAD_REQUEST,
                f"{len(msg.slots) - committed} of {len(msg.slots)} slots were not reserved "
                "(already committed or aborted, or their connection closed); the others were "
                "committed",
            )
        return p.OkReply(id=msg.id)

    async def _abort(self, conn: Connection, msg: p.Abort) -> p.Reply:
        slots = self._to_abort(msg)
        if slots:
            await self.store.abort(slots)
            self._disown(slots)
        return p.OkReply(id=msg.id)

    def _abort_now(self, conn: Connection, msg: p.Abort) -> p.Reply:
        slots = self._to_abort(msg)
        if slots:
            self._immediate.abort_now(slots)
            self._disown(slots)
        return p.OkReply(id=msg.id)

    def _to_abort(self, msg: p.Abort) -> list[SlotRef]:
        """The reserved SlotRefs an abort names, once each."""
        self._check_instance(msg.instance_id)
        return list({ref.offset: ref for s in msg.slots if (ref := self._owned(s))}.values())

    def _owned(self, slot: p.Slot) -> SlotRef | None:
        """The reserved SlotRef a wire slot names, unless committed or aborted since (or unknown)."""
        entry = self._slots.get(slot[0])
        return entry[0] if entry is not None and entry[0].length == slot[1] else None

    def _disown(self, slots: list[SlotRef]) -> None:
        """Forget who owns these slots (committed or aborted now)."""
        offsets = list(map(_first, slots))
        entries = list(filter(None, map(self._slots.pop, offsets, repeat(None))))
        owners = set(map(_second, entries))
        if len(owners) == 1:  # the usual: one connection reserved them all
            owners.pop().slots.difference_update(offsets)
            return
        for ref, owner in entries:
            owner.slots.discard(ref.offset)

    async def _delete(self, conn: Connection, msg: p.Delete) -> p.Reply:
        return p.CountReply(id=msg.id, count=await self.store.delete(msg.namespace, msg.hashes))

    async def _clear(self, conn: Connection, msg: p.Clear) -> p.Reply:
        try:
            tiers = [Tier(t) for t in msg.tiers] if msg.tiers else list(Tier)
        except ValueError as exc:
            raise CallError(p.ErrorCode.BAD_REQUEST, f"unknown tier: {exc}") from None
        return p.CountReply(id=msg.id, count=await self.store.clear(tiers))

    async def _in_task(self, conn: Connection, msg: Any) -> p.Reply:
        """A call with a one-step handler that never declines, run as a Task all the same."""
        reply = self._now[type(msg)](conn, msg)
        assert reply is not None
        return reply

    def _stats(self, conn: Connection, msg: p.Stats) -> p.Reply:
        return p.StatsReply(id=msg.id, stats=self.stats())

    def _health(self, conn: Connection, msg: p.Health) -> p.Reply:
        serving, tiers = self.health()
        return p.HealthReply(id=msg.id, serving=serving, instance_id=self.instance_id, tiers=tiers)

    def _report(self, conn: Connection, msg: p.Report) -> p.Reply:
        if not msg.active and (conn.report is None or conn.report.reason != msg.reason):
            log.warning(
                "a connector is idle",
                extra={"peer": conn.peer, "engine_id": msg.engine_id, "role": msg.role, "reason": msg.reason},
            )
        conn.report = msg
        return p.OkReply(id=msg.id)

    # --------------------------------------------------------------------------- state
    def stats(self) -> dict[str, Any]:
        """The `kvtier stats --json` object."""
        out = stats_dict(self.store.stats(), self.metrics, self.instance_id)
        out["engines"] = self.engines()
        return out

    def engines(self) -> list[dict[str, Any]]:
        """What the connected connectors last reported: engine, role, whether it serves and why not."""
        rows = [
            {"engine_id": r.engine_id, "role": r.role, "active": r.active, "reason": r.reason}
            for conn in self.connections
            if (r := conn.report) is not None
        ]
        return sorted(rows, key=lambda row: (row["engine_id"], row["role"], row["reason"]))

    def health(self) -> tuple[bool, dict[str, bool]]:
        """(can serve, healthy by tier): serving needs a healthy CPU tier and no shutdown."""
        try:
            tiers = {name: t.healthy for name, t in self.store.stats().tiers.items()}
        except Exception:
            log.exception("store stats failed")
            return False, {}
        return (not self.draining and tiers.get(Tier.CPU.label, True)), tiers

    def _check_instance(self, instance_id: str) -> None:
        if instance_id and instance_id != self.instance_id:
            raise CallError(
                p.ErrorCode.STALE_INSTANCE,
                f"slots of service instance {instance_id} are void: this is {self.instance_id}",
            )

    def _own_lease(self, conn: Connection, lease_id: str) -> None:
        """Record conn as the lease's owner, and forget leases the store has expired by now."""
        leases = self._leases
        previous = leases.pop(lease_id, None)  # popped and put back: the table is in expiry order
        owner = previous[0] if previous is not None else None
        if owner is not conn:  # a repeated lookup on the same connection owns it already
            if owner is not None:
                owner.leases.discard(lease_id)
            conn.leases.add(lease_id)
        now = self._clock()
        leases[lease_id] = (conn, now + self._lease_ttl)
        if next(iter(leases.values()))[1] <= now:
            self._forget_expired(now)

    def _forget_expired(self, now: float) -> None:
        """Drop ownership of the leases the store has expired by now (the oldest come first)."""
        leases = self._leases
        while leases:
            first = next(iter(leases))
            owner, expires = leases[first]
            if expires > now:
                break
            del leases[first]
            owner.leases.discard(first)

    def owned(self) -> tuple[int, int]:
        """(leases, reserved slots) the service tracks on behalf of connections."""
        return len(self._leases), len(self._slots)

    # --------------------------------------------------------------------------- shutdown
    async def drain(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish within grace, cancel the rest, disconnect."""
        self.draining = True
        pending = [t for c in list(self.connections) for t in c.inflight]
        if pending:
            _done, late = await asyncio.wait(pending, timeout=grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for conn in list(self.connections):
            conn.close()
        # connection_lost runs on the next loop iterations; then cleanups release what they held.
        try:
            await asyncio.wait_for(self.wait_idle(), timeout=max(grace, 1.0))
        except TimeoutError:
            log.warning("connections still closing after %.1fs", grace)
