"""The worker's saves: reserves fired at bind, copies handed to the copier at wait_for_save, commits
once the copies end, and which held requests' blocks may go.

Who owns what: the worker thread calls everything here but ``_ended``, ``_abort_late`` and
``_count_late_error`` (copier's or client's threads), which touch shared state under the worker's lock.
Design: docs/internals.md#worker-side-workerpy-worker_savespy-worker_arenapy
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from kvtier.app.client import Call, ReserveReply, ServiceClient
from kvtier.connector import faults
from kvtier.connector.copy import BlockCopier
from kvtier.connector.group_copy import GroupedCopier
from kvtier.connector.metadata import SaveJob
from kvtier.connector.stats import WorkerCounters
from kvtier.connector.worker_arena import WorkerArena
from kvtier.connector.worker_jobs import SavedJob, WindowReads

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

# Bound on waiting for this step's reserve answers in wait_for_save; past it the saves are skipped.
# After one miss of the bound the worker only probes (SAVE_PROBE_S) until answers come back, in time
# or late, so a slow or frozen service costs one bounded wait, not one per step.
SAVE_WAIT_S = 0.02
SAVE_PROBE_S = 0.001


class Saves:
    """One worker's saves from reserve to commit, and the requests held until they end."""

    def __init__(
        self,
        client: ServiceClient | None,
        namespace: str,
        chunk_size: int,
        windowed: list[bool],
        counters: WorkerCounters,
        lock: threading.Lock,
    ) -> None:
        self.client = client
        self.namespace = namespace  # where commits go (the worker moves it on reset_cache, fenced)
        self._chunk_size = chunk_size
        self._windowed = windowed  # per KV cache group: a sliding window's (hybrid engines)
        self._counters = counters
        self._lock = lock  # the worker's: guards the counters, done and the late errors
        self.issued = 0  # save batches handed to the copier; they end in this order
        self.done = 0
        self.window_reads = WindowReads()
        self._late_errors = 0
        self._reserves: list[tuple[SaveJob, Call[ReserveReply]]] = []
        self._wait = SAVE_WAIT_S
        # Steps whose save batches may still run, with the batches issued through each (see
        # saved_through), and the last step whose saves were issued.
        self._steps: deque[tuple[int, int]] = deque()
        self._issued_step = 0
        self._held_now: set[str] = set()  # held from this step's metadata, until its issue()
        self._held: dict[str, int] = {}  # held request -> save batches that must end before it goes

    def reserve(self, jobs: list[SaveJob]) -> None:
        """Fire this step's reserves, so their answers are in by issue()."""
        assert self.client is not None
        for job in jobs:
            self._reserves.append((job, self.client.reserve(self.namespace, job.hashes)))

    def hold(self, req_ids: list[str]) -> None:
        """Requests whose blocks vLLM holds for us from this step: they go once the saves issued up to
        this step's issue() have ended."""
        self._held_now.update(req_ids)

    def issue(
        self, copier: BlockCopier | GroupedCopier | None, arena: WorkerArena, skip: bool, step: int
    ) -> None:
        """Hand step ``step``'s reserved chunks to the copier (``skip``: store none, a load failed)."""
        reserves, self._reserves = self._reserves, []
        deadline = time.monotonic() + self._wait
        batch: list[SavedJob] = []
        chunks: list[tuple[Any, Any]] = []
        window: set[int] = set()
        for job, future in reserves:
            try:
                reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                future.add_done_callback(self._abort_late)
                self._counters.save_skipped_chunks += len(job.hashes)
                self._wait = SAVE_PROBE_S
                continue
            except Exception as exc:
                faults.caught(exc, "a reserve")
                self._counters.save_errors += 1
                continue
            self._wait = SAVE_WAIT_S
            assert copier is not None  # reserves are fired only with a copier and a client
            saved = self._plan(job, reply, copier, arena, skip, chunks, window)
            if saved.slots:
                batch.append(saved)
        if batch:
            assert copier is not None
            self.issued += 1
            self.window_reads.add(self.issued, window)
            started = time.monotonic()
            try:
                copier.save_batch(chunks, lambda error: self._ended(batch, started, error))
            except Exception as exc:  # the copy thread refused it (closed): nothing was copied
                faults.caught(exc, "issuing saves")
                self._ended(batch, started, exc)
            self._steps.append((step, self.issued))
        self._issued_step = max(self._issued_step, step)
        # Requests held from this step's metadata go once everything issued up to now has ended;
        # not in get_finished alone, which vLLM may call before wait_for_save (defer_finalize).
        for req_id in self._held_now:
            self._held[req_id] = self.issued
        self._held_now = set()

    def _plan(
        self,
        job: SaveJob,
        reply: ReserveReply,
        copier: BlockCopier | GroupedCopier,
        arena: WorkerArena,
        skip: bool,
        chunks: list[tuple[Any, Any]],
        window: set[int],
    ) -> SavedJob:
        """Add job's chunk copies to chunks (and the sliding-window blocks they read to window);
        the chunks to commit once they are done."""
        assert self.client is not None
        saved = SavedJob([], [], reply.instance_id)
        unused = []
        for i, (h, ids, slot) in enumerate(zip(job.hashes, job.block_ids, reply.slots, strict=True)):
            if slot is None:
                self._counters.save_skipped_chunks += 1
                continue
            buf = None if skip else arena.view(reply.instance_id, slot)
            if buf is None:
                unused.append(slot)
                continue
            try:
                view = copier.slot_view(buf[: copier.chunk_bytes])
            except Exception as exc:
                faults.caught(exc, "planning a save")
                log.warning("kvtier: save copy failed: %s", exc)
                unused.append(slot)
                continue
            if isinstance(copier, GroupedCopier):
                groups = job.chunk_groups(i)
                chunks.append((view, groups))
                window.update(b for g, w in zip(groups, self._windowed, strict=True) if w for b in g)
            else:
                chunks.append((view, ids))
            saved.hashes.append(h)
            saved.slots.append(slot)
            if job.block_hashes:
                saved.block_hashes.append(job.block_hashes[i])
            if job.descriptions:
                saved.descriptions.append(job.descriptions[i])
        if unused:
            self.client.abort(unused, reply.instance_id)
        return saved

    def _ended(self, batch: list[SavedJob], started: float, error: BaseException | None) -> None:
        """A save batch's copies ended (copy thread, or the worker thread): commit or give back."""
        assert self.client is not None
        try:
            for job in batch:
                if error is not None:  # which chunk broke is unknown: store none of them
                    self.client.abort(job.slots, job.instance_id)
                    continue
                args = (self.namespace, job.hashes, job.slots, job.instance_id)
                if job.descriptions:  # for KV events; a stand-in client may not take them
                    commit = self.client.commit(
                        *args, block_hashes=job.block_hashes, descriptions=job.descriptions
                    )
                elif job.block_hashes:
                    commit = self.client.commit(*args, block_hashes=job.block_hashes)
                else:
                    commit = self.client.commit(*args)
                commit.add_done_callback(self._count_late_error)
        finally:
            chunks = 0 if error is not None else sum(len(job.slots) for job in batch)
            with self._lock:
                counters = self._counters
                counters.saved_chunks += chunks
                counters.saved_tokens += chunks * self._chunk_size
                counters.save_errors += error is not None
                counters.save_seconds += time.monotonic() - started
                self.done += 1
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
        self._wait = SAVE_WAIT_S
        slots = [s for s in reply.slots if s is not None]
        if slots and self.client is not None:
            self.client.abort(slots, reply.instance_id)

    def _count_late_error(self, future: Call[Any]) -> None:
        if future.exception() is not None:
            with self._lock:
                self._late_errors += 1

    def released(self) -> set[str]:
        """Held requests whose saves have all ended: their blocks may go."""
        if not self._held:
            return set()
        done = self.done  # one int read: no lock needed
        sending = {req_id for req_id, after in self._held.items() if after <= done}
        for req_id in sending:
            del self._held[req_id]
        return sending

    def saved_through(self) -> int:
        """The last step through which every save issued has ended (batches end in order)."""
        done = self.done  # one int read: no lock needed
        while self._steps and self._steps[0][1] <= done:
            self._steps.popleft()
        return self._steps[0][0] - 1 if self._steps else self._issued_step

    def take_late_errors(self) -> int:
        """Commits that failed after their step, since the last call (the caller holds the lock)."""
        errors, self._late_errors = self._late_errors, 0
        return errors
