"""Running blocking tier I/O in threads without letting cancellation free a borrowed buffer early.

Who owns what: a Job's outcome, hook and waiters belong to the event loop that submitted it (its thread
only runs the call); a Handoff belongs to the worker that made it (its companion only runs the call).
Design: docs/internals.md#thread-hand-offs-handoffpy
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvtier.runtime.affinity import run_when_idle

T = TypeVar("T")
log = logging.getLogger("kvtier.threads")
SPIN_S = 200e-6  # the longest wait_released yields the core before it sleeps


async def run_to_end(executor: concurrent.futures.Executor, fn: Callable[..., T], *args: Any) -> T:
    """Run fn(*args) in executor; if cancelled meanwhile, wait for fn to end, then re-raise."""
    work = executor.submit(fn, *args)
    try:
        return await asyncio.wrap_future(work)
    except asyncio.CancelledError:
        # Cancelling the wrapper cancels work only if it had not started; otherwise wait it out.
        await wait_done(work)
        raise


async def wait_done(work: concurrent.futures.Future[Any]) -> None:
    """Wait until work has ended (or was cancelled before it started), whatever its outcome."""
    if not work.done():
        await wait_quietly(asyncio.wrap_future(work))


async def wait_quietly(future: asyncio.Future[Any]) -> None:
    """Wait until future is done, ignoring its outcome and any further cancellation of the waiter."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # mark the exception retrieved so asyncio does not log it


_worker = threading.local()
# Bytes of work from which a job shares it with its companion. Below it the hand-off costs more than
# it saves: waking the companion and trading the GIL with it at every step (docs/performance.md).
COMPANION_MIN_BYTES = 8 << 20


