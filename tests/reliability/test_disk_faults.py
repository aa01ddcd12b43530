"""Disk tier faults under a running vLLM engine: counted, never served, outputs identical.

Read-only and full disks are real filesystems, not simulated errors. Tests run as root here, where
``chmod`` stops nothing, so the service gets a private mount namespace (``unshare --mount``, plus
``--user --map-root-user`` when not root) with a tmpfs mounted at its disk_path: mounted ``ro`` the
kernel answers every create with EROFS, root or not; mounted with a tiny ``size`` it answers ENOSPC
once full. The mount lives and dies with the service process, so nothing is left mounted even if a
test is killed. Tampering (files deleted, truncated, bit-flipped behind the service's back) happens on
an ordinary directory.

vLLM's prefix cache is on: ``forget_local`` empties it before every batch that must look in kvtier,
so each of those batches asks kvtier for all three prefix chunks of every prompt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.bench.harness import generate, generate_each, kv_transfer_config, running_engine
from kvtier.storage import codec
from tests.e2e.oracle import assert_same_outputs
from tests.reliability.conftest import (
    CHUNK,
    MAX_TOKENS,
    PREFIX_TOKENS,
    Oracle,
    batch,
    clear_cpu,
    delta,
    forget_local,
    local_hits,
    record_lookups,
    sched_counts,
    wait_quiet,
    wait_stored,
    worker_counts,
)
from tests.support.skips import missing

pytestmark = pytest.mark.e2e

TEMP_PREFIX = ".tmp-"
CHUNKS_PER_PROMPT = 3


def tmpfs_wrap(mountpoint: Path, options: str) -> list[str]:
    """Command prefix: run the command in a private mount namespace with a tmpfs at mountpoint."""
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    script = 'mount -t tmpfs -o "$1" kvtier-test "$2" && shift 2 && exec "$@"'
    return ["unshare", *userns, "--mount", "--propagation", "private", "sh", "-c", script, "sh", options,
            str(mountpoint)]  # fmt: skip


@pytest.fixture(scope="module")
def can_mount_privately(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip (saying why) where this machine allows no private mount namespace with a tmpfs; fail
    instead under CI (tests.support.skips)."""
    if shutil.which("unshare") is None:
        missing("util-linux unshare is not installed")
    point = tmp_path_factory.mktemp("mnt-probe")
    result = subprocess.run(
        [*tmpfs_wrap(point, "size=64k,ro"), "true"], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        missing(f"no private tmpfs mount possible here: {result.stderr.strip()}")


def _disk(stats: dict) -> dict:
    return dict(stats["tiers"]["disk"])


def test_read_only_disk_is_counted_and_never_served(
    tiny_model: str, oracle: Oracle, services, tmp_path: Path, can_mount_privately: None
) -> None:
    groups = [12, 13, 14, 15]
    disk = tmp_path / "disk"
    disk.mkdir()
    sp = services(tmp_path / "svc", tmpfs_wrap(disk, "size=1m,ro"), disk_path=disk)
    svc = sp.start()
    cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)
    with running_engine(tiny_model, cfg) as llm:
        assert_same_outputs(oracle(batch(groups, 0)), generate(llm, batch(groups, 0), MAX_TOKENS))
        stored = wait_quiet(svc)
        clear_cpu(svc)
        forget_local(llm)
        s0, local0, hits0 = sched_counts(llm), local_hits(llm), svc.hit_tokens()
        assert_same_outputs(oracle(batch(groups, 1)), generate_each(llm, batch(groups, 1), MAX_TOKENS))
        misses = delta(sched_counts(llm), s0)
        local = local_hits(llm) - local0
        after = svc.stats()
    assert stored["tiers"]["cpu"]["stores"] == len(groups) * CHUNKS_PER_PROMPT, stored["tiers"]["cpu"]
    disk_stats = _disk(after)
    assert disk_stats["stores"] == 0 and disk_stats["chunks"] == 0, disk_stats
    assert disk_stats["errors_by_kind"].get("erofs", 0) >= len(groups) * CHUNKS_PER_PROMPT, disk_stats
    # Every prompt asked kvtier (vLLM's own cache served nothing) and found nothing anywhere.
    assert local == 0
    assert misses["lookup_count"] == len(groups) and misses["lookup_errors"] == 0, misses
    assert misses["external_tokens"] == 0, misses
    assert delta(after["hit_tokens"], hits0) == {"cpu": 0, "disk": 0, "redis": 0, "object": 0}


