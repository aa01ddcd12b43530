"""The benchmarks keep the arena on tmpfs, as production does, and say so when they cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench import arena_dir as module
from kvtier.bench.arena_dir import arena_dir, tmpfs_room

needs_shm = pytest.mark.skipif(tmpfs_room(module.SHM_DIR) < 64 << 20, reason="no tmpfs at /dev/shm here")


@pytest.mark.parametrize(
    ("kind", "has_room"), [("ext4", False), ("overlay", False), ("", False), ("tmpfs", True)]
)
def test_only_a_tmpfs_has_room_for_the_arena(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, has_room: bool
) -> None:
    monkeypatch.setattr(module, "filesystem_type", lambda _path: kind)
    assert (tmpfs_room(tmp_path) > 0) is has_room
    assert tmpfs_room(tmp_path / "no-such-dir") == 0


@needs_shm
def test_the_arena_goes_to_a_private_directory_on_tmpfs_removed_after(tmp_path: Path) -> None:
    with arena_dir(tmp_path, 1 << 20) as shm:
        assert shm.parent == module.SHM_DIR
        assert shm.is_dir()
        (shm / "kvtier-x.arena").write_bytes(b"x")  # what a service that died would leave
    assert not shm.exists()


def test_without_room_on_tmpfs_the_arena_falls_back_and_the_run_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fallback = tmp_path / "work"
    with arena_dir(fallback, 1 << 62) as shm:  # more than any tmpfs holds
        assert shm == fallback
        assert shm.is_dir()
    err = capsys.readouterr().err
    assert str(fallback) in err
    assert "write-back" in err
