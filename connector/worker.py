"""Worker-side connector: copies KV blocks between vLLM's cache and arena slots, reports completions.

Who owns what: vLLM's worker thread owns this object and every copy. The service client's thread only
completes futures; results are consumed here, on the worker thread, when vLLM polls.
Design: docs/internals.md#worker-side-workerpy-worker_savespy-worker_arenapy
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from kvtier.app.client import Call, HelloReply, ServiceClient, ServiceError
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
from kvtier.connector.group_copy import GroupedCopier, build_copier, copiers_of
from kvtier.connector.metadata import ChunkLoad, KVTierMetadata, KVTierWorkerMeta, LoadJob
from kvtier.connector.stats import PinState, WorkerCounters, merge_counts
from kvtier.connector.worker_arena import WorkerArena
from kvtier.connector.worker_jobs import PendingLoad, StepLoads, layers_wait_in_forward
from kvtier.connector.worker_saves import Saves
from kvtier.runtime.affinity import engine_cpus
from kvtier.storage.base import SlotRef

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

HELLO_WAIT_S = 5.0
# How long a step that computes nothing waits for a stage's reply before it lets vLLM step again:
# what a new request arriving meanwhile may wait (vLLM's own loop sleeps 1 ms on such steps).
IDLE_WAIT_S = 0.002


class WorkerSide:
    """The worker role of KVTierConnector."""

    def __init__(self, cfg: ConnectorConfig, client: ServiceClient | None) -> None:
        self.cfg = cfg
        self.client = client
        self.counters = WorkerCounters()
        self.totals: dict[str, Any] = {}
        # One BlockCopier over every layer, or one per KV cache group (hybrid engines).
        self.copier: BlockCopier | GroupedCopier | None = None
        self._arena = WorkerArena(engine_cpus(), None)
        # Guards the counters and the saves' ends, written from client callbacks and from the copy
        # thread when a deferred save ends.
        self._lock = threading.Lock()
        windowed = [r is not None for r in cfg.group_reach]
        chunk = cfg.geometry.chunk_size
        self._saves = Saves(client, cfg.namespace, chunk, windowed, self.counters, self._lock)
        self._async: dict[str, PendingLoad] = {}
        self._idle_step = False  # the bound step computes nothing (KVTierMetadata.idle)
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # hybrid engines: failed async loads, reported whole
        self._failed_this_step: set[str] = set()
        self._finished_recving: set[str] = set()
        self._hello: Call[HelloReply] | None = None
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
        self._step = 0  # the scheduler side's number of the step bound last
        self._kv_caches: dict[str, Any] = {}  # as registered: restore_kv_caches may hand none
        self._pin_state = PinState()
        if client is not None:
            self._hello = client.hello(cfg.spec)

    # ---------------------------------------------------------------------------------- setup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Build the block copier over the layers, in the order of vLLM's KV cache groups."""
        names, sizes = self.cfg.layer_names, self.cfg.group_sizes or (len(self.cfg.layer_names),)
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        groups = [[kv_caches[n] for n in names[i : i + size]] for i, size in zip(starts, sizes, strict=True)]
        bpc = self.cfg.geometry.blocks_per_chunk
        copier = build_copier(groups, self.cfg.num_blocks, bpc, engine_cpus())
        self._kv_caches = kv_caches
        # The spec's page is vLLM's unpadded one (config.real_page_bytes): what the views hold.
        pages = sorted({c.layout.page_bytes for c in copiers_of(copier)})
        if pages != [self.cfg.spec.page_bytes]:
            copier.close()
            raise ValueError(f"KV pages are {pages} bytes, vLLM's spec says {self.cfg.spec.page_bytes}")
        self.copier = copier
        if copier.device.type == "cuda":
            self._arena.shutdown()
            self._arena = WorkerArena(engine_cpus(), copier.device, copier.chunk_bytes)
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
                # A hello still in flight is polled again next step: said once, at start-up only.
                if wait > 0 or hello.done():
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
        # A hybrid engine's chunk is read by the service: the reader fills one group's blocks.
        planes = copier.host_planes if isinstance(copier, BlockCopier) else None
        if self._disk is not None or not reply.files or planes is None or self.client is None:
            return
        assert isinstance(copier, BlockCopier)
        path = file_channel_of(self.cfg.settings.disk_direct_reads, self.client.url, self.cfg.spec.kv_layout)
        if path:
            files = FileClient(path, self.cfg.settings.auth_token, timeout=CHANNEL_TIMEOUT_S)
            bpc = self.cfg.geometry.blocks_per_chunk
            self._disk = DiskReader(files, self.cfg.namespace, planes, bpc, copier.run_all)

    @property
    def ready(self) -> bool:
        """True when copies can run: KV caches registered and an arena mapped (and pinned, on CUDA)."""
        return self.copier is not None and self._arena.usable

    @property
    def arena_pinned(self) -> bool | None:
        """Whether the CUDA arena serves pinned for DMA; None without CUDA, or before its pinning ends."""
        if not self._arena.cuda or not self._arena.usable:
            return None
        return self._arena.pinned

    # ---------------------------------------------------------------------------------- steps
    def bind(self, meta: KVTierMetadata) -> None:
        """Start this step's reserves early, so their answers are in by wait_for_save."""
        self._finish_loads()  # the last step's, if nothing finished them (its forward raised)
        self._in_forward, self._waits_now = True, set()
        self._step = meta.step
        self._idle_step = meta.idle
        self._failed_this_step = set()
        self._saves.hold(meta.held)  # reported in get_finished whatever else happens
        if meta.generation != self.cfg.generation:
            self._regenerate(meta.generation)
        self._refresh_arena()
        if self.client is None or not self.ready or not self.cfg.saves:
            return  # a consumer stores nothing; nor does a rank whose KV another rank stores
        self._saves.reserve(meta.saves)

    def _regenerate(self, generation: str) -> None:
        """Follow the scheduler side to a new generation of namespaces (reset_cache): saves issued
        before commit into the old namespace first, then the new spec is registered."""
        self._fence()
        self.cfg = with_generation(self.cfg, generation)
        self._saves.namespace = self.cfg.namespace
        if self._disk is not None:
            self._disk.namespace = self.cfg.namespace
        if self.client is not None:
            self._hello = self.client.hello(self.cfg.spec)

    def _fence_window_reads(self, meta: KVTierMetadata) -> None:
        """Wait for saves still reading sliding-window blocks that vLLM handed out again this step
        (to a forward, a block copy or a load, which write them): vLLM frees a window's blocks while
        the request runs, so holding the request is not enough."""
        reads = self._saves.window_reads
        if not reads:
            return
        handed_out = set(meta.allocated)
        for job in meta.loads:
            handed_out.update(job.block_ids)
        if reads.reused(handed_out, self._saves.done):
            self.counters.window_fences += 1
            self._fence()
            reads.clear()

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Fence: copies reading blocks of requests preempted now, or sliding-window blocks handed out
        again, must end before vLLM writes those blocks. vLLM's V1 model runner calls this before it
        zeroes or copies any block of the step; its V2 runner calls it after queueing those writes,
        so this relies on kvtier serving no engine that has them (``config.check_block_writes``):
        under V2 the step's first writes to a reused block are its loads and its forward."""
        if meta.preempted:
            self._fence()
        else:
            self._fence_window_reads(meta)

    def start_load(self, meta: KVTierMetadata, forward_context: Any = None) -> None:
        """Start copying CPU-tier hits into their blocks; stage lower-tier hits asynchronously."""
        sync = []
        for job in meta.loads:
            if not job.is_async and not self.cfg.hybrid:
                sync.append(job)
            elif job.failed or self.client is None or not self.ready:
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
                assert isinstance(self.copier, BlockCopier)  # hybrid engines load asynchronously
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

    def finish_forward(self) -> None:
        """The target model's forward has ended (vLLM's V2 model runner, before its drafter runs):
        the layers waited for so far are the forward's, and whatever runs next on the compute
        stream (an EAGLE or MTP drafter, perhaps a full graph that waits for no layer) is ordered
        after every load of the step; the host does not block. V1 runs its drafter after the load
        report, which has finished the loads by then."""
        self._end_forward()
        step = self._step_loads
        if step is not None:
            step.loads.wait_layer(len(self._all_layers) - 1)

    def _end_forward(self) -> None:
        """The step's first finish point: the layers waited for so far are the forward's. A drafter's
        layers wait later in the step (V1 asks for load errors before it runs the drafter, V2 calls
        finish_forward), read loads that were finished or ordered by then, and so are never taken
        for layers the forward skipped."""
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

    def _copy_in(self, buf: memoryview, chunk: ChunkLoad) -> bool:
        assert self.copier is not None
        view = self._slot_view(buf)
        if view is None:
            return False
        try:
            if isinstance(self.copier, GroupedCopier):
                self.copier.load(view, chunk.group_loads())
            else:
                self.copier.load(view, chunk.first, chunk.block_ids)
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
        if failed and self.cfg.hybrid:  # vLLM recomputes a hybrid engine's failed load as a whole
            failed = list(range(len(job.chunks)))
        bad = set(failed)
        ok = [c for i, c in enumerate(job.chunks) if i not in bad]
        self.counters.loaded_chunks += len(ok)
        self.counters.loaded_tokens += sum(c.num_blocks() for c in ok) * self.cfg.geometry.block_size
        if failed:
            self._fail_job(job, failed)

    def _fail_job(self, job: LoadJob, failed: Any) -> None:
        blocks = {b for i in failed for b in job.chunks[i].all_block_ids()}
        if self.cfg.hybrid:  # vLLM maps failed blocks to requests only with one KV cache group
            self._failed_loads.add(job.req_id)
        else:
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
            if buf is None or not self._copy_in(buf, chunk):
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
                if buf is None or not self._copy_in(buf, chunk):
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
        # Nothing computed on a failed load is stored, by any request: vLLM shares a sync load's
        # blocks with requests admitted in the same step before the load has landed.
        self._saves.issue(self.copier, self._arena, bool(self._failed_this_step), self._step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose held blocks are free to go, and async loads that completed."""
        self._end_forward()
        self._finish_loads()
        if self._idle_step:
            self._idle_step = False
            self._await_stage()
        for req_id, pending in list(self._async.items()):
            if pending.ready():
                del self._async[req_id]
                self._finish_async(pending)
                self._finished_recving.add(req_id)
        recving, self._finished_recving = self._finished_recving, set()
        return self._saves.released(), recving

    def _await_stage(self) -> None:
        """On a step that computes nothing, wait up to IDLE_WAIT_S for a stage's reply, reading it
        in this thread. Else vLLM polls again at once, and while this thread polls the reply waits
        for the client's loop thread to get the GIL from it (up to a switch interval, 5 ms)."""
        stages = [p.future for p in self._async.values() if p.disk is None and p.future is not None]
        if not stages or len(stages) < len(self._async) or any(f.done() for f in stages):
            return  # a disk load advances only as it is polled; a finished stage is taken now
        with contextlib.suppress(Exception):  # not answered yet, or failed: _finish_async judges it
            stages[0].result(timeout=IDLE_WAIT_S)

    def worker_meta(self) -> KVTierWorkerMeta:
        """What the scheduler side learns after each step: the step through which saves have ended."""
        return KVTierWorkerMeta(self._saves.saved_through())

    def take_failed_loads(self) -> set[str]:
        """Requests whose async load failed since the last call (hybrid engines: vLLM recomputes them)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

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
            data["save_errors"] += self._saves.take_late_errors()
        self._pin_state.stamp(data, self.arena_pinned)
        self.totals = merge_counts(self.totals, data)
        return data

    # ---------------------------------------------------------------------------- sleep mode
    def unregister_kv_caches(self) -> None:
        """vLLM releases its KV cache (sleep mode): end every copy and read of it, fail the async
        loads still pending (reported at the next poll, so vLLM recomputes them), then stop the
        copier (its staging buffers go with it) and unpin and unmap the arena."""
        self._end_forward()
        self._finish_loads()
        for req_id, pending in self._async.items():
            if pending.disk is not None:
                pending.disk.close()
            self._fail_job(pending.job, range(len(pending.job.chunks)))
            self._release(pending.job.lease_of(self._rank))
            self._finished_recving.add(req_id)
        self._async.clear()
        if self._disk is not None:  # its planes are views of the KV cache
            self._disk.close()
            self._disk = None
        if self.copier is not None:
            self._fence()
            self.copier.close()
            self.copier = None
        self._arena.shutdown()
        self._arena = WorkerArena(engine_cpus(), None)

    def restore_kv_caches(self, kv_caches: dict[str, Any] | None = None) -> None:
        """vLLM's KV cache is back after sleep mode: build the copier over it again (the tensors
        handed over, else those registered first) and map and pin the arena again."""
        if self.client is not None and self._hello is None:
            self._hello = self.client.hello(self.cfg.spec)  # the arena was given up: ask again
        self.register_kv_caches(kv_caches or self._kv_caches)

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
