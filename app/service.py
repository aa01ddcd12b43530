"""The kvtier service's request handling: handshake, dispatch of every call, and who owns what.

Who owns what: everything here runs on the service's one event loop. ``Service`` owns the store, the
connections and the map reserved slot -> connection; a lease belongs to no connection (it is keyed by
request), and a read ahead is a Task the service owns.
Design: docs/internals.md#request-handling-servicepy
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from itertools import repeat
from operator import itemgetter
from types import CoroutineType
from typing import Any, TypeAlias, cast

from kvtier.app import protocol as p
from kvtier.app.connection import Connection
from kvtier.app.metrics import ServiceMetrics, stats_dict
from kvtier.storage.base import (
    ArenaFullError,
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
from kvtier.storage.codec import Covered

log = logging.getLogger("kvtier.service")

CALL_NAMES = tuple(kind.__name__.lower() for kind in p.REQUEST_TYPES)  # as metrics count calls

# A handler's answer: the reply, or a coroutine for it when the call must wait for I/O.
Answer: TypeAlias = p.Reply | Coroutine[Any, Any, p.Reply]
# C-level getters for map(): a 64-slot call costs no Python frame per slot.
_first = itemgetter(0)  # a slot's offset; an ownership entry's SlotRef
_second = itemgetter(1)  # an ownership entry's connection


def _wire_slots(slots: Sequence[SlotRef | None]) -> tuple[bytes, list[int] | int]:
    """A lookup's slots as LookupOk carries them: packed offsets and lengths."""
    if type(slots) is not SlotList:  # TieredStore answers in that form already
        known = {s.length for s in slots if s is not None}
        offsets = [None if s is None else s.offset for s in slots]
        lengths: list[int] | int = (
            known.pop() if len(known) == 1 else [0 if s is None else s.length for s in slots] if known else 0
        )
        slots = SlotList(offsets, lengths)
    return slots.packed, slots.lengths


