"""How the embedded service lives outside vLLM's process tree yet still ends with its engine.

The service detaches from the process the engine spawns (vLLM SIGKILLs its processes' descendants)
and watches that process through a pidfd (``ParentWatch``), so a recycled pid is never taken for it.
Design: docs/internals.md#embedded-mode-embeddedpy-daemonpy
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_SIGNAL = signal.SIGUSR1  # without pidfds: sent by the kernel when the spawning thread dies
READY = b"\x01"


class ParentWatch:
    """Tells whether the engine process that spawned this service has exited."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = -1
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self.fd = os.pidfd_open(pid)
        # Checked after opening: while pid is still our parent, the pidfd names that very process.
        self._gone_at_start = os.getppid() != pid
        if self.fd < 0:
            set_parent_death_signal()

    @property
    def can_detach(self) -> bool:
        """True when the watch keeps working after this process leaves its parent (a pidfd)."""
        return self.fd >= 0

    def gone(self) -> bool:
        """True once the spawning process has exited."""
        if self._gone_at_start:
            return True
        if self.fd >= 0:
            readable, _, _ = select.select([self.fd], [], [], 0)  # a pidfd turns readable at exit
            return bool(readable)
        return os.getppid() != self.pid  # re-parented once it exits

    def close(self) -> None:
        """Close the pidfd (idempotent)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def set_parent_death_signal(sig: int = PARENT_SIGNAL) -> bool:
    """Ask Linux to signal us when the spawning thread dies; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def detach() -> int:
    """Fork; returns, in the child only, the fd to write READY to once it serves.

    The calling process waits for that and exits 0, or with the child's exit status if the child
    ended first. Call before any thread exists.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        with contextlib.suppress(OSError):
            if os.read(read_end, 1) == READY:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) or 1)
    os.close(read_end)
    return write_end


def report_ready(fd: int) -> None:
    """Tell the waiting parent of detach() that the service serves (no-op for fd < 0)."""
    if fd < 0:
        return
    with contextlib.suppress(OSError):
        os.write(fd, READY)
    os.close(fd)
