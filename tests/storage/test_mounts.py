"""Which filesystem holds a path: the mount table's deepest mount above it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import kvtier.storage.arena as arena_module
from kvtier.runtime.mounts import filesystem_type, fs_type_in
from kvtier.storage.arena import Arena

TABLE = [
    ["/dev/vda", "/", "ext4", "rw", "0", "0"],
    ["tmpfs", "/dev/shm", "tmpfs", "rw", "0", "0"],
    ["tmpfs", "/dev/shm/big", "tmpfs", "rw", "0", "0"],
    ["/dev/vdb", "/mnt/my\\040disk", "xfs", "rw", "0", "0"],
    ["overlay", "/mnt/shadowed", "ext4", "rw", "0", "0"],
    ["tmpfs", "/mnt/shadowed", "tmpfs", "rw", "0", "0"],
    ["short"],
]


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        ("/", "ext4"),
        ("/tmp/x", "ext4"),
        ("/dev/shm", "tmpfs"),
        ("/dev/shm/kvtier-bench-1", "tmpfs"),
        ("/dev/shmfoo", "ext4"),  # a sibling whose name starts alike is not inside /dev/shm
        ("/dev/shm/big/x", "tmpfs"),
        ("/mnt/my disk/arena", "xfs"),  # the table writes a space as \040
        ("/mnt/shadowed/a", "tmpfs"),  # the later of two mounts on one point hides the earlier
    ],
)
def test_the_deepest_mount_above_a_path_decides(target: str, kind: str) -> None:
    assert fs_type_in(target, TABLE) == kind


def test_no_mount_above_a_path_is_unknown() -> None:
    assert fs_type_in("/x", [["tmpfs", "/dev/shm", "tmpfs"]]) == ""


def test_this_machines_table_knows_a_directory() -> None:
    assert filesystem_type(Path.cwd()) != ""
    assert filesystem_type("/proc/self") == "proc"


@pytest.mark.parametrize(("kind", "warned"), [("ext4", True), ("tmpfs", False), ("", False)])
def test_an_arena_outside_memory_is_created_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, kind: str, warned: bool
) -> None:
    monkeypatch.setattr(arena_module, "filesystem_type", lambda _path: kind)
    with caplog.at_level(logging.WARNING, logger=arena_module.log.name):
        arena = Arena.create(tmp_path, 1 << 20, prefault=False)
    try:
        assert Path(arena.path).exists()  # a warning, not a refusal
    finally:
        arena.close()
    messages = [r.getMessage() for r in caplog.records if r.name == arena_module.log.name]
    said = [m for m in messages if f"on a {kind} filesystem, not tmpfs" in m and "KVTIER_SHM_DIR" in m]
    assert bool(said) is warned