def test_full_disk_is_counted_and_what_fit_is_served(
    tiny_model: str, oracle: Oracle, services, tmp_path: Path, can_mount_privately: None
) -> None:
    groups = [16, 17, 18, 19]
    disk = tmp_path / "disk"
    disk.mkdir()
    # 300 KiB of tmpfs holds four 64 KiB chunk files; the other eight writes fail with ENOSPC.
    sp = services(tmp_path / "svc", tmpfs_wrap(disk, "size=300k"), disk_path=disk)
    svc = sp.start()
    seen_by_service = Path(f"/proc/{sp.pid}/root") / disk.relative_to("/")
    cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)
    with running_engine(tiny_model, cfg) as llm:
        assert_same_outputs(oracle(batch(groups, 0)), generate(llm, batch(groups, 0), MAX_TOKENS))
        wait_quiet(svc)
        full = _disk(svc.stats())
        files = [p for p in seen_by_service.rglob("*") if p.is_file()]
        clear_cpu(svc)
        forget_local(llm)
        s0, w0, hits0, local0 = sched_counts(llm), worker_counts(), svc.hit_tokens(), local_hits(llm)
        looked_up = record_lookups(llm)
        assert_same_outputs(oracle(batch(groups, 1)), generate_each(llm, batch(groups, 1), MAX_TOKENS))
        loads = delta(worker_counts(), w0)
        hits = delta(svc.hit_tokens(), hits0)
        lookups = delta(sched_counts(llm), s0)
        local = local_hits(llm) - local0
    assert full["errors_by_kind"].get("enospc", 0) >= 1, full
    assert 1 <= full["stores"] < len(groups) * CHUNKS_PER_PROMPT, full
    # A failed write leaves no partial or temporary file: exactly the chunks stored are on disk.
    assert not [p for p in files if p.name.startswith(TEMP_PREFIX)], files
    assert len(files) == full["chunks"] == full["stores"], (files, full)
    # A file is named by its chunk's hash: each prompt loads the chunks of its prefix on disk, up to
    # the first one that did not fit; vLLM's own cache serves nothing.
    on_disk = {p.stem for p in files}
    # A prompt vLLM could not admit at once (the blocks of the one before still held by its saves)
    # is looked up again when vLLM asks again: the service counts the hits of every lookup, vLLM
    # admits each prompt once.
    prompts = {hashes[0]: hashes for hashes in looked_up}
    assert len(prompts) == len(groups), looked_up
    served = sum(_leading(hashes, on_disk) for hashes in prompts.values()) * CHUNK
    answered = sum(_leading(hashes, on_disk) for hashes in looked_up) * CHUNK
    assert served >= CHUNK, f"none of the chunks that fit is the first of its prefix: {on_disk}"
    assert local == 0
    assert hits == {"cpu": 0, "disk": answered, "redis": 0, "object": 0}, hits
    assert lookups["external_tokens"] == served, lookups
    assert loads["loaded_tokens"] == served and loads["failed_load_chunks"] == 0, loads


def _leading(hashes: list[bytes], stored: set[str]) -> int:
    """How many of a prompt's chunks, from its first, are stored."""
    return next((i for i, h in enumerate(hashes) if h.hex() not in stored), len(hashes))


