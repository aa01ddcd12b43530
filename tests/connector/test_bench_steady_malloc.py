"""Engines the benchmarks compare start with glibc's heap trimming off (bench/engine_proc.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.bench.engine_proc import STEADY_MALLOC_ENV, steady_malloc

# Allocates and frees 36 MiB in 3 MiB blocks twice (numpy's buffers come from malloc), and prints
# the page faults of each round: a heap that keeps what was freed serves the second round without
# faults, one trimmed after the first round faults its pages in again.
_ROUNDS = """
import resource
import numpy as np

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

counts = []
for _ in range(2):
    before = faults()
    blocks = [np.ones(3 << 20, dtype=np.uint8) for _ in range(12)]
    del blocks
    counts.append(faults() - before)
print(*counts)
"""


def _fault_rounds() -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS], check=True, capture_output=True, text=True)
    first, second = (int(n) for n in out.stdout.split())
    return first, second


def test_children_started_inside_keep_their_freed_heap() -> None:
    with steady_malloc():
        first, second = _fault_rounds()
    assert first > 0.9 * 12 * (3 << 20) / 4096  # the first round's pages are new
    assert second < first // 10


def test_the_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    name, other = list(STEADY_MALLOC_ENV)
    monkeypatch.setenv(name, "4096")
    monkeypatch.delenv(other, raising=False)
    with steady_malloc():
        assert {n: os.environ[n] for n in STEADY_MALLOC_ENV} == STEADY_MALLOC_ENV
    assert os.environ[name] == "4096"
    assert other not in os.environ
