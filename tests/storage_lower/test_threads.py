"""IOThreads: outcomes reach every waiter, the hook runs first, and a cancelled waiter holds on until
the call has ended (the thread may still be using the caller's buffer)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from storage.tiers.threads import IOThreads


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


async def test_cancelled_waiter_returns_only_after_the_call_ended() -> None:
    threads = IOThreads(1, "test-io")
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
    await asyncio.sleep(0.05)
    assert not waiter.done()  # still holding on: the call has not ended
    waiter.cancel()  # a second cancellation does not cut the wait short either
    await asyncio.sleep(0.01)
    assert not waiter.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ended == [True] and job.done
    await asyncio.get_running_loop().run_in_executor(None, threads.close)


async def test_close_runs_queued_calls_then_refuses_new_ones() -> None:
    threads = IOThreads(1, "test-io")
    jobs = [threads.submit(lambda i=i: i) for i in range(5)]
    await asyncio.get_running_loop().run_in_executor(None, threads.close)
    assert [await job.result() for job in jobs] == list(range(5))
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit(lambda: None)
