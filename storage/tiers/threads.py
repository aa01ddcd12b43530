"""Running blocking tier I/O in a thread without letting cancellation free a borrowed buffer early.

A tier's get_into writes into the caller's buffer from a worker thread. If the awaiting task were
cancelled and returned at once, the caller could reuse the buffer while the thread still writes into
it. ``run_to_end`` therefore waits for the thread to finish before the cancellation propagates; the
thread's own I/O timeouts bound that wait. It awaits the executor's future directly (no shield):
one event-loop wake-up per call, which is a measurable share of a 2 MiB transfer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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
