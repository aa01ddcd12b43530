"""Scheduler-side connector: lookups, load plans and save plans. Keeps books, never does bulk I/O.

Who owns what: everything here runs on vLLM's scheduler thread. Per request it keeps only what vLLM
cannot tell it again: the block table seen in scheduler outputs, the save watermark, the current
lease id and a lookup answer waiting for ``update_state_after_alloc``. Token counts and block hashes
are read from vLLM's request each step, never copied. Lookups go to the service through the client
(non-blocking futures, each waited on for at most the lookup budget).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from app.client import LookupReply, ServiceClient
from connector.config import ConnectorConfig
from connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from connector.planning import (
    chunk_block_ids,
    chunk_hashes,
    external_tokens,
    load_spans,
    save_range,
)
from connector.stats import SchedulerCounters, merge_counts
from storage.base import Tier

log = logging.getLogger(__name__)

_NEVER = 1 << 62  # a token count no request reaches


@dataclass(slots=True)
class _Lookup:
    future: concurrent.futures.Future[LookupReply]
    num_chunks: int
    lease_id: str
    started: float
    replaces: str  # the lease the lookup ends (see _start_lookup)


@dataclass(slots=True)
class _Answer:
    reply: LookupReply | None  # None: nothing to load (no lookup needed, or it failed)
    local_tokens: int
    external: int


@dataclass(slots=True)
class _Request:
    """What the scheduler side remembers of one live request."""

    request: Any
    block_table: list[int] = field(default_factory=list)
    watermark: int = 0
    # Tokens [quiet_from, quiet_until) of computed-after-the-step: no save can be due (see _scan).
    quiet_from: int = 0
    quiet_until: int = 0
    lease_id: str = ""
    lookup: _Lookup | None = None
    answer: _Answer | None = None
    async_load_pending: bool = False
    saved_any: bool = False
    hit_sources: dict[Tier, int] = field(default_factory=dict)


class SchedulerSide:
    """The scheduler role of KVTierConnector."""

    def __init__(self, cfg: ConnectorConfig, client: ServiceClient | None) -> None:
        self.cfg = cfg
        self.geo = cfg.geometry
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
        self._bpc = self.geo.blocks_per_chunk

    # ------------------------------------------------------------------------------------ lookups
    def on_new_request(self, request: Any) -> None:
        """Start the lookup as the request arrives, so admission finds the answer already there."""
        if self.client is None or request.request_id in self._reqs:
            return
        st = self._reqs[request.request_id] = _Request(request)
        hashes = chunk_hashes(request.block_hashes, self.geo)
        if hashes:
            st.lookup = self._start_lookup(st, hashes)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """External tokens for a waiting request; None means 'ask again next step'."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Request(request)
        st.answer = None
        if self.client is None:
            return 0, False
        num_chunks = len(request.block_hashes) // self._bpc
        if num_chunks * self.geo.chunk_size <= num_computed_tokens:
            st.answer = _Answer(None, num_computed_tokens, 0)  # still an admission to count
            return 0, False
        if st.lookup is None or st.lookup.num_chunks != num_chunks or self._too_old(st.lookup):
            st.lookup = self._start_lookup(st, chunk_hashes(request.block_hashes, self.geo))
        lookup = st.lookup
        waited_from = time.monotonic()
        try:
            reply = lookup.future.result(timeout=max(0.0, self._budget_left))
        except Exception as exc:
            # The client's CallTimeout is a TimeoutError too: only a future still pending means
            # "not answered yet"; a failed answer is a miss, now.
            if isinstance(exc, concurrent.futures.TimeoutError) and not lookup.future.done():
                self._budget_left = 0.0  # one slow answer per step: others don't wait behind it
                self.counters.lookups_deferred += 1
                return None, False
            st.lookup = None
            # The service ends the replaced lease even when the lookup fails; a lookup that never
            # reached it did not, so end it here (ending a lease twice does nothing).
            self._end_lease(lookup.replaces)
            self.counters.lookup_errors += 1
            log.debug("kvtier lookup failed, treating as a miss: %s", exc)
            st.answer = _Answer(None, num_computed_tokens, 0)
            return 0, False
        finally:
            self._budget_left = max(0.0, self._budget_left - (time.monotonic() - waited_from))
        st.lookup = None
        if reply.result.num_hit == 0:
            st.lease_id = ""  # the service keeps no lease for a lookup that found nothing
        self.counters.observe_lookup_latency(time.monotonic() - lookup.started)
        ext = external_tokens(reply.result.num_hit, num_computed_tokens, request.num_tokens, self.geo)
        st.answer = _Answer(reply, num_computed_tokens, ext)
        return ext, ext > 0 and self._needs_async(reply, num_computed_tokens, ext)

    def _start_lookup(self, st: _Request, hashes: list[bytes]) -> _Lookup:
        assert self.client is not None
        lease_id = f"{self.cfg.engine_id}:{st.request.request_id}:{next(self._lease_seq)}"
        # A new lease id per lookup, so an answer is never confused with a later one; the lookup
        # ends the request's previous lease itself, once the new one holds the chunks.
        replaces, st.lease_id = st.lease_id, lease_id
        future = self.client.lookup(self.cfg.namespace, hashes, lease_id, replaces=replaces)
        return _Lookup(future, len(hashes), lease_id, time.monotonic(), replaces)

    def _too_old(self, lookup: _Lookup) -> bool:
        # An answer is only as good as its lease; never act on one that may have expired meanwhile.
        return time.monotonic() - lookup.started > self.cfg.settings.lease_ttl / 2

    def _needs_async(self, reply: LookupReply, local: int, ext: int) -> bool:
        spans = load_spans(local, ext, self.geo)
        return any(reply.result.tiers[s.chunk] != Tier.CPU for s in spans)

    def _release(self, st: _Request) -> None:
        self._end_lease(st.lease_id)
        st.lease_id = ""

    def _end_lease(self, lease_id: str) -> None:
        if lease_id and self.client is not None:
            self.client.release_nowait(lease_id)

    # -------------------------------------------------------------------------------- admission
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Turn the lookup answer into a load plan for the blocks vLLM just allocated."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Request(request)
        answer, st.answer = st.answer, None
        if answer is None:
            return  # e.g. the second call after an async load finished
        admitted = answer.local_tokens + num_external_tokens
        self._set_watermark(st, admitted // self.geo.chunk_size)
        self.counters.count_admission(request, num_external_tokens)
        reply = answer.reply
        if num_external_tokens <= 0 or reply is None:
            self._release(st)
            return
        table = list(blocks.get_block_ids()[0])
        spans = load_spans(answer.local_tokens, num_external_tokens, self.geo)
        is_async = any(reply.result.tiers[s.chunk] != Tier.CPU for s in spans)
        chunks = []
        sources: dict[Tier, int] = {}
        for s in spans:
            slot = reply.result.slots[s.chunk]
            chunks.append(
                ChunkLoad(
                    index=s.chunk,
                    first=s.first,
                    block_ids=table[s.table_start : s.table_start + s.count],
                    slot=None if is_async or slot is None else (slot.offset, slot.length),
                )
            )
            tier = reply.result.tiers[s.chunk]
            sources[tier] = sources.get(tier, 0) + s.count * self.geo.block_size
        st.hit_sources = sources
        self.counters.count_hits(sources)
        self._loads[request.request_id] = LoadJob(
            request.request_id, st.lease_id, chunks, is_async, reply.instance_id
        )
        st.async_load_pending = is_async
        st.lease_id = ""  # the worker releases it once the copy is done

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Tier, int]:
        """Tokens of the last admission split by the tier they come from."""
        st = self._reqs.get(request.request_id)
        return dict(st.hit_sources) if st is not None else {}

    # ------------------------------------------------------------------------------------- steps
    def build_connector_meta(self, so: Any) -> KVTierMetadata:
        """This step's loads, saves, preemptions and held finished requests."""
        self._budget_left = self._budget_s
        meta = KVTierMetadata()
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            self._on_preempted(req_id, meta)
        new = so.scheduled_new_reqs
        if new:
            ids = [n.req_id for n in new]
            tables = [n.block_ids for n in new]
            self._scan(so, ids, tables, [n.num_computed_tokens for n in new], set(ids), meta)
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids or None
        self._scan(so, cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, resumed, meta)
        # Async loads were planned for requests that are not scheduled this step.
        meta.loads.extend(self._loads.values())
        self._loads.clear()
        meta.saves.extend(self._final_saves)
        self._final_saves = []
        meta.held, self._held = self._held, []
        return meta

    def _on_preempted(self, req_id: str, meta: KVTierMetadata) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        meta.preempted.append(req_id)
        st.block_table = []
        load = self._loads.pop(req_id, None)
        if load is not None:  # preempted before its load ran
            self._end_lease(load.lease_id)
        self.counters.preemptions += 1

    def _scan(
        self,
        so: Any,
        req_ids: list[str],
        new_block_ids: list[Any],
        computed_tokens: list[int],
        replace: set[str] | None,
        meta: KVTierMetadata,
    ) -> None:
        """Track block tables, send planned loads and plan saves for these scheduled requests.

        Runs for every scheduled request every step, so the common case (a decode step that
        completes no chunk) is a few integer operations with no call; req_ids in `replace` get
        the block table given instead of appending to theirs (`replace` None: nobody does).
        """
        reqs, loads = self._reqs, self._loads
        scheduled = so.num_scheduled_tokens
        spec = so.scheduled_spec_decode_tokens
        for req_id, ids, computed in zip(req_ids, new_block_ids, computed_tokens, strict=True):
            st = reqs.get(req_id)
            if st is None:
                continue
            if replace is not None and req_id in replace:
                st.block_table = list(ids[0]) if ids is not None else []
            elif ids is not None and ids[0]:
                st.block_table.extend(ids[0])
            if loads and req_id in loads:
                meta.loads.append(loads.pop(req_id))
            new_valid = scheduled.get(req_id, 0)
            # Scheduled tokens bound the valid ones (speculative ones are not valid): inside the
            # quiet window no chunk completes and none moved back, so save_range would plan nothing.
            if st.quiet_from <= computed and computed + new_valid < st.quiet_until:
                continue
            if spec and req_id in spec:
                new_valid -= len(spec[req_id])
            job = self._plan_save(st, computed, new_valid)
            if job is not None:
                meta.saves.append(job)

    def _set_watermark(self, st: _Request, watermark: int) -> None:
        """Remember the save watermark and the token window in which no save can be due."""
        st.watermark = watermark
        chunk = self.geo.chunk_size
        st.quiet_from = watermark * chunk
        if not self.cfg.settings.save_decode and watermark >= st.request.num_prompt_tokens // chunk:
            st.quiet_until = _NEVER  # every chunk this request will save is planned
        else:
            st.quiet_until = (watermark + 1) * chunk

    def _plan_save(self, st: _Request, computed: int, new_valid: int) -> SaveJob | None:
        request = st.request
        limit = None if self.cfg.settings.save_decode else request.num_prompt_tokens
        hashes = request.block_hashes
        rng = save_range(computed, new_valid, len(hashes), st.watermark, self.geo, limit)
        self._set_watermark(st, rng.hi)
        if not rng.chunks or self.client is None:
            return None
        bpc = self.geo.blocks_per_chunk
        job = SaveJob(request.request_id, [], [])
        for chunk in rng.chunks:
            try:
                ids = chunk_block_ids(st.block_table, chunk, self.geo)
            except ValueError:
                break  # blocks not known (should not happen): save nothing past this point
            job.hashes.append(bytes(hashes[(chunk + 1) * bpc - 1]))
            job.block_ids.append(ids)
        if not job.hashes:
            return None
        st.saved_any = True
        return job

    def update_connector_output(self, output: Any) -> None:
        """Note async loads that finished (the worker released their leases)."""
        for req_id in getattr(output, "finished_recving", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.async_load_pending = False

    # ------------------------------------------------------------------------------- lifecycle
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Release the lease; hold the blocks while saves (or an async load) may still read them."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._release(st)
        if st.lookup is not None:
            self._end_lease(st.lookup.lease_id)
        load = self._loads.pop(request.request_id, None)
        if load is not None:  # planned but never sent: nothing reads the blocks
            self._end_lease(load.lease_id)
            return False, None
        if st.async_load_pending:
            return True, None  # the worker reports it in finished_recving when the copy ends
        final = self._final_save(st, request, block_ids)
        if final is not None:
            self._final_saves.append(final)
        if st.saved_any:
            self._held.append(request.request_id)
            return True, None
        return False, None

    def _final_save(self, st: _Request, request: Any, block_ids: list[int]) -> SaveJob | None:
        # Chunks whose hash appeared after their KV was written (async scheduling) and whose KV is
        # valid: the request's in-flight tokens are not computed yet.
        valid = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        st.block_table = list(block_ids)
        return self._plan_save(st, valid, 0)

    def stats(self) -> dict[str, Any]:
        """Counters since the last call (reset on read); ``totals`` keeps the running sums."""
        data = self.counters.take()
        self.totals = merge_counts(self.totals, data)
        return data

    def shutdown(self) -> None:
        """Release every lease this side still holds."""
        for st in self._reqs.values():
            self._release(st)
        self._reqs.clear()