def companion(work_bytes: int) -> Lane | None:
    """The lane paired with the IOThreads worker running this code, for a job over work_bytes, if a
    core is spare for it and the job is big enough to pay for waking it.

    None on any other thread, below COMPANION_MIN_BYTES, and while the pool runs as many jobs as
    there are cores: each job then has a core of its own already, and a companion would only make
    threads take turns on them.
    """
    lane: Lane | None = getattr(_worker, "lane", None)
    pool: IOThreads | None = getattr(_worker, "pool", None)
    if pool is None or pool.running >= pool.cores or work_bytes < COMPANION_MIN_BYTES:
        return None
    return lane


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class Lane:
    """One thread running queued calls strictly in order (a worker's companion)."""

    def __init__(self, name: str, idle: bool = False) -> None:
        self._idle = idle
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def put(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue fn(*args); fn handles its own errors (one that escapes is logged and dropped)."""
        self._queue.put((fn, args))

    def _work(self) -> None:
        if self._idle:
            run_when_idle()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            del item
            try:
                fn(*args)
            except BaseException:  # a bug in fn: keep the lane alive for the calls queued after it
                log.exception("uncaught error in %s", self._thread.name)
            del fn, args  # let go of the caller's buffers before waiting for the next call

    def close(self) -> None:
        """Run what is queued, then stop the thread (blocks)."""
        self._queue.put(None)
        self._thread.join()


class Handoff(Generic[T]):
    """One call run once, by a worker's companion or by the worker itself, whichever takes it first.

    The worker offers the call to its companion, goes on with its own half of the job, then asks for
    the result: if the companion has not started yet (its core is busy), the worker runs the call
    itself rather than wait; if it has, the worker waits for it to end. ``settle`` (in a ``finally``)
    makes sure the companion will not start it any more and has ended: the call may use the caller's
    buffer, and the job must not end while it does.
    """

    __slots__ = ("_call", "_claim", "_error", "_running", "_value")

    def __init__(self, fn: Callable[..., T], *args: Any) -> None:
        self._call: tuple[Callable[..., T], tuple[Any, ...]] | None = (fn, args)
        self._claim = threading.Lock()  # whoever takes it runs the call
        self._running = threading.Lock()  # held by the companion from its start to the call's end
        self._value: T | None = None
        self._error: BaseException | None = None

    def offer(self, lane: Lane | None) -> Handoff[T]:
        """Queue the call on lane (the worker's companion); without one the worker runs it later."""
        if lane is not None:
            lane.put(self._help)
        return self

    def _help(self) -> None:
        with self._running:
            if not self._claim.acquire(blocking=False):
                return  # the worker took it (and may have let go of the call already)
            try:
                self._value = self._run()
            except BaseException as exc:  # raised to the worker by result()
                self._error = exc

    def _run(self) -> T:
        assert self._call is not None  # only the claim's holder runs it, before settle()
        fn, args = self._call
        return fn(*args)

    def result(self) -> T:
        """The call's value: run here if the companion has not taken it, else wait for its end."""
        if self._claim.acquire(blocking=False):
            return self._run()
        wait_released(self._running)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def settle(self) -> None:
        """Return once the companion will not run the call any more and is not running it."""
        if not self._claim.acquire(blocking=False):
            wait_released(self._running)
        self._call = None  # let go of the caller's buffer, even while the lane still holds this


class TwoEnds:
    """Indices 0..count-1 handed out once each, from the front to one thread and the back to another.

    A worker and its companion split a job this way without deciding the split beforehand: whoever
    starts late or runs slow simply takes fewer.
    """

    __slots__ = ("_back", "_front", "_lock")

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()
        self._front = 0
        self._back = count

    def front(self) -> int | None:
        """The lowest index not yet taken; None when all are."""
        with self._lock:
            if self._front >= self._back:
                return None
            self._front += 1
            return self._front - 1

    def back(self) -> int | None:
        """The highest index not yet taken; None when all are."""
        with self._lock:
            if self._front >= self._back:
                return None
            self._back -= 1
            return self._back

    def close(self) -> None:
        """Hand out nothing more."""
        with self._lock:
            self._back = self._front


def wait_released(lock: threading.Lock) -> None:
    """Wait until another thread releases lock, yielding the core for a while before sleeping.

    A thread that sleeps is woken by an inter-processor interrupt once its core has gone idle, which
    can take longer than much of what it waits for (docs/performance.md). Yielding (the GIL too)
    keeps the core busy and lets the thread it waits for, or another, run.
    """
    deadline = time.perf_counter() + SPIN_S
    while lock.locked() and time.perf_counter() < deadline:
        os.sched_yield()
    with lock:
        pass


# Called on the loop with (value, error) when a job's call has ended, before its waiters wake.
DoneHook = Callable[[Any, BaseException | None], None]


class Job(Generic[T]):
    """One call handed to IOThreads: settled on its loop, awaited by any number of tasks."""

    __slots__ = ("_args", "_done", "_error", "_fn", "_hook", "_loop", "_value", "_waiters")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        hook: DoneHook | None,
    ) -> None:
        self._loop = loop
        self._fn: Callable[..., T] | None = fn
        self._args: tuple[Any, ...] = args
        self._hook = hook
        self._done = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def done(self) -> bool:
        """Whether the call has ended and its outcome reached the loop."""
        return self._done

    def execute(self, ended: Callable[[], None] | None = None) -> None:
        """Run the call (in a worker thread), then ended(), then post its outcome to the loop."""
        fn, args = self._fn, self._args
        self._fn, self._args = None, ()  # let go of the caller's buffers as soon as the call ends
        value: Any = None
        error: BaseException | None = None
        try:
            value = fn(*args) if fn is not None else None
        except BaseException as exc:  # handed to the waiters, who decide what it means
            error = exc
        del fn, args
        if ended is not None:
            ended()  # before the loop hears of it: what the loop does next sees the call over
        try:
            self._loop.call_soon_threadsafe(self._settle, value, error)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    def _settle(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error, self._done = value, error, True
        try:
            if self._hook is not None:
                self._hook(value, error)
        finally:
            self._hook = None
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._waiters.clear()

    async def _wait(self) -> None:
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter

    async def result(self) -> T:
        """The call's return value (or its exception); a cancelled waiter first waits for the end."""
        if not self._done:
            try:
                await self._wait()
            except asyncio.CancelledError:
                await self.ended()  # the thread may still use the caller's buffer
                raise
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def ended(self) -> None:
        """Wait until the call has ended, whatever its outcome, ignoring cancellation meanwhile."""
        while not self._done:
            try:
                await self._wait()
            except asyncio.CancelledError:
                continue


class IOThreads:
    """A fixed set of threads (started on first use) running blocking calls for an event loop; with
    idle, they (and their companions) run only on CPU time nothing else wants: for work that can wait."""

    def __init__(self, threads: int, name: str, cores: int | None = None, *, idle: bool = False) -> None:
        self._size = threads
        self._idle = idle
        self.cores = cores or usable_cores()  # the cores its jobs share (companions included)
        self._name = name
        self._queue: queue.SimpleQueue[Job[Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lanes: list[Lane] = []
        self._closed = False
        self._count = threading.Lock()
        self.running = 0  # jobs being executed now

    def submit(self, fn: Callable[..., T], *args: Any, hook: DoneHook | None = None) -> Job[T]:
        """Queue fn(*args); hook(value, error) runs on the loop when it ends, before any waiter wakes."""
        if self._closed:
            raise RuntimeError(f"{self._name} threads are closed")
        if not self._threads:
            self._start()
        job = Job(asyncio.get_running_loop(), fn, args, hook)
        self._queue.put(job)
        return job

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) in a thread; if cancelled meanwhile, wait for it to end, then re-raise."""
        return await self.submit(fn, *args).result()

    def _start(self) -> None:
        for i in range(self._size):
            lane = Lane(f"{self._name}-{i}-companion", self._idle)
            self._lanes.append(lane)
            # Daemon threads, so a tier that was never closed cannot hang interpreter exit.
            thread = threading.Thread(target=self._work, args=(lane,), name=f"{self._name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self, lane: Lane) -> None:
        if self._idle:
            run_when_idle()
        _worker.lane, _worker.pool = lane, self
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._count:
                self.running += 1
            job.execute(self._ended)

    def _ended(self) -> None:
        with self._count:
            self.running -= 1

    def close(self) -> None:
        """Refuse new calls, let the queued ones finish, then stop the threads (blocks)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        for lane in self._lanes:  # after the workers: a job may hand calls to its lane until it ends
            lane.close()
        self._lanes.clear()
