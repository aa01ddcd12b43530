"""Where the benchmarks and the demo keep the service's arena: a private directory on tmpfs, as in
production (``shm_dir`` defaults to /dev/shm).

An arena on a disk-backed filesystem is a shared file mapping: prefaulting it dirties every page,
and the kernel writes them all back to disk about 30 s later (vm.dirty_expire_centisecs), in the
middle of whatever is being timed then; every save dirties its pages again. Only where no tmpfs
with room is at hand does the arena go to the fallback directory, and the run says so.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvtier.app.settings import KVTierSettings
from kvtier.runtime.mounts import MEMORY_FILESYSTEMS, filesystem_type, free_bytes

SHM_DIR = Path(KVTierSettings.model_fields["shm_dir"].default)
MARGIN_BYTES = 64 << 20  # room left for the other tenants of the tmpfs


def tmpfs_room(path: Path) -> int:
    """Free bytes at path when a filesystem in memory (tmpfs) holds it; 0 otherwise."""
    if filesystem_type(path) not in MEMORY_FILESYSTEMS:
        return 0
    try:
        return free_bytes(path)
    except OSError:
        return 0


@contextlib.contextmanager
def arena_dir(fallback: Path, size: int) -> Iterator[Path]:
    """A fresh directory under /dev/shm for an arena of size bytes, removed on exit; fallback when
    /dev/shm is not a tmpfs with that much room (with a note on stderr)."""
    if tmpfs_room(SHM_DIR) >= size + MARGIN_BYTES:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=SHM_DIR) as tmp:
            yield Path(tmp)
        return
    print(
        f"note: {SHM_DIR} is not a tmpfs with {size >> 20} MiB free: the arena goes to {fallback}, "
        "where the kernel's write-back of its pages may show in the timings",
        file=sys.stderr,
        flush=True,
    )
    fallback.mkdir(parents=True, exist_ok=True)
    yield fallback
