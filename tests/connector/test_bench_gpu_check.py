"""tools.gpu_check's CPU part: every layout round trip and the worker-side checks pass on the CPU, and
without CUDA the CUDA-only checks say they were skipped instead of passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tools import gpu_check
from tools.gpu_check_layouts import CASES
from tools.gpu_check_worker import worker_checks


@dataclass(frozen=True)
class Run:
    """One run of the device check as a developer runs it, without a GPU: its JSON summary and the
    lines it printed."""

    summary: dict[str, Any]
    lines: list[str]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``python -m tools.gpu_check`` from the repository root, in a process of its own, with no GPU:
    run once for the module (it takes most of a minute on two cores)."""
    out = tmp_path_factory.mktemp("gpu_check") / "out.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return Run(json.loads(out.read_text()), run.stdout.splitlines())


def test_the_layout_round_trips_pass_on_the_cpu(cpu_run: Run) -> None:
    summary = cpu_run.summary
    statuses = {check["name"]: check["status"] for check in summary["checks"]}
    assert [name for name in statuses if name.startswith("roundtrip")] == [
        f"roundtrip {c.name}" for c in CASES
    ]
    assert all(statuses[f"roundtrip {c.name}"] == "PASS" for c in CASES)
    worker = [name for name, _ in worker_checks()]
    # The graph replay, pinning and a rank on device 1 need CUDA; V2's order and grouped copies not.
    assert {name: statuses[name] for name in worker} == {
        "worker_save": "PASS", "worker_load": "PASS", "worker_failed_load": "PASS",
        "worker_preemption_fence": "PASS", "worker_full_graph_replay": "SKIP", "worker_v2_drafter": "PASS",
        "grouped_copier": "PASS", "arena_pinned": "SKIP", "rank_on_device_1": "SKIP",
    }  # fmt: skip
    cuda_only = [name for name in statuses if not name.startswith("roundtrip") and name not in worker]
    assert cuda_only and all(statuses[name] == "SKIP" for name in cuda_only)
    assert summary["failed"] == 0 and summary["passed"] == len(CASES) + 6
    assert f"PASS roundtrip {CASES[0].name}" in cpu_run.lines
    assert f"SKIP {cuda_only[0]}: no CUDA" in cpu_run.lines


def test_a_failed_check_fails_the_run_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: torch.device) -> None:
        raise AssertionError("bytes differ")

    monkeypatch.setattr(gpu_check, "checks", lambda: [("broken", broken, False)])
    assert gpu_check.run_all(torch.device("cpu"), echo=False) == [
        gpu_check.Outcome("broken", "FAIL", "bytes differ")
    ]
    assert gpu_check.main(["--device", "cpu"]) == 1


def test_without_cuda_the_module_runs_and_exits_cleanly_saying_why_it_skipped(cpu_run: Run) -> None:
    """As a developer runs it from the repository root: ``python -m tools.gpu_check`` in a process of
    its own, with no GPU."""
    assert "SKIP misaligned_ids_timed: no CUDA" in cpu_run.lines
    assert "SKIP rank_on_device_1: needs CUDA" in cpu_run.lines
    assert cpu_run.summary["device"] == "cpu" and cpu_run.summary["failed"] == 0
