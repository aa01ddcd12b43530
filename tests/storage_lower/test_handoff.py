"""IOThreads: outcomes reach every waiter, the hook runs first, and a cancelled waiter holds on until
the call has ended (the thread may still be using the caller's buffer)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from kvtier.runtime.handoff import COMPANION_MIN_BYTES, Handoff, IOThreads, Lane, TwoEnds, companion


async def test_value_error_and_hook_order() -> None:
    threads = IOThreads(2, "test-io")
    seen: list[object] = []

    def hook(value: object, error: BaseException | None) -> None:
        seen.append(("hook", value, error))

    job = threads.submit(lambda a, b: a + b, 2, 3, hook=hook)
    waiters = [asyncio.create_task(job.result()) for _ in range(3)]
    assert await asyncio.gather(*waiters) == [5, 5, 5]
    assert seen == [("hook", 5, None)] and job.done
    assert await job.result() == 5  # an ended job answers at once

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        await threads.run(fail)
    await asyncio.get_running_loop().run_in_executor(None, threads.close)


async def _turns_of_the_loop(turns: int = 20) -> None:
    """Let the loop run what is ready (a cancellation's handling) without waiting on a clock: the
    blocked call cannot end meanwhile, so a waiter still pending after this is holding on."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_cancelled_waiter_returns_only_after_the_call_ended() -> None:
    threads = IOThreads(1, "test-io", cores=2)
    started, release = threading.Event(), threading.Event()
    ended: list[bool] = []

    def blocking() -> None:
        started.set()
        release.wait(10)
        ended.append(True)

    job = threads.submit(blocking)
    waiter = asyncio.create_task(job.result())
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    waiter.cancel()
    await _turns_of_the_loop()
    assert not waiter.done() and not job.done  # still holding on: the call has not ended
    waiter.cancel()  # a second cancellation does not cut the wait short either
    await _turns_of_the_loop()
    assert not waiter.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ended == [True] and job.done
    await asyncio.get_running_loop().run_in_executor(None, threads.close)


async def test_close_runs_queued_calls_then_refuses_new_ones() -> None:
    threads = IOThreads(1, "test-io", cores=2)
    jobs = [threads.submit(lambda i=i: i) for i in range(5)]
    await asyncio.get_running_loop().run_in_executor(None, threads.close)
    assert [await job.result() for job in jobs] == list(range(5))
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit(lambda: None)


def test_companion_is_only_on_worker_threads() -> None:
    assert companion(COMPANION_MIN_BYTES) is None


async def test_each_worker_has_its_own_companion_and_close_stops_them() -> None:
    threads = IOThreads(2, "test-lanes", cores=4)
    barrier = threading.Barrier(2, timeout=10)

    def lane_of_this_worker() -> Lane | None:
        barrier.wait()  # both workers busy at once, so the two calls run on different workers
        return companion(COMPANION_MIN_BYTES)

    lanes = await asyncio.gather(*(threads.run(lane_of_this_worker) for _ in range(2)))
    assert all(lane is not None for lane in lanes) and lanes[0] is not lanes[1]

    def ours() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("test-lanes"))

    assert len(ours()) == 4  # two workers, two companions
    await asyncio.get_running_loop().run_in_executor(None, threads.close)
    assert ours() == []


async def test_no_companion_while_every_core_has_a_job() -> None:
    threads = IOThreads(3, "test-cores", cores=2)
    barrier = threading.Barrier(2, timeout=10)

    def alone() -> bool:
        return companion(COMPANION_MIN_BYTES) is not None

    def with_another() -> bool:
        barrier.wait()  # two jobs running at once on a pool of two cores
        spare = companion(COMPANION_MIN_BYTES) is not None
        barrier.wait()  # neither ends (and frees its core) before both have asked
        return spare

    assert await threads.run(alone)
    assert await asyncio.gather(*(threads.run(with_another) for _ in range(2))) == [False, False]
    assert await threads.run(alone)  # the count went back down
    await asyncio.get_running_loop().run_in_executor(None, threads.close)


def test_two_ends_hand_out_every_index_once() -> None:
    ends = TwoEnds(5)
    assert [ends.front(), ends.back(), ends.back(), ends.front(), ends.front()] == [0, 4, 3, 1, 2]
    assert ends.front() is None and ends.back() is None
    closed = TwoEnds(3)
    assert closed.back() == 2
    closed.close()
    assert closed.front() is None and closed.back() is None
    assert TwoEnds(0).front() is None


