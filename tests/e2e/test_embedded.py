"""The embedded default (no service_url): vLLM starts its own kvtier service and nothing outlives it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
from tests.e2e.engine_script import run_engine_process
from tests.e2e.oracle import assert_same_outputs
from tests.e2e.service import REPO
from tests.support.processes import exits

pytestmark = pytest.mark.e2e

SHARED = make_prompt(300, 260)
PROMPTS = [SHARED + make_prompt(301, 30), SHARED + make_prompt(302, 50)]


def _service_processes(marker: Path) -> list[int]:
    """Live kvtier services whose command line names marker (this test's runtime directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except (OSError, IndexError):
                continue
            if b"kvtier.app.server" in cmd and str(marker).encode() in cmd and state != "Z":
                pids.append(int(entry.name))
    return pids


def test_embedded_service_serves_hits_and_leaves_nothing(tiny_model: str, tmp_path: Path) -> None:
    with running_engine(tiny_model, enable_prefix_caching=False) as llm:
        expected = generate_each(llm, PROMPTS, 10)
    shm = tmp_path / "shm"
    shm.mkdir()
    # Short: the socket path under it must fit the 108-byte limit of unix socket paths.
    run_dir = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        _run_and_check(tiny_model, expected, shm, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run_and_check(tiny_model: str, expected: Outputs, shm: Path, run_dir: Path) -> None:
    job = {
        "model": tiny_model,
        "prompts": PROMPTS,
        "max_tokens": 10,
        # The connector found by module path (the other route vLLM offers; the harness uses the name).
        "kv_config": {
            **kv_transfer_config(chunk_size=64, cpu_size="64MiB", shm_dir=str(shm)),
            "kv_connector_module_path": "kvtier.connector",
        },
        "engine": {"enable_prefix_caching": False},
        "multiprocess": True,
        "one_at_a_time": True,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(PYTHONPATH=str(REPO), XDG_RUNTIME_DIR=str(run_dir))
    result = run_engine_process(job, env)
    assert_same_outputs(expected, Outputs(result["tokens"]))
    # The first prompt stored 4 whole chunks of 64 (its 290 tokens and 9 decoded ones hold no fifth),
    # all inside the 260 shared tokens; the second prompt loaded exactly those.
    assert result["external_tokens"] == 4 * 64, "the second prompt loaded the shared prefix"
    # The engine's processes are gone: so are its service, socket and arena.
    assert (run_dir / "kvtier").is_dir(), "the embedded service used this test's runtime dir"
    for pid in _service_processes(run_dir):
        assert exits(pid, 15), f"the embedded service (pid {pid}) outlived its engine"
    assert not _service_processes(run_dir), "the embedded service outlived its engine"
    assert not list(shm.glob("kvtier-*.arena")), "arena file left behind"
    assert not list(run_dir.rglob("*.sock")), "socket left behind"
