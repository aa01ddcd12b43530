"""The copy thread runs what it is given, in order, and its fence reports failures."""

from __future__ import annotations

import threading

import pytest

from kvtier.connector.copy_thread import CopyError, CopyThread


def test_wait_returns_after_every_submitted_copy_ran_in_order() -> None:
    thread = CopyThread()
    gate = threading.Event()
    ran: list[int] = []
    thread.submit(gate.wait)
    for i in range(5):
        thread.submit(ran.append, i)
    assert ran == []  # held behind the gate: nothing ran out of order or early
    gate.set()
    thread.wait()
    assert ran == [0, 1, 2, 3, 4]
    thread.close()


def test_a_failed_copy_is_raised_once_at_the_fence_and_later_copies_still_run() -> None:
    thread = CopyThread()
    ran: list[str] = []

    def broken() -> None:
        raise ValueError("slot shape")

    thread.submit(broken)
    thread.submit(ran.append, "after")
    with pytest.raises(CopyError, match="slot shape"):
        thread.wait()
    assert ran == ["after"]
    thread.wait()  # reported once: the next fence is clean
    thread.close()


def test_close_finishes_pending_copies_and_refuses_new_ones() -> None:
    thread = CopyThread()
    ran: list[int] = []
    thread.submit(ran.append, 1)
    thread.close()
    assert ran == [1]
    with pytest.raises(CopyError, match="closed"):
        thread.submit(ran.append, 2)
    thread.close()  # twice is fine