def _flip(path: Path, offset: int) -> None:
    """Flip the lowest bit of the file's byte at offset."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _middle_of_payload(path: Path) -> int:
    """The offset of the payload's middle byte: after the header, well before the trailer (which a
    load never reads, so a flip there would not be a fault of the KV)."""
    data = path.read_bytes()
    header = codec.parse_header(data)
    start = len(data) - header.trailer_len - header.payload_len
    return start + header.payload_len // 2


def test_tampered_chunk_files_are_counted_never_served(
    tiny_model: str, oracle: Oracle, services, tmp_path: Path
) -> None:
    groups = [20, 21, 22, 23]
    disk = tmp_path / "disk"
    sp = services(tmp_path / "svc", disk_path=disk)
    svc = sp.start()
    cfg = kv_transfer_config(service_url=sp.url, chunk_size=CHUNK)
    total = len(groups) * CHUNKS_PER_PROMPT
    with running_engine(tiny_model, cfg) as llm:
        assert_same_outputs(oracle(batch(groups, 0)), generate(llm, batch(groups, 0), MAX_TOKENS))
        wait_stored(svc, "disk", total)
        clear_cpu(svc)
        files = sorted(disk.rglob("*.kvt"))
        assert len(files) == total, files
        deleted, truncated, flipped, header = files[0:2], files[2:4], files[4:6], files[6:7]
        for path in deleted:
            path.unlink()
        for path in truncated:
            os.truncate(path, path.stat().st_size // 2)
        for path in flipped:
            _flip(path, _middle_of_payload(path))  # one bit of the KV: only the checksum can tell
        for path in header:
            _flip(path, 0)  # the first byte (magic)
        bad = {p: p.read_bytes() for p in [*truncated, *flipped, *header]}
        intact = total - len(deleted) - len(truncated) - len(flipped) - len(header)
        forget_local(llm)
        before, w0, s0, local0 = svc.stats(), worker_counts(), sched_counts(llm), local_hits(llm)
        assert_same_outputs(oracle(batch(groups, 1)), generate_each(llm, batch(groups, 1), MAX_TOKENS))
        loads, lookups = delta(worker_counts(), w0), delta(sched_counts(llm), s0)
        after = svc.stats()
        kept_bad = [p for p, data in bad.items() if p.exists() and p.read_bytes() == data]
        # The store heals: the next round re-saves what it had to recompute, the one after loads it all.
        wait_quiet(svc)
        clear_cpu(svc)
        forget_local(llm)
        assert_same_outputs(oracle(batch(groups, 2)), generate_each(llm, batch(groups, 2), MAX_TOKENS))
        wait_quiet(svc)
        clear_cpu(svc)
        forget_local(llm)
        healed0, w1, s1 = svc.stats(), worker_counts(), sched_counts(llm)
        assert_same_outputs(oracle(batch(groups, 3)), generate_each(llm, batch(groups, 3), MAX_TOKENS))
        healed, heal_loads, heal_lookups = (
            svc.stats(),
            delta(worker_counts(), w1),
            delta(sched_counts(llm), s1),
        )
        local = local_hits(llm) - local0
    d0, d1 = _disk(before), _disk(after)
    errors = {k: v - d0["errors_by_kind"].get(k, 0) for k, v in d1["errors_by_kind"].items()}
    assert errors.get("missing", 0) == len(deleted), errors
    assert errors.get("corrupt", 0) == len(truncated) + len(flipped) + len(header), errors
    assert d1["hits"] - d0["hits"] == intact, "only intact files were served"
    assert d1["misses"] - d0["misses"] == total - intact
    bad_chunks = total - intact
    assert loads["failed_load_chunks"] == bad_chunks, loads
    assert loads["failed_load_blocks"] == bad_chunks * (CHUNK // 32), loads
    assert loads["loaded_chunks"] == intact, loads
    assert not kept_bad, "a corrupt file stays on disk after its read failed"
    # The disk index still listed every file: each prompt was promised its whole prefix.
    assert lookups["external_tokens"] == len(groups) * PREFIX_TOKENS, lookups
    h0, h1 = _disk(healed0), _disk(healed)
    assert h1["hits"] - h0["hits"] == total and h1["errors"] == h0["errors"], (h0, h1)
    assert heal_lookups["external_tokens"] == len(groups) * PREFIX_TOKENS, heal_lookups
    assert heal_loads["loaded_chunks"] == total and heal_loads["failed_load_chunks"] == 0, heal_loads
    assert local == 0, "vLLM's own cache served part of a batch that had to come from kvtier"
