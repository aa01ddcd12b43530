"""Scheduler-side connector: lookups, load plans and save plans. Keeps books, never does bulk I/O.

Who owns what: everything here runs on vLLM's scheduler thread; per request it keeps only what vLLM
cannot tell it again (block table, save watermark, lease id, a lookup answer awaiting allocation).
Design: docs/internals.md#scheduler-side-schedulerpy
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.app.client import Call, LookupReply, ServiceClient
from kvtier.connector import faults
from kvtier.connector.config import ConnectorConfig, rank_specs, with_generation
from kvtier.connector.describe import describe_chunk
from kvtier.connector.disk_reads import file_channel_of
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, KVTierWorkerMeta, LoadJob, SaveJob
from kvtier.connector.planning import (
    ChunkSpan,
    chunk_block_ids,
    chunk_hashes,
    combine_rank_hits,
    external_tokens,
    group_load_ids,
    group_save_ids,
    load_spans,
    rank_lease_id,
    save_range,
)
from kvtier.connector.stats import SchedulerCounters, merge_counts
from kvtier.storage.base import SlotRef, Tier

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

_NEVER = 1 << 62  # a token count no request reaches


def _slot(slot: SlotRef | None) -> tuple[int, int] | None:
    return None if slot is None else (slot.offset, slot.length)


@dataclass(slots=True)
class _Lookup:
    futures: list[Call[LookupReply]]  # one per rank, in rank order
    num_chunks: int
    lease_id: str
    started: float
    replaces: str  # the lease the lookup ends (see _start_lookup)


@dataclass(slots=True)
class _Hit:
    """What the lookups of every rank found together, and each rank's CPU-tier slots."""

    num_hit: int  # leading chunks every rank holds
    tiers: list[Tier]  # per chunk, the slowest tier a rank holds it in
    slots: list[Sequence[SlotRef | None]]  # per rank, per chunk
    instance_id: str


@dataclass(slots=True)
class _Answer:
    hit: _Hit | None  # None: nothing to load (no lookup needed, or it failed)
    local_tokens: int
    external: int


@dataclass(slots=True)
class _Request:
    """What the scheduler side remembers of one live request."""

    request: Request
    tables: list[list[int]] = field(default_factory=list)  # block ids per KV cache group
    watermark: int = 0
    # Tokens [quiet_from, quiet_until) of computed-after-the-step: no save can be due (see _plan_saves).
    quiet_from: int = 0
    quiet_until: int = 0
    lease_id: str = ""
    lookup: _Lookup | None = None
    answer: _Answer | None = None
    async_load_pending: bool = False
    saved_any: bool = False
    hit_sources: dict[Tier, int] = field(default_factory=dict)
    # The step at which build_connector_meta next looks at it for saves (-1: once vLLM schedules
    # it afresh; see _plan_saves).
    look_at: int = -1
    last_save: int = 0  # the step of its last save plan


