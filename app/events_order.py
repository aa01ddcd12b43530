"""Parents first: a self-describing ``BlockStored`` goes out after an event that named its parent.

A token-keyed router (llm-d's indexer) computes a block's key from its parent's, and drops a
``BlockStored`` whose parent it has not indexed. Commits arrive in prompt order, but the disk index's
load at a restart finds files in directory order, so a chunk may be found before the chunk it
follows. ``ParentOrder`` holds such an event back until an event names its parent, then sends it
(and, in turn, what waited on it); one that waits longer than ``wait_s`` (its parent is in no tier
of this service, and maybe on the GPU) goes out anyway, in the order it came.

Who owns what: the service's event loop owns it, through the ``EventRecorder`` that calls it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

WAIT_S = 5.0  # how long an event waits for its parent before it goes out without


@dataclass(slots=True, eq=False)  # each is itself: compared by identity
class _Parked:
    token: Hashable  # what the event announces (the recorder's tier and chunk key)
    parent: bytes
    event: Any
    hashes: Sequence[bytes]
    since: float


class ParentOrder:
    """Sends events through ``send``, each self-describing one after its parent (see the module)."""

    def __init__(
        self, send: Callable[[Any], None], wait_s: float = WAIT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._send = send
        self._wait_s = wait_s
        self._clock = clock
        self._said: dict[bytes, int] = {}  # block hashes named stored by events sent, less removals
        self._waiting: dict[bytes, list[_Parked]] = {}  # by the parent hash they wait for
        self._parked: dict[Hashable, list[_Parked]] = {}  # by token (a chunk may wait in several runs)
        self._timer: asyncio.TimerHandle | None = None

    @property
    def parked(self) -> int:
        """Events waiting for their parent."""
        return sum(map(len, self._parked.values()))

    def stored(self, token: Hashable, parent: bytes | None, event: Any, hashes: Sequence[bytes]) -> None:
        """Send a BlockStored naming hashes now, or once parent (when given) has been named."""
        if parent is None or self._said.get(parent, 0) > 0 or not self._park(token, parent, event, hashes):
            self._out(event, hashes)

    def removed(self, token: Hashable, event: Any | None, hashes: Sequence[bytes]) -> None:
        """Send a BlockRemoved (None: nothing to say); a BlockStored of token still waiting is
        dropped (it never went out)."""
        unsaid: set[bytes] = set()  # named by the dropped events only: never counted as named
        for parked in list(self._parked.get(token, ())):
            self._unpark(parked)
            unsaid.update(parked.hashes)
        for h in hashes:
            if h in unsaid:
                continue
            count = self._said.get(h, 0)
            if count > 1:
                self._said[h] = count - 1
            else:
                self._said.pop(h, None)
        if event is not None:
            self._send(event)

    def cleared(self, event: Any) -> None:
        """Send AllBlocksCleared: nothing named before counts, nothing waiting goes out."""
        self._said.clear()
        self._waiting.clear()
        self._parked.clear()
        self._send(event)

    def release_expired(self) -> None:
        """Send every event that has waited wait_s or longer, oldest first."""
        self._timer = None
        now = self._clock()
        waiting = (p for runs in self._parked.values() for p in runs)
        due = sorted((p for p in waiting if now - p.since >= self._wait_s), key=lambda p: p.since)
        for parked in due:
            if parked in self._parked.get(parked.token, ()):  # not sent meanwhile with its parent
                self._unpark(parked)
                self._out(parked.event, parked.hashes)
        self._arm()

    def _park(self, token: Hashable, parent: bytes, event: Any, hashes: Sequence[bytes]) -> bool:
        """Hold the event back; False when no loop runs to send it later (it goes out now)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        parked = _Parked(token, parent, event, hashes, self._clock())
        self._parked.setdefault(token, []).append(parked)
        self._waiting.setdefault(parent, []).append(parked)
        self._arm()
        return True

    def _arm(self) -> None:
        """Have release_expired run when the oldest waiting event is due (on the running loop)."""
        if self._timer is not None or not self._parked:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        oldest = min(p.since for runs in self._parked.values() for p in runs)
        self._timer = loop.call_later(max(0.0, oldest + self._wait_s - self._clock()), self.release_expired)

    def _unpark(self, parked: _Parked) -> None:
        runs = self._parked[parked.token]
        runs.remove(parked)
        if not runs:
            del self._parked[parked.token]
        self._waiting[parked.parent].remove(parked)
        if not self._waiting[parked.parent]:
            del self._waiting[parked.parent]

    def _out(self, event: Any, hashes: Sequence[bytes]) -> None:
        """Send event, then whatever waited on the hashes it names (depth first, in arrival order)."""
        todo = [(event, hashes)]
        while todo:
            event, hashes = todo.pop()
            self._send(event)
            freed: list[_Parked] = []
            for h in hashes:
                self._said[h] = self._said.get(h, 0) + 1
                freed.extend(self._waiting.get(h, ()))
            for parked in freed:
                self._unpark(parked)
            todo.extend((p.event, p.hashes) for p in reversed(freed))
