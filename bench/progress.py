"""Progress lines of the long commands (`make demo`, `make bench`): one flushed line per event.

They go to stderr, so stdout keeps only the results (tables, where the files went), and each carries
the wall-clock time, so lines from different modules read in order without any shared state.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO


def note(message: str, stream: TextIO | None = None) -> None:
    """Print one progress line, stamped with the time of day, and flush it at once."""
    out = sys.stderr if stream is None else stream
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=out, flush=True)


@contextlib.contextmanager
def step(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """Say `what ...` now, then `what: done in N s` (or `failed after N s`) when the block ends."""
    start = time.monotonic()
    note(f"{what} ...", stream)
    try:
        yield
    except BaseException:
        note(f"{what}: failed after {time.monotonic() - start:.1f} s", stream)
        raise
    note(f"{what}: done in {time.monotonic() - start:.1f} s", stream)