class SchedulerSide:
    """The scheduler role of KVTierConnector."""

    def __init__(self, cfg: ConnectorConfig, client: ServiceClient | None) -> None:
        self.cfg = cfg
        self.geometry = cfg.geometry
        self.client = client
        self.counters = SchedulerCounters()
        self.totals: dict[str, Any] = {}
        self._reqs: dict[str, _Request] = {}
        self._held: list[str] = []
        self._loads: dict[str, LoadJob] = {}  # planned at admission, sent in this step's metadata
        self._final_saves: list[SaveJob] = []
        self._lease_seq = itertools.count(1)
        self._budget_s = cfg.settings.lookup_budget_ms / 1000.0
        self._budget_left = self._budget_s
        self._blocks_per_chunk = self.geometry.blocks_per_chunk
        self._step = 0  # build_connector_meta calls so far
        self._saved_through = 0  # every worker's saves planned up to this step have ended
        self._plans_due: dict[int, list[_Request]] = {}  # step -> requests to look at then (see _plan_saves)
        self._step_tokens = max(1, cfg.step_tokens)
        # One lookup per rank, each under its own lease: a chunk is a hit when every rank holds it.
        self._namespaces = cfg.lookup_namespaces
        # Workers read disk hits themselves: the service then reads ahead only Redis hits.
        url = client.url if client is not None else ""
        self._direct_disk = not cfg.hybrid and bool(
            file_channel_of(cfg.settings.disk_direct_reads, url, cfg.spec.kv_layout)
        )
        self._group_reach = cfg.group_reach or (None,)
        # Sliding-window blocks are freed while requests run: the workers learn each step's new blocks.
        self._windowed = any(r is not None for r in self._group_reach)

    # ------------------------------------------------------------------------------------ lookups
    def on_new_request(self, request: Request) -> None:
        """Start the lookup as the request arrives, so admission finds the answer already there."""
        if self.client is None or request.request_id in self._reqs:
            return
        state = self._reqs[request.request_id] = _Request(request)
        hashes = chunk_hashes(request.block_hashes, self.geometry) if self.cfg.loads else []
        if hashes:
            # Held until admission asks for it (or a few more arrive): one send for a burst.
            state.lookup = self._start_lookup(state, hashes, hold=True)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External tokens for a waiting request; None means 'ask again next step'."""
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _Request(request)
        state.answer = None
        if self.client is None:
            return 0, False
        num_chunks = len(request.block_hashes) // self._blocks_per_chunk
        if not self.cfg.loads or num_chunks * self.geometry.chunk_size <= num_computed_tokens:
            state.answer = _Answer(None, num_computed_tokens, 0)  # still an admission to count
            return 0, False
        if state.lookup is None or state.lookup.num_chunks != num_chunks or self._too_old(state.lookup):
            state.lookup = self._start_lookup(state, chunk_hashes(request.block_hashes, self.geometry))
        lookup = state.lookup
        waited_from = time.monotonic()
        future = lookup.futures[0]
        try:
            replies = []
            for future in lookup.futures:
                left = self._budget_left - (time.monotonic() - waited_from)
                replies.append(future.result(timeout=max(0.0, left)))
        except Exception as exc:
            # The client's CallTimeout is a TimeoutError too: only a future still pending means
            # "not answered yet"; a failed answer is a miss, now.
            if isinstance(exc, TimeoutError) and not future.done():
                self._budget_left = 0.0  # one slow answer per step: others don't wait behind it
                self.counters.lookups_deferred += 1
                return None, False
            state.lookup = None
            faults.caught(exc, "a lookup")
            # The service ends the replaced lease even when the lookup fails; a lookup that never
            # reached it did not, so end it here (ending a lease twice does nothing).
            self._end_lease(lookup.replaces)
            self.counters.lookup_errors += 1
            log.debug("kvtier lookup failed, treating as a miss: %s", exc)
            state.answer = _Answer(None, num_computed_tokens, 0)
            return 0, False
        finally:
            self._budget_left = max(0.0, self._budget_left - (time.monotonic() - waited_from))
        state.lookup = None
        self.counters.observe_lookup_latency(time.monotonic() - lookup.started)
        hit = self._combine(state, replies)
        ext = external_tokens(hit.num_hit, num_computed_tokens, request.num_tokens, self.geometry)
        state.answer = _Answer(hit, num_computed_tokens, ext)
        return ext, ext > 0 and self._needs_async(hit, load_spans(num_computed_tokens, ext, self.geometry))

    def _combine(self, state: _Request, replies: list[LookupReply]) -> _Hit:
        """One hit from every rank's answer; no lease is left behind when it is none."""
        results = [r.result for r in replies]
        num_hit, tiers = combine_rank_hits([r.num_hit for r in results], [r.tiers for r in results])
        if len({r.instance_id for r in replies}) > 1:  # answered by two service instances
            num_hit, tiers = 0, []
        if num_hit == 0:
            # The service keeps no lease for a lookup that found nothing; end those that found some.
            for rank, result in enumerate(results):
                if result.num_hit:
                    self._end_rank_lease(state.lease_id, rank)
            state.lease_id = ""
        return _Hit(num_hit, tiers, [r.slots for r in results], replies[0].instance_id)

    def _start_lookup(self, state: _Request, hashes: list[bytes], hold: bool = False) -> _Lookup:
        assert self.client is not None
        lease_id = f"{self.cfg.engine_id}:{state.request.request_id}:{next(self._lease_seq)}"
        # A new lease id per lookup, so an answer is never confused with a later one; the lookup
        # ends the request's previous lease itself, once the new one holds the chunks.
        replaces, state.lease_id = state.lease_id, lease_id
        futures = [
            self.client.lookup(
                namespace,
                hashes,
                rank_lease_id(lease_id, rank),
                replaces=rank_lease_id(replaces, rank),
                hold=hold,
                stage=True,
                direct_disk=self._direct_disk,
            )
            for rank, namespace in enumerate(self._namespaces)
        ]
        return _Lookup(futures, len(hashes), lease_id, time.monotonic(), replaces)

    def _too_old(self, lookup: _Lookup) -> bool:
        # An answer is only as good as its lease; never act on one that may have expired meanwhile.
        return time.monotonic() - lookup.started > self.cfg.settings.lease_ttl / 2

    def _needs_async(self, hit: _Hit, spans: list[ChunkSpan]) -> bool:
        """Whether a load waits for its KV asynchronously: a lower-tier chunk, or a hybrid engine
        (vLLM takes a failed load of one only as a failed receive)."""
        return self.cfg.hybrid or any(hit.tiers[s.chunk] != Tier.CPU for s in spans)

    def reset_cache(self) -> bool:
        """Move this engine to a new generation of namespaces (vLLM reset its caches, e.g. after new
        weights): no chunk stored before is looked up, loaded or saved into again. Answers not
        used yet are dropped (their requests look up again); the workers follow at their next step."""
        self.cfg = with_generation(self.cfg, secrets.token_hex(8))
        self._namespaces = self.cfg.lookup_namespaces
        if self.client is not None:  # register the new namespaces before the first lookup in them
            for spec in rank_specs(self.cfg.spec, self.cfg.replicated):
                self.client.hello(spec)
        for state in self._reqs.values():
            if not state.async_load_pending:
                self._release(state)
                state.lookup = state.answer = None
        return True

    def _release(self, state: _Request) -> None:
        self._end_lease(state.lease_id)
        state.lease_id = ""

    def _end_lease(self, lease_id: str) -> None:
        """End the lease of every rank's lookup."""
        for rank in range(len(self._namespaces)):
            self._end_rank_lease(lease_id, rank)

    def _end_rank_lease(self, lease_id: str, rank: int) -> None:
        if lease_id and self.client is not None:
            self.client.release(rank_lease_id(lease_id, rank))

    # -------------------------------------------------------------------------------- admission
    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """Turn the lookup answer into a load plan for the blocks vLLM just allocated."""
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _Request(request)
        answer, state.answer = state.answer, None
        if answer is None:
            return  # e.g. the second call after an async load finished
        admitted = answer.local_tokens + num_external_tokens
        self._set_watermark(state, admitted // self.geometry.chunk_size)
        self.counters.count_admission(request, num_external_tokens)
        hit = answer.hit
        if num_external_tokens <= 0 or hit is None:
            self._release(state)
            return
        tables = [list(t) for t in blocks.get_block_ids()]
        spans = load_spans(answer.local_tokens, num_external_tokens, self.geometry)
        is_async = self._needs_async(hit, spans)
        chunks = []
        sources: dict[Tier, int] = {}
        hashes, last = request.block_hashes, self._blocks_per_chunk - 1
        failed = False
        for s in spans:
            slots = [_slot(rank_slots[s.chunk]) for rank_slots in hit.slots]
            tier = hit.tiers[s.chunk]
            key = bytes(hashes[s.chunk * self._blocks_per_chunk + last]) if is_async else b""
            try:
                end = s.table_start + s.count
                groups = [
                    group_load_ids(table[s.table_start : end], s.first, s.chunk, self.geometry, reach)
                    for table, reach in zip(tables, self._group_reach, strict=True)
                ]
            except ValueError as exc:  # a bug of this plan, not of vLLM: the load fails, recomputed
                faults.caught(exc, "planning a load")
                failed = True
                groups = [(s.first, []) for _ in tables]
            first, ids = groups[0]
            chunks.append(ChunkLoad(s.chunk, first, ids, slots[0], slots[1:], key, int(tier), groups[1:]))
            sources[tier] = sources.get(tier, 0) + s.count * self.geometry.block_size
        state.hit_sources = sources
        self.counters.count_hits(sources)
        self._loads[request.request_id] = LoadJob(
            request.request_id, state.lease_id, chunks, is_async, hit.instance_id, failed
        )
        state.async_load_pending = is_async
        state.lease_id = ""  # the worker releases it once the copy is done

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Tier, int]:
        """Tokens of the last admission split by the tier they come from."""
        state = self._reqs.get(request.request_id)
        return dict(state.hit_sources) if state is not None else {}

    # ------------------------------------------------------------------------------------- steps
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """This step's loads, saves, preemptions and held finished requests."""
        self._budget_left = self._budget_s
        self._step = step = self._step + 1
        idle = not scheduler_output.total_num_scheduled_tokens
        meta = KVTierMetadata(generation=self.cfg.generation, step=step, idle=idle)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._on_preempted(req_id, meta)
        if self._windowed:
            meta.allocated = self._allocated(scheduler_output)
        scheduled, spec = scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens
        for state, computed in self._track_tables(scheduler_output):
            self._plan_saves(state, step, computed, scheduled, spec, meta)
        due = self._plans_due.pop(step, None)
        if due:
            cached = scheduler_output.scheduled_cached_reqs
            at = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for state in due:
                # Else it was looked at since (a look always moves look_at past this step) or ended.
                if state.look_at == step:
                    self._plan_saves(state, step, at.get(state.request.request_id, -1), scheduled, spec, meta)
        if self._loads:
            # Async loads were planned for requests that are not scheduled this step.
            for req_id, job in self._loads.items():
                meta.loads.append(job)
                loaded = self._reqs.get(req_id)
                if loaded is not None and not job.is_async:
                    # A load that fails moves num_computed_tokens back: look at the request again.
                    self._plan_at(loaded, step + 1)
            self._loads.clear()
        meta.saves.extend(self._final_saves)
        self._final_saves = []
        meta.held, self._held = self._held, []
        return meta

    def _allocated(self, scheduler_output: SchedulerOutput) -> list[int]:
        """Every block vLLM handed out this step, of every group (new requests' whole tables)."""
        out: list[int] = []
        for n in scheduler_output.scheduled_new_reqs:
            for ids in n.block_ids or ():
                out.extend(ids)
        for table in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for group in table or ():
                out.extend(group)
        return out

    def _on_preempted(self, req_id: str, meta: KVTierMetadata) -> None:
        state = self._reqs.get(req_id)
        if state is None:
            return
        meta.preempted.append(req_id)
        state.tables = []
        state.look_at = -1  # looked at again when resumed
        load = self._loads.pop(req_id, None)
        if load is not None:  # preempted before its load ran
            self._end_lease(load.lease_id)
        self.counters.preemptions += 1

    def _track_tables(self, scheduler_output: SchedulerOutput) -> list[tuple[_Request, int]]:
        """Keep every scheduled request's block table; returns the requests scheduled afresh (new or
        resumed: their tables are given whole) with their computed tokens, to be looked at now.

        Runs every step over every scheduled request, so it visits only the few that got blocks:
        a step adds one block per block_size tokens to each request.
        """
        reqs = self._reqs
        fresh: list[tuple[_Request, int]] = []
        for n in scheduler_output.scheduled_new_reqs:  # first scheduled, or resumed under model runner V2
            state = reqs.get(n.req_id)
            if state is not None:
                state.tables = [list(t) for t in n.block_ids] if n.block_ids is not None else []
                fresh.append((state, n.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        req_ids, new_ids = cached.req_ids, cached.new_block_ids
        resumed = cached.resumed_req_ids
        if resumed:  # model runner V1: a resumed request's block ids are its whole table
            for i, req_id in enumerate(req_ids):
                if req_id in resumed and (state := reqs.get(req_id)) is not None:
                    ids = new_ids[i]
                    state.tables = [list(t) for t in ids] if ids is not None else []
                    fresh.append((state, cached.num_computed_tokens[i]))
        for req_id, appended in zip(req_ids, new_ids, strict=True):
            if appended is None or (resumed and req_id in resumed):
                continue
            if (state := reqs.get(req_id)) is not None:
                if not state.tables:
                    state.tables = [[] for _ in appended]
                for table, added in zip(state.tables, appended, strict=True):
                    table.extend(added)
        return fresh

    def _plan_at(self, state: _Request, step: int) -> None:
        if state.look_at != step:  # once per step: a request is never looked at twice in one
            state.look_at = step
            self._plans_due.setdefault(step, []).append(state)

    def _plan_saves(
        self,
        state: _Request,
        step: int,
        computed: int,
        scheduled: dict[str, int],
        spec: dict[str, list[int]],
        meta: KVTierMetadata,
    ) -> None:
        """Plan the saves due for a request, and when to look at it next.

        A request is looked at when it is scheduled afresh and then no sooner than a save can be
        due: once it has computed every token it knows, a step adds at most step_tokens to it,
        so a save cannot fall due before its token count has had the steps to reach quiet_until.
        Were a step ever to add more, a look would come late, never wrong: save_range plans every
        chunk from the watermark on, while the request still holds its blocks.
        """
        req_id = state.request.request_id
        new_valid = scheduled.get(req_id)
        if new_valid is None or computed < 0:  # not scheduled this step: look again at the next
            self._plan_at(state, step + 1)
            return
        reached = computed + new_valid  # speculative tokens included: a bound, not the valid ones
        # Inside the quiet window no chunk completes and none moved back: save_range plans nothing.
        if not (state.quiet_from <= computed and reached < state.quiet_until):
            if spec and req_id in spec:
                new_valid -= len(spec[req_id])
            job = self._plan_save(state, computed, new_valid)
            if job is not None:
                meta.saves.append(job)
        if state.quiet_until == _NEVER:
            state.look_at = -1
        elif reached < state.request.num_tokens:  # still computing tokens it knows (a prompt)
            self._plan_at(state, step + 1)
        else:
            self._plan_at(state, step + max(1, -(-(state.quiet_until - reached) // self._step_tokens)))

    def _set_watermark(self, state: _Request, watermark: int) -> None:
        """Remember the save watermark and the token window in which no save can be due."""
        state.watermark = watermark
        chunk = self.geometry.chunk_size
        state.quiet_from = watermark * chunk
        if not self.cfg.settings.save_decode and watermark >= state.request.num_prompt_tokens // chunk:
            state.quiet_until = _NEVER  # every chunk this request will save is planned
        else:
            state.quiet_until = (watermark + 1) * chunk

    def _plan_save(self, state: _Request, computed: int, new_valid: int) -> SaveJob | None:
        request = state.request
        limit = None if self.cfg.settings.save_decode else request.num_prompt_tokens
        hashes = request.block_hashes
        rng = save_range(computed, new_valid, len(hashes), state.watermark, self.geometry, limit)
        self._set_watermark(state, rng.hi)
        if not rng.chunks or self.client is None or not self.cfg.saves:
            return None
        bpc = self.geometry.blocks_per_chunk
        job = SaveJob(request.request_id, [], [])
        for chunk in rng.chunks:
            groups = self._chunk_groups(state, chunk, computed)
            if groups is None:
                # Blocks not known (should not happen), or a window's blocks vLLM may have freed: a
                # chunk past a missing one is never a hit, so save nothing past this point.
                self.counters.unsaved_chunks += rng.hi - chunk
                break
            job.hashes.append(bytes(hashes[(chunk + 1) * bpc - 1]))
            job.block_ids.append(groups[0])
            if len(groups) > 1:
                job.groups.append(groups[1:])
            job.block_hashes.append(list(map(bytes, hashes[chunk * bpc : (chunk + 1) * bpc])))
            job.descriptions.append(describe_chunk(request, chunk, self.geometry))
        if not job.hashes:
            return None
        state.saved_any = True
        state.last_save = self._step
        return job

    def _chunk_groups(self, state: _Request, chunk: int, computed: int) -> list[list[int]] | None:
        """The block ids to save into one chunk, per KV cache group, or None when one is missing."""
        if len(state.tables) != len(self._group_reach):
            return None
        groups = []
        for table, reach in zip(state.tables, self._group_reach, strict=True):
            try:
                ids = chunk_block_ids(table, chunk, self.geometry)
            except ValueError:
                return None
            held = group_save_ids(ids, chunk, self.geometry, reach, computed)
            if held is None:
                return None
            groups.append(held)
        return groups

    def update_connector_output(self, output: Any) -> None:
        """Note async loads that finished (the worker released their leases), and the step through
        which the workers' saves have ended."""
        done = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(done, KVTierWorkerMeta):
            self._saved_through = max(self._saved_through, done.saved_through)
        for req_id in getattr(output, "finished_recving", None) or ():
            state = self._reqs.get(req_id)
            if state is not None:
                state.async_load_pending = False

    # ------------------------------------------------------------------------------- lifecycle
    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict | None]:
        """Release the lease; hold the blocks while saves (or an async load) may still read them.
        ``block_ids``: the request's blocks of every KV cache group."""
        state = self._reqs.pop(request.request_id, None)
        if state is None:
            return False, None
        state.look_at = -1
        self._release(state)
        if state.lookup is not None:
            self._end_lease(state.lookup.lease_id)
        load = self._loads.pop(request.request_id, None)
        if load is not None:  # planned but never sent: nothing reads the blocks
            self._end_lease(load.lease_id)
            return False, None
        if state.async_load_pending:
            return True, None  # the worker reports it in finished_recving when the copy ends
        final = self._final_save(state, request, block_ids)
        if final is not None:
            self._final_saves.append(final)
        # Held while a save may still read its blocks: one planned now, or one the workers have not
        # reported ended (a step later, in get_finished, instead of freeing the blocks at once).
        if final is not None or (state.saved_any and state.last_save > self._saved_through):
            self._held.append(request.request_id)
            return True, None
        return False, None

    def _final_save(
        self, state: _Request, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> SaveJob | None:
        # Chunks whose hash appeared after their KV was written (async scheduling) and whose KV is
        # valid: the request's in-flight tokens are not computed yet.
        valid = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        state.tables = [list(ids) for ids in block_ids]
        return self._plan_save(state, valid, 0)

    def stats(self) -> dict[str, Any]:
        """Counters since the last call (reset on read); ``totals`` keeps the running sums."""
        data = self.counters.take()
        self.totals = merge_counts(self.totals, data)
        return data

    def shutdown(self) -> None:
        """Release every lease this side still holds."""
        for state in self._reqs.values():
            self._release(state)
        self._reqs.clear()