class CallError(Exception):
    """A call refused with a protocol error code (becomes an ErrorReply)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Service:
    """Serves StoreAPI calls to many connections; see the module docstring for ownership."""

    def __init__(
        self, store: StoreAPI, *, auth_token: str = "", prestage_bytes: int = 0, files: bool = False
    ) -> None:
        self.store = store
        # Read-ahead budget: bytes of lower-tier hits read at once for lookups with stage set
        # (KVTierSettings.prestage_limit); 0 = off.
        self.prestage_bytes = prestage_bytes
        self.files = files  # its disk tier's files are served beside its socket (app.file_channel)
        self._prestages: set[asyncio.Task[None]] = set()
        self.instance_id = secrets.token_hex(8)  # names this run: slots of another are void
        self.max_frame = p.MAX_FRAME_BYTES
        self.metrics = ServiceMetrics(CALL_NAMES)
        self.connections: set[Connection] = set()
        self.draining = False
        self._token = auth_token.encode()
        self._encoder = p.FrameEncoder()
        self._slots: dict[int, tuple[SlotRef, Connection]] = {}  # offset -> reserved slot, owner
        self.specs: dict[str, NamespaceSpec] = {}  # registered namespaces, for stats and KV events
        self.event_stats: Callable[[], dict[str, int]] | None = None  # the KV events' counts, when on
        self._closing: set[Connection] = set()  # dropped, with calls still in flight
        self._idle = asyncio.Event()
        self._idle.set()
        # One handler per call: it returns the reply, or a coroutine when it must wait (see dispatch).
        self._handlers: dict[type, Callable[[Connection, Any], Answer]] = {
            p.Hello: self._hello,
            p.Lookup: self._lookup,
            p.Stage: self._stage,
            p.Reserve: self._reserve,
            p.Commit: self._commit,
            p.Abort: self._abort,
            p.Release: self._release,
            p.Delete: self._delete,
            p.DiskReads: self._disk_reads,
            p.Clear: self._clear,
            p.Stats: self._stats,
            p.Health: self._health,
            p.Report: self._report,
        }
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
            self._clean_up(conn)

    @property
    def connection_count(self) -> int:
        """Open client connections."""
        return len(self.connections)

    def _clean_up(self, conn: Connection) -> None:
        """Abort the reserved slots a dropped connection still owns (its leases stay: see the
        module docstring)."""
        self._closing.discard(conn)
        slots = [e[0] for o in conn.slots if (e := self._slots.get(o)) is not None and e[1] is conn]
        conn.slots.clear()
        for slot in slots:
            del self._slots[slot.offset]
        if slots:
            try:
                self.store.abort(slots)
            except Exception:
                log.exception("aborting the slots of a closed connection failed", extra={"peer": conn.peer})
            log.info(
                "aborted the slots a closed connection reserved",
                extra={"peer": conn.peer, "slots": len(slots)},
            )
        if not self.connections and not self._closing:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no connection is open and every dropped one has been cleaned up."""
        await self._idle.wait()

    # --------------------------------------------------------------------------- dispatch
    def dispatch(self, conn: Connection, msg: p.Request) -> None:
        """Serve one call; the first frame of a connection must be a Hello.

        The one path of every call: its handler answers it at once, or returns a coroutine when it
        must wait for I/O (a stage, a lookup that asks a lower tier), and only then does the call
        run as a Task (store and tier code uses asyncio.timeout(), which needs a current task). A
        call that arrives while an earlier call of its connection is in flight runs as a Task
        too, queued behind it: Tasks start in the order they were made, so a connection's calls
        start in the order they were sent (a reserve behind a delete of the same chunk sees it gone).
        """
        if not conn.authed and not self._handshake(conn, msg):
            return
        name = self._names[type(msg)]
        self.metrics.calls[name] += 1
        if conn.inflight or self.draining:
            self._spawn(conn, msg, name, None)
            return
        try:
            answer = self._handlers[type(msg)](conn, msg)
        except Exception as exc:
            answer = self._failure(conn, name, msg.id, exc)
        if type(answer) is CoroutineType:
            self._spawn(conn, msg, name, answer)
        else:
            self._send_reply(conn, name, msg, cast("p.Reply", answer))

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

    def _spawn(self, conn: Connection, msg: p.Request, name: str, pending: Answer | None) -> None:
        """Run a call as a Task: pending is its handler's coroutine, or None when it is queued
        behind a call in flight and its handler has not run yet."""
        task = asyncio.get_running_loop().create_task(self._serve(conn, msg, name, pending))
        conn.inflight.add(task)
        task.add_done_callback(partial(self._call_done, conn))

    def _call_done(self, conn: Connection, task: asyncio.Task[None]) -> None:
        conn.inflight.discard(task)
        if not conn.inflight and conn in self._closing:
            self._clean_up(conn)

    async def _serve(self, conn: Connection, msg: p.Request, name: str, pending: Answer | None) -> None:
        try:
            if pending is None:
                if self.draining:
                    raise CallError(p.ErrorCode.SHUTTING_DOWN, "the service is shutting down")
                pending = self._handlers[type(msg)](conn, msg)
            reply = await pending if type(pending) is CoroutineType else cast("p.Reply", pending)
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
    def _hello(self, conn: Connection, msg: p.Hello) -> p.Reply:
        arena = self.store.arena_info()
        namespace, chunk_bytes = "", 0
        if msg.spec is not None:
            spec: NamespaceSpec = msg.spec
            namespace = self.store.register(spec)
            self.specs[namespace] = spec
            chunk_bytes = spec.chunk_bytes
        return p.HelloOk(
            id=msg.id,
            version=p.PROTOCOL_VERSION,
            instance_id=self.instance_id,
            arena_path=arena.path,
            arena_size=arena.size,
            namespace=namespace,
            chunk_bytes=chunk_bytes,
            files=self.files,
        )

    def _lookup(self, conn: Connection, msg: p.Lookup) -> Answer:
        start = time.perf_counter()
        result = self.store.lookup(msg.namespace, msg.hashes, msg.lease_id, msg.replaces)
        if isinstance(result, LookupResult):  # the CPU tier answered: no Task
            return self._looked_up(msg, result, start)
        return self._lookup_later(msg, result, start)

    async def _lookup_later(
        self, msg: p.Lookup, pending: Coroutine[Any, Any, LookupResult], start: float
    ) -> p.Reply:
        return self._looked_up(msg, await pending, start)

    def _looked_up(self, msg: p.Lookup, result: LookupResult, start: float) -> p.Reply:
        spec = self.specs.get(msg.namespace)
        self.metrics.count_hits(result.tiers, spec.chunk_size if spec is not None else 0)
        if msg.stage and result.num_hit and spec is not None and self.prestage_bytes > 0:
            self._prestage(msg, result, spec)
        offsets, lengths = _wire_slots(result.slots)
        reply = p.LookupOk(
            id=msg.id,
            num_hit=result.num_hit,
            tiers=p.one_value(result.tiers),
            offsets=offsets,
            lengths=lengths,
            instance_id=self.instance_id,
        )
        self.metrics.observe("lookup", time.perf_counter() - start)
        return reply

    def _prestage(self, msg: p.Lookup, result: LookupResult, spec: NamespaceSpec) -> None:
        """Start staging the lease of a lookup whose hit has lower-tier chunks (a Task this service
        owns), so the reads run while the request waits in vLLM's queue; skipped, and counted, when
        those bytes would pass the budget (the worker's Stage reads them when it comes)."""
        lower = result.num_hit - result.tiers.count(Tier.CPU)
        below_disk = any(t is not Tier.CPU and t is not Tier.DISK for t in result.tiers)
        if not lower or self.draining or (msg.direct_disk and not below_disk):
            return  # nothing below the CPU tier, or only disk chunks the engine reads itself
        counts = self.metrics.prestage
        nbytes = lower * spec.chunk_bytes
        if counts.inflight_bytes + nbytes > self.prestage_bytes:
            counts.skipped += 1
            return
        counts.inflight_bytes += nbytes
        counts.leases += 1
        counts.bytes += nbytes
        task = asyncio.get_running_loop().create_task(
            self._run_prestage(msg.lease_id, nbytes), name="kvtier-prestage"
        )
        self._prestages.add(task)
        task.add_done_callback(self._prestages.discard)

    async def _run_prestage(self, lease_id: str, nbytes: int) -> None:
        """Stage the lease; its bytes return to the budget when the reads end, however they end."""
        try:
            await self.store.stage(lease_id)
        except Exception:  # never raised into the loop: the worker's Stage reads what is missing
            self.metrics.prestage.errors += 1
            log.warning("staging a lease ahead failed", exc_info=True, extra={"lease_id": lease_id})
        finally:
            self.metrics.prestage.inflight_bytes -= nbytes

    async def _stage(self, conn: Connection, msg: p.Stage) -> p.Reply:
        start = time.perf_counter()
        result = await self.store.stage(msg.lease_id)
        reply = p.StageOk(
            id=msg.id,
            slots=result.slots,
            tiers=result.tiers,
            failed=result.failed,
            instance_id=self.instance_id,
        )
        self.metrics.observe("stage", time.perf_counter() - start)
        return reply

    def _release(self, conn: Connection, msg: p.Release) -> p.Reply:
        self.store.release(msg.lease_id)
        return p.OkReply(id=msg.id)

    def _reserve(self, conn: Connection, msg: p.Reserve) -> p.Reply:
        start = time.perf_counter()
        slots = self.store.reserve(msg.namespace, msg.hashes)
        granted = list(filter(None, slots))  # a SlotRef is a non-empty tuple: always true
        offsets = list(map(_first, granted))
        self._slots.update(zip(offsets, zip(granted, repeat(conn)), strict=True))
        conn.slots.update(offsets)
        self.metrics.observe("reserve", time.perf_counter() - start)
        return p.ReserveOk(id=msg.id, slots=slots, instance_id=self.instance_id)

    def _commit(self, conn: Connection, msg: p.Commit) -> p.Reply:
        start = time.perf_counter()
        hashes, slots = self._to_commit(msg)
        if slots:
            covered = self._covered(msg, hashes) if msg.block_hashes else ()
            self.store.commit(msg.namespace, hashes, slots, covered)
            self._disown(slots)  # only now: a refused commit leaves them owned
        self.metrics.observe("commit", time.perf_counter() - start)
        if len(slots) != len(msg.slots):
            raise CallError(
                p.ErrorCode.BAD_REQUEST,
                f"{len(msg.slots) - len(slots)} of {len(msg.slots)} slots were not reserved "
                "(already committed or aborted, or their connection closed); the others were "
                "committed",
            )
        return p.OkReply(id=msg.id)

    @staticmethod
    def _covered(msg: p.Commit, hashes: list[bytes]) -> list[Covered]:
        """The block hashes and descriptions of the chunks committed (hashes: msg's, less those not
        reserved)."""
        if len(msg.block_hashes) != len(msg.hashes):
            raise CallError(p.ErrorCode.BAD_REQUEST, "commit needs one block hash list per chunk")
        if msg.descriptions and len(msg.descriptions) != len(msg.hashes):
            raise CallError(p.ErrorCode.BAD_REQUEST, "commit needs one description per chunk, or none")
        descriptions = msg.descriptions or repeat(b"")
        covered = map(Covered, msg.block_hashes, descriptions)
        if hashes is msg.hashes:
            return list(covered)
        by_hash = dict(zip(msg.hashes, covered, strict=True))
        return [by_hash[h] for h in hashes]

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

    def _abort(self, conn: Connection, msg: p.Abort) -> p.Reply:
        self._check_instance(msg.instance_id)
        slots = list({ref.offset: ref for s in msg.slots if (ref := self._owned(s))}.values())
        if slots:
            self.store.abort(slots)
            self._disown(slots)
        return p.OkReply(id=msg.id)

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

    async def _disk_reads(self, conn: Connection, msg: p.DiskReads) -> p.Reply:
        await self.store.disk_reads(msg.namespace, msg.hashes, msg.nbytes, msg.corrupt)
        return p.OkReply(id=msg.id)

    async def _clear(self, conn: Connection, msg: p.Clear) -> p.Reply:
        try:
            tiers = [Tier(t) for t in msg.tiers] if msg.tiers else list(Tier)
        except ValueError as exc:
            raise CallError(p.ErrorCode.BAD_REQUEST, f"unknown tier: {exc}") from None
        return p.CountReply(id=msg.id, count=await self.store.clear(tiers))

    def _stats(self, conn: Connection, msg: p.Stats) -> p.Reply:
        return p.StatsOk(id=msg.id, stats=self.stats())

    def _health(self, conn: Connection, msg: p.Health) -> p.Reply:
        serving, tiers = self.health()
        return p.HealthOk(id=msg.id, serving=serving, instance_id=self.instance_id, tiers=tiers)

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
        out["namespace_specs"] = {
            ns: {
                "model": s.model,
                "block_size": s.block_size,
                "chunk_size": s.chunk_size,
                "tp_rank": s.tp_rank,
                "tp_size": s.tp_size,
                "pp_rank": s.pp_rank,
                "pp_size": s.pp_size,
                "hash_algo": s.hash_algo,
            }
            for ns, s in sorted(self.specs.items())
        }
        if self.event_stats is not None:
            out["events"] = self.event_stats()
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

    def owned(self) -> tuple[int, int]:
        """(leases the store holds, reserved slots the service tracks for connections)."""
        return self.store.stats().leases_active, len(self._slots)

    def _check_instance(self, instance_id: str) -> None:
        if instance_id and instance_id != self.instance_id:
            raise CallError(
                p.ErrorCode.STALE_INSTANCE,
                f"slots of service instance {instance_id} are void: this is {self.instance_id}",
            )

    # --------------------------------------------------------------------------- shutdown
    async def drain(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones and reads ahead finish within grace, cancel the
        rest, disconnect."""
        self.draining = True
        # The reads ahead too: each ends its stage before the store closes, or is cancelled.
        pending = [t for c in list(self.connections) for t in c.inflight] + list(self._prestages)
        if pending:
            _done, late = await asyncio.wait(pending, timeout=grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for conn in list(self.connections):
            conn.close()
        # connection_lost runs on the next loop iterations; then each connection is cleaned up.
        try:
            await asyncio.wait_for(self.wait_idle(), timeout=max(grace, 1.0))
        except TimeoutError:
            log.warning("connections still closing after %.1fs", grace)
