"""An engine started from a folder that holds packages of its own named app and storage still gets hits:
kvtier imports only `kvtier.*`, in the engine's processes and in the service it starts. The engine finds
the connector by its name alone, through kvtier's vLLM plugin entry point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier.bench.harness import kv_transfer_config, make_prompt
from tests.e2e.engine_script import run_engine_process
from tests.e2e.service import REPO

pytestmark = pytest.mark.e2e

CHUNK = 64
SHARED = make_prompt(400, 260)
PROMPTS = [SHARED + make_prompt(401, 30), SHARED + make_prompt(402, 50)]
SHADOWED = ("app", "storage")


def _shadow_packages(folder: Path) -> None:
    """Top-level packages named as kvtier's folders once were, each failing loudly when imported."""
    for name in SHADOWED:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('the working directory\\'s own {name} package was imported')\n"
        )


def test_engine_in_a_folder_with_its_own_app_and_storage_gets_hits(tiny_model: str, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    _shadow_packages(workdir)
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)  # for tests.e2e.engine_script; the working directory comes first
    # The shadows are really in the way: `python -m` run there imports them before anything else.
    for name in SHADOWED:
        probe = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=workdir, env=env, capture_output=True, text=True
        )
        assert f"own {name} package was imported" in probe.stderr
    # Short: the embedded service's socket path under it must fit the 108-byte limit of unix sockets.
    run_dir = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    # The README's flag as written: the connector found by name, through kvtier's vLLM plugin.
    kv_config = kv_transfer_config(chunk_size=CHUNK, cpu_size="64MiB", shm_dir=str(shm))
    try:
        job = {
            "model": tiny_model,
            "prompts": PROMPTS,
            "max_tokens": 8,
            # No service_url: the engine starts its embedded service, from this working directory.
            "kv_config": kv_config,
            "engine": {"enable_prefix_caching": False},
            "multiprocess": True,  # vLLM's engine core in a process of its own, as served
            "one_at_a_time": True,
        }
        result = run_engine_process(job, {**env, "XDG_RUNTIME_DIR": str(run_dir)}, cwd=workdir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    assert [len(t) for t in result["tokens"]] == [8, 8]
    # The second prompt loaded the shared prefix from the service the first stored it in: the first
    # stored 4 whole chunks (its 290 tokens and 7 decoded ones hold no fifth), all inside the 260
    # shared tokens, and nothing else is a hit.
    assert result["external_tokens"] == 4 * CHUNK, (result["save_skipped"], result["kvtier_log"][-40:])
