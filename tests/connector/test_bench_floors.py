"""The pure parts of each tier's floor in `kvtier bench connector`: the ratio's arithmetic, the disk
floor's read (warm and with the page cache dropped), the loopback socket that stands for Redis's
transport, redis-benchmark's output, and where the ratios are reported."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvtier.bench import all as bench_all
from kvtier.bench.connector import floor_table
from kvtier.bench.floors import HIT_FLOOR_TARGETS, FileRead, drop_cached, hit_floor, resident_bytes
from kvtier.bench.hit_floors import chunk_files
from kvtier.bench.loopback import LoopbackFloor, parse_redis_benchmark_csv, pattern, redis_benchmark_get
from kvtier.runtime.mounts import filesystem_type
from kvtier.storage.keys import DISK_SUFFIX
from kvtier.storage.tiers.disk_files import TEMP_PREFIX
from tests.support.redis_fixtures import need_redis
from tests.support.redis_server import RedisServer


# ------------------------------------------------------------------------------------ the arithmetic
def test_the_floor_of_each_turn_is_its_ceiling_plus_its_move() -> None:
    # Turn j's floor is ceilings[j] + moves[j]: 0.010, 0.012, 0.030, whose median is 0.012.
    figures = hit_floor([0.015, 0.018, 0.012], [0.008, 0.011, 0.020], [0.002, 0.001, 0.010], 1.2)
    assert figures == {
        "hit_ms": 15.0,
        "ceiling_ms": 11.0,
        "move_ms": 2.0,
        "floor_ms": 12.0,
        "ratio": 1.25,
        "target": 1.2,
    }


def test_the_floor_is_the_median_of_the_turns_sums_not_the_sum_of_the_medians() -> None:
    # Turns' sums 5, 6, 9: median 6; the parts' medians would give 4 + 1 = 5.
    figures = hit_floor([12.0, 12.0, 12.0], [4.0, 5.0, 1.0], [1.0, 1.0, 8.0], None)
    assert figures["floor_ms"] == 6000.0 and figures["ratio"] == 2.0 and figures["target"] is None


@pytest.mark.parametrize(("hits", "ceilings", "moves"), [([], [], []), ([1.0], [1.0, 1.0], [1.0])])
def test_samples_that_do_not_pair_up_are_refused(
    hits: list[float], ceilings: list[float], moves: list[float]
) -> None:
    with pytest.raises(ValueError, match="as many hits, ceilings and moves"):
        hit_floor(hits, ceilings, moves, 1.5)


def test_the_table_says_which_targets_were_met() -> None:
    floors = {
        "cpu": hit_floor([0.011], [0.008], [0.002], HIT_FLOOR_TARGETS["cpu"]),  # 1.1
        "redis": hit_floor([0.030], [0.008], [0.002], HIT_FLOOR_TARGETS["redis"]),  # 3.0
    }
    rows = [line.split() for line in floor_table(floors).splitlines()[1:]]
    assert rows == [
        ["cpu", "11.00", "8.00", "2.00", "10.00", "1.100", "<=", "1.2:", "met"],
        ["redis", "30.00", "8.00", "2.00", "10.00", "3.000", "<=", "2:", "NOT", "met"],
    ]


def test_make_bench_judges_each_tiers_hit_floor_ratio_and_no_longer_the_disk_get_line() -> None:
    results = {
        "storage": {"disk": {"put_ratio": 0.7, "get_ratio": 0.3}},
        "connector": {"hit_floor_ratio": {"cpu": 1.1, "disk": 1.6, "disk_cold": 1.2, "redis": 1.9}},
    }
    found = {h.name: (h.value, h.target, h.met) for h in bench_all.headlines(results)}
    assert found == {
        "storage.disk.put_ratio": (0.7, 0.8, False),
        "connector.hit_floor_ratio.cpu": (1.1, 1.2, True),
        "connector.hit_floor_ratio.disk": (1.6, 1.5, False),
        "connector.hit_floor_ratio.disk_cold": (1.2, 1.3, True),
        "connector.hit_floor_ratio.redis": (1.9, 2.0, True),
    }


# ------------------------------------------------------------------------------------ the disk floor
def _files(root: Path, sizes: list[int]) -> tuple[list[Path], bytes]:
    """Files of these sizes with distinct random bytes, and all their bytes in order."""
    rng = np.random.default_rng(7)
    paths, everything = [], b""
    for i, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        path = root / f"chunk-{i}{DISK_SUFFIX}"
        path.write_bytes(data)
        paths.append(path)
        everything += data
    return paths, everything


def test_the_read_floor_reads_every_file_whole_and_in_order(tmp_path: Path) -> None:
    paths, everything = _files(tmp_path, [3 * mmap.PAGESIZE + 5, 1, 2 << 20])
    read = FileRead(paths)
    assert read.nbytes == len(everything)
    assert read.once() > 0
    assert bytes(read.data) == everything


def test_a_file_shorter_than_it_was_is_named(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, [4096, 8192])
    read = FileRead(paths)
    os.truncate(paths[1], 100)
    with pytest.raises(RuntimeError, match=f"{paths[1]} holds 100 bytes, 8192 expected"):
        read.once()


def test_dropping_the_page_cache_leaves_none_of_the_files_cached_and_the_read_reads_them_back(
    tmp_path: Path,
) -> None:
    if filesystem_type(tmp_path) == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs, whose pages are the files themselves")
    size = 5 * mmap.PAGESIZE + 17
    paths, everything = _files(tmp_path, [size, size])
    read = FileRead(paths)
    read.once()  # the files' pages are cached now, every one of them
    assert resident_bytes(paths) == 2 * 6 * mmap.PAGESIZE
    drop_cached(paths)
    assert resident_bytes(paths) == 0
    read.data[:] = b"\0" * read.nbytes
    read.once()
    assert bytes(read.data) == everything
    assert resident_bytes(paths) == 2 * 6 * mmap.PAGESIZE


def test_chunk_files_are_the_tiers_files_without_writes_in_flight(tmp_path: Path) -> None:
    fan = tmp_path / "ns" / "ab" / "cd"
    fan.mkdir(parents=True)
    (fan / f"abcd01{DISK_SUFFIX}").write_bytes(b"x")
    (fan / f"{TEMP_PREFIX}123-abcd02{DISK_SUFFIX}").write_bytes(b"x")
    (fan / "notes.txt").write_bytes(b"x")
    assert chunk_files(tmp_path) == {str(fan / f"abcd01{DISK_SUFFIX}")}


# ------------------------------------------------------------------------------- the Redis floor
def test_the_loopback_floor_moves_exactly_the_bytes_asked_for() -> None:
    sizes = [3, 70_000, 0, 1 << 20]
    with LoopbackFloor(2 << 20) as floor:
        assert floor.move(sizes) > 0
        expected = b"".join(pattern(size).tobytes() for size in sizes)
        assert len(floor.received) == sum(sizes)
        assert bytes(floor.received) == expected
        # The connection carries the next request as the first: nothing was left unread.
        floor.move([5])
        assert bytes(floor.received) == bytes([0, 1, 2, 3, 4])
        with pytest.raises(ValueError, match="summing to at most 2097152"):
            floor.move([1 << 20, (1 << 20) + 1])
        proc = floor._proc
    assert proc.returncode == 0  # a count of 0 ended the server


def test_the_pattern_shows_a_misplaced_byte() -> None:
    assert pattern(253).tolist()[249:] == [249, 250, 0, 1]


def test_redis_benchmarks_csv_is_read_by_test_and_column() -> None:
    text = (
        '"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms",'
        '"p99_latency_ms","max_latency_ms"\n'
        '"SET","414.94","2.401","1.488","2.231","3.151","4.783","13.399"\n'
        '"GET","344.83","1.223","0.736","1.175","1.783","1.991","2.071"\n'
    )
    parsed = parse_redis_benchmark_csv(text)
    assert parsed["GET"]["rps"] == 344.83 and parsed["GET"]["p50_latency_ms"] == 1.175
    assert parsed["SET"]["max_latency_ms"] == 13.399
    with pytest.raises(ValueError, match="no rows"):
        parse_redis_benchmark_csv("")


@pytest.mark.redis
def test_redis_benchmark_gets_values_of_the_size_asked_for() -> None:
    need_redis()
    if shutil.which("redis-benchmark") is None:
        pytest.fail("redis-benchmark is not installed (it comes with redis-server's package)")
    server = RedisServer().start()
    try:
        got = redis_benchmark_get(server.port, 65536, requests=20)
    finally:
        server.stop()
    assert got is not None
    assert got["value_bytes"] == 65536 and got["get_rps"] > 0
    assert got["get_ms_per_value"] == round(1000 / got["get_rps"], 3)
    assert got["command"] == f"redis-benchmark -h 127.0.0.1 -p {server.port} -t set,get -d 65536 -n 20 -c 1"
