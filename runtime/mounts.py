"""Which filesystem holds a path (from this process's mount table, /proc/self/mounts), and its room."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

MOUNTS = "/proc/self/mounts"
# Filesystems whose pages live in memory only: an arena there is never written back to a disk.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
_ESCAPE = re.compile(r"\\([0-7]{3})")  # the mount table writes a space in a path as \040


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def fs_type_in(target: str, rows: Iterable[Sequence[str]]) -> str:
    """The type of the filesystem mounted deepest above target (an absolute, resolved path) among
    mount table rows (device, mount point, type, ...); the last of equal mount points wins, as the
    later mount hides the earlier. '' when none holds it."""
    best, kind = "", ""
    for row in rows:
        if len(row) < 3:
            continue
        mount = _unescape(row[1])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, row[2]
    return kind


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding path ('tmpfs', 'ext4', ...); '' when it cannot be told."""
    try:
        with open(MOUNTS, encoding="utf-8") as table:
            rows = [line.split() for line in table]
    except OSError:
        return ""
    return fs_type_in(os.path.realpath(path), rows)


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding path (OSError if none)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
