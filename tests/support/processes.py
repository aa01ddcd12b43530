"""Waiting for a process that is not this one's child to exit: woken by its exit, not by polling."""

from __future__ import annotations

import os
import select


def exits(pid: int, timeout: float) -> bool:
    """Whether process pid exits within timeout seconds (True at once when it is gone already).

    A pidfd becomes readable when its process exits, whoever its parent is; a zombie counts as gone.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)