def test_two_ends_split_between_threads_take_each_index_once() -> None:
    ends = TwoEnds(20_000)
    taken: list[list[int]] = [[], []]

    def take(side: int) -> None:
        get = ends.front if side == 0 else ends.back
        while (i := get()) is not None:
            taken[side].append(i)

    threads = [threading.Thread(target=take, args=(side,)) for side in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken[0] + taken[1]) == list(range(20_000))
    assert taken[0] == sorted(taken[0]) and taken[1] == sorted(taken[1], reverse=True)


async def test_handoff_runs_on_the_companion_and_returns_its_value() -> None:
    threads = IOThreads(1, "test-io", cores=2)

    def job() -> tuple[str, str]:
        started = threading.Event()

        def on_companion() -> str:
            started.set()
            return threading.current_thread().name

        handoff = Handoff(on_companion).offer(companion(COMPANION_MIN_BYTES))
        try:
            started.wait(10)  # let the companion take it before asking
            return threading.current_thread().name, handoff.result()
        finally:
            handoff.settle()

    worker, ran_on = await threads.run(job)
    assert ran_on == f"{worker}-companion"
    await asyncio.get_running_loop().run_in_executor(None, threads.close)


async def test_handoff_the_companion_has_not_started_runs_in_the_worker_once() -> None:
    threads = IOThreads(1, "test-io", cores=2)
    release = threading.Event()
    calls: list[str] = []

    def job() -> str:
        lane = companion(COMPANION_MIN_BYTES)
        busy = Handoff(release.wait, 10).offer(lane)  # keeps the companion busy
        late = Handoff(lambda: calls.append(threading.current_thread().name) or "ran").offer(lane)
        try:
            return late.result()  # the companion is busy: the worker runs it itself
        finally:
            late.settle()
            release.set()
            busy.settle()

    assert await threads.run(job) == "ran"
    await asyncio.get_running_loop().run_in_executor(None, threads.close)  # runs the queued help
    assert calls == ["test-io-0"]  # never run a second time by the companion


async def test_handoff_error_reaches_the_worker() -> None:
    threads = IOThreads(1, "test-io", cores=2)

    def job() -> None:
        started = threading.Event()

        def fail() -> None:
            started.set()
            raise OSError(5, "Input/output error")

        handoff = Handoff(fail).offer(companion(COMPANION_MIN_BYTES))
        try:
            started.wait(10)
            handoff.result()
        finally:
            handoff.settle()

    with pytest.raises(OSError, match="Input/output"):
        await threads.run(job)
    await asyncio.get_running_loop().run_in_executor(None, threads.close)


async def test_cancelled_waiter_holds_on_until_the_companion_call_ended() -> None:
    """A job settles its Handoff, so cancelling its waiter cannot free a buffer the companion uses."""
    threads = IOThreads(1, "test-io", cores=2)
    started, release = threading.Event(), threading.Event()
    ended: list[str] = []

    def on_companion() -> None:
        started.set()
        release.wait(10)
        ended.append("companion")

    def job() -> None:
        handoff = Handoff(on_companion).offer(companion(COMPANION_MIN_BYTES))
        try:
            started.wait(10)
            raise RuntimeError("the worker's half failed")  # the companion is still running
        finally:
            handoff.settle()

    waiter = asyncio.create_task(threads.run(job))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    waiter.cancel()
    await _turns_of_the_loop()
    assert not waiter.done()  # the companion still uses the buffer: the waiter holds on
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ended == ["companion"]
    await asyncio.get_running_loop().run_in_executor(None, threads.close)


def test_handoff_without_companion_runs_in_the_caller() -> None:
    handoff = Handoff(lambda a, b: a * b, 6, 7).offer(None)
    assert handoff.result() == 42
    handoff.settle()


async def test_idle_threads_and_their_companions_run_only_on_cpu_time_nothing_else_wants() -> None:
    def policies() -> tuple[int, int]:
        lane = companion(COMPANION_MIN_BYTES)
        assert lane is not None
        on_lane: list[int] = []
        done = threading.Event()
        lane.put(lambda: (on_lane.append(os.sched_getscheduler(0)), done.set()))
        assert done.wait(10)
        return os.sched_getscheduler(0), on_lane[0]

    idle, normal = IOThreads(1, "test-idle", cores=2, idle=True), IOThreads(1, "test-normal", cores=2)
    assert await idle.run(policies) == (os.SCHED_IDLE, os.SCHED_IDLE)
    assert await normal.run(policies) == (os.SCHED_OTHER, os.SCHED_OTHER)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own policy is untouched
    for pool in (idle, normal):
        await asyncio.get_running_loop().run_in_executor(None, pool.close)
