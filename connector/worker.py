"""Worker-side connector: copies KV blocks between vLLM's cache and arena slots, reports completions.

Who owns what: vLLM's worker thread owns this object and every copy. The service client's thread only
completes futures; results are consumed here, on the worker thread, when vLLM polls. Per step:
``bind_connector_metadata`` fires the reserves for this step's saves; ``start_load_kv`` starts copying
CPU-tier hits into their blocks layer by layer and fires stages for lower-tier hits (or hands disk
hits to its disk reader, which reads the chunk files straight into the blocks: ``disk_reads``);
``wait_for_layer_load`` holds each attention layer until its loads are in place; ``wait_for_save`` hands
the step's finished chunks to the copier, which copies them into reserved slots (on its copy thread,
while vLLM goes on, when it has one) and then commits them; ``get_finished`` completes async loads and
reports held requests once every save issued before they were held has ended. Nothing waits on the
service longer than a small bound.

Deferred saves read blocks after wait_for_save returns, so every path on which vLLM may reuse a
block fences first: ``handle_preemptions`` (preempted requests), held finished requests (reported
only after their saves end), a new arena and shutdown.

Layer-by-layer loads are safe only if vLLM calls ``wait_for_layer_load`` for every layer before its
attention reads it; a replayed full CUDA graph, for one, does not. So the step's loads are checked
when they are finished (at the first of wait_for_save, get_finished or the load-error report, all
after the forward): if a layer was never waited for, every block of those loads is reported as a
load error (vLLM recomputes it and drops the step's token), and from then on loads are fenced before
the forward.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvtier.app.client import Call, HelloReply, ReserveReply, ServiceClient, ServiceError
from kvtier.app.file_channel import FileChannelError, FileClient
from kvtier.connector import faults
from kvtier.connector.config import ConnectorConfig, with_generation
from kvtier.connector.copy import BlockCopier, LayerLoads
from kvtier.connector.copy_thread import CopyError
from kvtier.connector.disk_reads import (
    CHANNEL_TIMEOUT_S,
    DiskReader,
    DiskReadResult,
    direct_reads,
    file_channel_of,
)
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, LoadJob, SaveJob
from kvtier.connector.stats import WorkerCounters, merge_counts
from kvtier.connector.worker_arena import WorkerArena
from kvtier.connector.worker_jobs import PendingLoad, SavedJob, StepLoads, layers_wait_in_forward
from kvtier.runtime.affinity import engine_cpus
from kvtier.storage.base import SlotRef

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

# Bound on waiting for this step's reserve answers in wait_for_save; past it the saves are skipped.
# After one miss of the bound the worker only probes (SAVE_PROBE_S) until answers come back, in time
# or late, so a slow or frozen service costs one bounded wait, not one per step.
SAVE_WAIT_S = 0.02
SAVE_PROBE_S = 0.001
HELLO_WAIT_S = 5.0


class WorkerSide:
    """The worker role of KVTierConnector."""

    def __init__(self, cfg: ConnectorConfig, client: ServiceClient | None) -> None:
        self.cfg = cfg
        self.client = client
        self.counters = WorkerCounters()
        self.totals: dict[str, Any] = {}
        self.copier: BlockCopier | None = None
        self._arena = WorkerArena(engine_cpus(), cuda=False)
        # Guards _late_errors, _saves_done and the save counters, written from client callbacks and
        # from the copy thread when a deferred save ends.
        self._lock = threading.Lock()
        self._late_errors = 0
        self._saves_issued = 0  # save batches handed to the copier; they end in this order
        self._saves_done = 0
        self._reserves: list[tuple[SaveJob, Call[ReserveReply]]] = []
        self._async: dict[str, PendingLoad] = {}
        self._load_errors: set[int] = set()
        self._failed_this_step: set[str] = set()
        self._finished_recving: set[str] = set()
        self._held_now: set[str] = set()  # held from this step's metadata, until its wait_for_save
        self._held: dict[str, int] = {}  # held request -> save batches that must end before it goes
        self._hello: Call[HelloReply] | None = None
        self._save_wait = SAVE_WAIT_S
        self._rank = cfg.rank  # which rank's lease and slots of a load plan are this worker's
        self._layer_index = {name: i for i, name in enumerate(cfg.layer_names)}
        self._all_layers = frozenset(self._layer_index.values())
        self._step_loads: StepLoads | None = None
        self._layered = True  # until vLLM is seen to skip a wait_for_layer_load
        # Layers the forward waits for before the step's first finish point (wait_for_save,
        # get_finished or the load-error report); a drafter's layers run after it (see _end_forward).
        self._in_forward = False
        self._waits_now: set[int] = set()
        self._forward_layers: set[int] = set()
        self._disk: DiskReader | None = None  # reads disk hits from their files (file channel)
        if client is not None:
            self._hello = client.hello(cfg.spec)

    # ---------------------------------------------------------------------------------- setup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Build the block copier over the layers, in the order of vLLM's KV cache group."""
        layers = [kv_caches[name] for name in self.cfg.layer_names]
        copier = BlockCopier(
            layers, self.cfg.num_blocks, self.cfg.geometry.blocks_per_chunk, helper_cpus=engine_cpus()
        )
        if copier.layout.page_bytes != self.cfg.spec.page_bytes:
            copier.close()
            raise ValueError(
                f"KV page is {copier.layout.page_bytes} bytes, vLLM's spec says {self.cfg.spec.page_bytes}"
            )
        self.copier = copier
        if copier.device.type == "cuda":
            self._arena.shutdown()
            self._arena = WorkerArena(engine_cpus(), cuda=True)
        self._refresh_arena(wait=HELLO_WAIT_S)

    def _refresh_arena(self, wait: float = 0.0) -> None:
        """Map the arena of the service instance the client is connected to, if it changed."""
        if self.client is None:
            return
        hello = self._hello
        if hello is not None:
            try:
                reply = hello.result(timeout=wait)
                if reply.instance_id != self._arena.instance_id:
                    self._fence()  # no copy may still use the mapping that adopt() replaces
                self._arena.adopt(reply, pin_here=wait > 0)  # at start-up; else off the serving path
                self._start_disk_reader(reply)
            except (ServiceError, TimeoutError, OSError) as exc:
                log.warning("kvtier: service not reachable yet (%s); loads and saves are skipped", exc)
            except Exception as exc:  # a failed mapping must not take vLLM down
                faults.caught(exc, "mapping the arena")
                log.warning("kvtier: cannot map the arena: %s", exc)
            else:
                self._hello = None
                return
            if not hello.done():
                return
            self._hello = None
        if self.client.connected and self.client.instance_id != self._arena.instance_id:
            self._hello = self.client.hello(self.cfg.spec)

    def _start_disk_reader(self, reply: HelloReply) -> None:
        """Read disk hits from their files from now on, where the service offers its file channel."""
        copier = self.copier
        planes = copier.host_planes if copier is not None else None
        if (
            self._disk is not None
            or not reply.files
            or copier is None
            or planes is None
            or self.client is None
        ):
            return
        path = file_channel_of(self.cfg.settings.disk_direct_reads, self.client.url, self.cfg.spec.kv_layout)
        if path:
            files = FileClient(path, self.cfg.settings.auth_token, timeout=CHANNEL_TIMEOUT_S)
            bpc = self.cfg.geometry.blocks_per_chunk
            self._disk = DiskReader(files, self.cfg.namespace, planes, bpc, copier.run_all)

    @property
    def ready(self) -> bool:
        """True when copies can run: KV caches registered and an arena mapped (and pinned, on CUDA)."""
        return self.copier is not None and self._arena.usable

    # ---------------------------------------------------------------------------------- steps
    def bind(self, meta: KVTierMetadata) -> None:
        """Start this step's reserves early, so their answers are in by wait_for_save."""
        self._finish_loads()  # the last step's, if nothing finished them (its forward raised)
        self._in_forward, self._waits_now = True, set()
        self._failed_this_step = set()
        self._held_now.update(meta.held)  # reported in get_finished whatever else happens
        if meta.generation != self.cfg.generation:
            self._regenerate(meta.generation)
        self._refresh_arena()
        if self.client is None or not self.ready or not self.cfg.saves:
            return  # a consumer stores nothing; nor does a rank whose KV another rank stores
        for job in meta.saves:
            self._reserves.append((job, self.client.reserve(self.cfg.namespace, job.hashes)))

    def _regenerate(self, generation: str) -> None:
        """Follow the scheduler side to a new generation of namespaces (reset_cache): saves issued
        before commit into the old namespace first, then the new spec is registered."""
        self._fence()
        self.cfg = with_generation(self.cfg, generation)
        if self._disk is not None:
            self._disk.namespace = self.cfg.namespace
        if self.client is not None:
            self._hello = self.client.hello(self.cfg.spec)

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Fence: copies reading blocks of requests preempted now must end before blocks are reused."""
        if meta.preempted:
            self._fence()

    def start_load(self, meta: KVTierMetadata, forward_context: Any = None) -> None:
        """Start copying CPU-tier hits into their blocks; stage lower-tier hits asynchronously."""
        sync = []
        for job in meta.loads:
            if not job.is_async:
                sync.append(job)
            elif self.client is None or not self.ready:
                self._fail_job(job, range(len(job.chunks)))
                self._release(job.lease_of(self._rank))
                self._finished_recving.add(job.req_id)
            else:
                self._async[job.req_id] = self._start_async(job, time.monotonic())
        if not sync:
            return
        self._load_layered(sync)
        step = self._step_loads
        assert step is not None
        if not self._layered:  # vLLM skipped a layer wait before: finish before the forward
            step.waited = set(self._all_layers)
            self._finish_loads()
        elif not layers_wait_in_forward(forward_context):
            # A full CUDA graph replay reads every layer without asking: what runs next (the
            # replay, on the compute stream) waits for all of the loads; the host does not.
            step.loads.wait_layer(len(self._all_layers) - 1)
            step.waited = set(self._all_layers)
            self.counters.full_graph_loads += 1

    def _start_async(self, job: LoadJob, started: float) -> PendingLoad:
        """Open the job's disk files to read them here where it can, else stage its lease."""
        reads = direct_reads(job, self._rank) if self._disk is not None else None
        if reads is not None and self._disk is not None:
            try:
                load = self._disk.open(reads)
            except FileChannelError as exc:
                log.debug("kvtier: file channel: %s; staging %s instead", exc, job.req_id)
                load = None
            except Exception as exc:  # a bug must cost the service's read, never vLLM's step
                faults.caught(exc, "opening disk files")
                load = None
            if load is not None:
                return PendingLoad(job, None, started, load)
            self.counters.disk_read_fallbacks += 1  # a file gone, or the channel down
        assert self.client is not None
        return PendingLoad(job, self.client.stage(job.lease_of(self._rank)), started)

    def _load_layered(self, jobs: list[LoadJob]) -> None:
        """Issue the step's sync loads layer by layer; the forward waits per layer (or, where the
        copier does not overlap loads with the forward, copy them all here)."""
        started = time.monotonic()
        chunks: list[tuple[Any, int, list[int]]] = []
        planned: list[tuple[LoadJob, list[int]]] = []
        for job in jobs:
            failed = []
            for i, chunk in enumerate(job.chunks):
                buf = self._hit_buf(job, chunk)
                view = None if buf is None or self.copier is None else self._slot_view(buf)
                if view is None:
                    failed.append(i)
                else:
                    chunks.append((view, chunk.first, chunk.block_ids))
            planned.append((job, failed))
        loads = LayerLoads()  # nothing issued: nothing for the forward to wait for
        try:
            if chunks:
                assert self.copier is not None
                loads = self.copier.load_layers(chunks)
        except Exception as exc:  # nothing was issued: all of it is a miss, recomputed
            faults.caught(exc, "issuing loads")
            log.warning("kvtier: load copy failed: %s", exc)
            planned = [(job, list(range(len(job.chunks)))) for job, _ in planned]
            chunks = []
        waited = set() if chunks else set(self._all_layers)
        self._step_loads = StepLoads(loads, planned, started, waited)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this step's loads of the layer are in place (CUDA: ordered on the stream)."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if self._in_forward:
            self._waits_now.add(layer)
        step = self._step_loads
        if step is not None:
            step.loads.wait_layer(layer)
            step.waited.add(layer)

    def _end_forward(self) -> None:
        """The step's first finish point: the layers waited for so far are the forward's. A drafter's
        layers wait later in the step (vLLM asks for load errors before it runs the drafter), read
        loads that were finished by then, and so are never taken for layers the forward skipped."""
        if self._in_forward:
            self._in_forward = False
            self._forward_layers |= self._waits_now

    def _finish_loads(self) -> None:
        """Wait for the step's layer-by-layer loads, check the forward waited for every layer,
        then count them, report failed blocks and release their leases."""
        step, self._step_loads = self._step_loads, None
        if step is None:
            return
        error = step.loads.finish()
        if error is not None:
            log.warning("kvtier: load copy failed: %s", error)
        # Layers a forward was seen to wait for (every layer until one is seen) that this one skipped.
        unwaited = sorted((self._forward_layers or self._all_layers) - step.waited)
        if unwaited:
            names = [self.cfg.layer_names[i] for i in unwaited[:3]]
            log.warning(
                "kvtier: vLLM ran the forward without waiting for the loads of %d layers (%s...); "
                "those loads are recomputed and later loads are finished before the forward",
                len(unwaited), ", ".join(names),
            )  # fmt: skip
            self._layered = False
            self.counters.unwaited_layer_loads += 1
        for job, failed in step.jobs:
            if error is not None or unwaited:
                failed = list(range(len(job.chunks)))
            self._account_load(job, failed, step.started, step.loads.ended)
            self._release(job.lease_of(self._rank))

    def _fence(self) -> bool:
        """Wait for every copy issued so far; False when one of them failed."""
        if self.copier is None:
            return True
        try:
            self.copier.wait()
        except CopyError as exc:
            faults.caught(exc, "a copy")
            log.warning("kvtier: %s", exc)
            return False
        return True

    def _hit_buf(self, job: LoadJob, chunk: ChunkLoad) -> memoryview | None:
        """The arena bytes of a CPU-tier hit, or None when its slot is not in the mapped arena."""
        slot = chunk.slot_of(self._rank)
        if slot is None:
            return None
        return self._arena.view(job.instance_id, SlotRef(*slot))

    def _copy_in(self, buf: memoryview, first: int, block_ids: list[int]) -> bool:
        assert self.copier is not None
        view = self._slot_view(buf)
        if view is None:
            return False
        try:
            self.copier.load(view, first, block_ids)
        except Exception as exc:
            faults.caught(exc, "a layer's load")
            log.warning("kvtier: load copy failed: %s", exc)
            return False
        return True

    def _slot_view(self, buf: memoryview) -> Any:
        """The slot as the copier's tensor, or None (logged) when it cannot be one."""
        assert self.copier is not None
        try:
            return self.copier.slot_view(buf[: self.copier.chunk_bytes])
        except Exception as exc:
            faults.caught(exc, "finishing loads")
            log.warning("kvtier: load copy failed: %s", exc)
            return None

    def _account_load(
        self, job: LoadJob, failed: list[int], started: float, ended: float | None = None
    ) -> None:
        self.counters.load_seconds += (ended or time.monotonic()) - started
        bad = set(failed)
        ok = [c for i, c in enumerate(job.chunks) if i not in bad]
        self.counters.loaded_chunks += len(ok)
        self.counters.loaded_tokens += sum(len(c.block_ids) for c in ok) * self.cfg.geometry.block_size
        if failed:
            self._fail_job(job, failed)

    def _fail_job(self, job: LoadJob, failed: Any) -> None:
        blocks = {b for i in failed for b in job.chunks[i].block_ids}
        self._load_errors |= blocks
        self._failed_this_step.add(job.req_id)
        self.counters.failed_load_chunks += len(list(failed))
        self.counters.failed_load_blocks += len(blocks)

    def _finish_async(self, pending: PendingLoad) -> None:
        """Copy a finished stage's slots into the blocks, or finish a load read from disk files."""
        if pending.disk is not None:
            self._finish_direct(pending, pending.disk.result)
            return
        assert pending.future is not None
        job = pending.job
        try:
            reply = pending.future.result(timeout=0)
        except Exception as exc:
            faults.caught(exc, "a stage")
            log.debug("kvtier: stage of %s failed: %s", job.req_id, exc)
            self._fail_job(job, range(len(job.chunks)))
            self._release(job.lease_of(self._rank))
            return
        if reply.instance_id != self._arena.instance_id:
            self._refresh_arena(wait=0.0)
        failed = []
        staged = reply.result
        for i, chunk in enumerate(job.chunks):
            slot = staged.slots[chunk.index] if chunk.index < len(staged.slots) else None
            bad = chunk.index in staged.failed or slot is None
            buf = None if bad or slot is None else self._arena.view(reply.instance_id, slot)
            if buf is None or not self._copy_in(buf, chunk.first, chunk.block_ids):
                failed.append(i)
        if not self._fence():
            failed = list(range(len(job.chunks)))
        self._account_load(job, failed, pending.started)
        self._release(job.lease_of(self._rank))

    def _finish_direct(self, pending: PendingLoad, result: DiskReadResult) -> None:
        """After a load's file reads: copy its CPU-tier chunks from their slots, tell the service
        what was read, account and release."""
        job = pending.job
        failed = list(result.failed)
        for i, chunk in enumerate(job.chunks):
            if chunk.slot_of(self._rank) is not None:
                buf = self._hit_buf(job, chunk)
                if buf is None or not self._copy_in(buf, chunk.first, chunk.block_ids):
                    failed.append(i)
        if not self._fence():
            failed = list(range(len(job.chunks)))
        self.counters.disk_read_chunks += len(result.read)
        if (result.read or result.corrupt) and self.client is not None:
            self.client.disk_reads(self.cfg.namespace, result.read, result.nbytes, result.corrupt)
        self._account_load(job, sorted(set(failed)), pending.started)
        self._release(job.lease_of(self._rank))

    def wait_for_save(self) -> None:
        """Hand this step's finished chunks to the copier, to be copied into their reserved slots and
        committed (after this returns when the copier defers saves)."""
        self._end_forward()
        self._finish_loads()  # before planning: nothing computed on a failed load is saved
        reserves, self._reserves = self._reserves, []
        deadline = time.monotonic() + self._save_wait
        batch: list[SavedJob] = []
        chunks: list[tuple[Any, list[int]]] = []
        for job, future in reserves:
            try:
                reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                future.add_done_callback(self._abort_late)
                self.counters.save_skipped_chunks += len(job.hashes)
                self._save_wait = SAVE_PROBE_S
                continue
            except Exception as exc:
                faults.caught(exc, "a reserve")
                self.counters.save_errors += 1
                continue
            self._save_wait = SAVE_WAIT_S
            saved = self._plan_save(job, reply, chunks)
            if saved.slots:
                batch.append(saved)
        if batch:
            assert self.copier is not None
            self._saves_issued += 1
            started = time.monotonic()
            try:
                self.copier.save_batch(chunks, lambda error: self._saved(batch, started, error))
            except Exception as exc:  # the copy thread refused it (closed): nothing was copied
                faults.caught(exc, "issuing saves")
                self._saved(batch, started, exc)
        # Requests held from this step's metadata go once everything issued up to now has ended;
        # not in get_finished alone, which vLLM may call before wait_for_save (defer_finalize).
        for req_id in self._held_now:
            self._held[req_id] = self._saves_issued
        self._held_now = set()

    def _plan_save(self, job: SaveJob, reply: ReserveReply, chunks: list[tuple[Any, list[int]]]) -> SavedJob:
        """Add job's chunk copies to chunks; the chunks to commit once they are done."""
        assert self.client is not None and self.copier is not None
        # Nothing computed on a failed load is stored, by any request: vLLM shares a sync load's
        # blocks with requests admitted in the same step before the load has landed.
        skip = bool(self._failed_this_step)
        saved = SavedJob([], [], reply.instance_id)
        unused = []
        for i, (h, ids, slot) in enumerate(zip(job.hashes, job.block_ids, reply.slots, strict=True)):
            if slot is None:
                self.counters.save_skipped_chunks += 1
                continue
            buf = None if skip else self._arena.view(reply.instance_id, slot)
            if buf is None:
                unused.append(slot)
                continue
            try:
                view = self.copier.slot_view(buf[: self.copier.chunk_bytes])
            except Exception as exc:
                faults.caught(exc, "planning a save")
                log.warning("kvtier: save copy failed: %s", exc)
                unused.append(slot)
                continue
            chunks.append((view, ids))
            saved.hashes.append(h)
            saved.slots.append(slot)
            if job.block_hashes:
                saved.block_hashes.append(job.block_hashes[i])
        if unused:
            self.client.abort(unused, reply.instance_id)
        return saved

    def _saved(self, batch: list[SavedJob], started: float, error: BaseException | None) -> None:
        """A save batch's copies ended (copy thread, or the worker thread): commit or give back."""
        assert self.client is not None
        try:
            for job in batch:
                if error is not None:  # which chunk broke is unknown: store none of them
                    self.client.abort(job.slots, job.instance_id)
                    continue
                args = (self.cfg.namespace, job.hashes, job.slots, job.instance_id)
                if job.block_hashes:  # for KV events; a stand-in client may not take them
                    commit = self.client.commit(*args, block_hashes=job.block_hashes)
                else:
                    commit = self.client.commit(*args)
                commit.add_done_callback(self._count_late_error)
        finally:
            chunks = 0 if error is not None else sum(len(job.slots) for job in batch)
            with self._lock:
                counters = self.counters
                counters.saved_chunks += chunks
                counters.saved_tokens += chunks * self.cfg.geometry.chunk_size
                counters.save_errors += error is not None
                counters.save_seconds += time.monotonic() - started
                self._saves_done += 1
        if error is not None:
            faults.caught(error, "a save copy")
            log.warning("kvtier: save copy failed: %s", error)

    def _abort_late(self, future: Call[ReserveReply]) -> None:
        # A reserve answered after we gave up: hand its slots back so none leak.
        try:
            reply = future.result()
        except Exception:
            return
        # The service answers again: wait for the next step's reserves as usual instead of skipping
        # saves until one happens to be answered within no wait at all.
        self._save_wait = SAVE_WAIT_S
        slots = [s for s in reply.slots if s is not None]
        if slots and self.client is not None:
            self.client.abort(slots, reply.instance_id)

    def _count_late_error(self, future: Call[Any]) -> None:
        if future.exception() is not None:
            with self._lock:
                self._late_errors += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose held blocks are free to go, and async loads that completed."""
        self._end_forward()
        self._finish_loads()
        for req_id, pending in list(self._async.items()):
            if pending.ready():
                del self._async[req_id]
                self._finish_async(pending)
                self._finished_recving.add(req_id)
        recving, self._finished_recving = self._finished_recving, set()
        sending: set[str] = set()
        if self._held:
            done = self._saves_done  # one int read: no lock needed
            sending = {req_id for req_id, after in self._held.items() if after <= done}
            for req_id in sending:
                del self._held[req_id]
        return sending, recving

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call."""
        self._end_forward()
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _release(self, lease_id: str) -> None:
        if self.client is not None and lease_id:
            self.client.release(lease_id)

    def stats(self) -> dict[str, Any]:
        """Counters since the last call (reset on read)."""
        with self._lock:
            data = self.counters.take()
            data["save_errors"] += self._late_errors
            self._late_errors = 0
        self.totals = merge_counts(self.totals, data)
        return data

    def shutdown(self) -> None:
        """Finish copies and reads, and unmap the arena."""
        self._finish_loads()
        for pending in self._async.values():
            if pending.disk is not None:
                pending.disk.close()
        if self._disk is not None:
            self._disk.close()
        if self.copier is not None:
            self._fence()
            self.copier.close()
        self._arena.shutdown()
