"""kvtier's lines are in vLLM's own log output: the connector's through vLLM's logging (vLLM's format
and stream), the embedded service's as text lines in the same stream, and the settings' note about
ignored Kubernetes service links too. KVTIER_LOG_LEVEL=WARNING hides kvtier's INFO lines, not vLLM's."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvtier.bench.harness import kv_transfer_config, make_prompt
from tests.e2e.service import REPO
from tests.support.warm import run_module

pytestmark = pytest.mark.e2e

# vLLM's line format: "(EngineCore pid=12) INFO 05-06 12:34:56 [core.py:101] message".
VLLM_INFO = r"^\(\S+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[{file}:\d+\] {msg}"
READY = re.compile(
    VLLM_INFO.format(file=r"connector\.py", msg=r"kvtier connector \(scheduler\) ready: "), re.M
)
SERVING = re.compile(
    r"^\(kvtier-service pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[server\.py:\d+\] serving url=unix://", re.M
)
IGNORED = re.compile(
    VLLM_INFO.format(
        file=r"settings\.py",
        msg=r"kvtier ignores 1 Kubernetes service-link variable\(s\), which are not settings: "
        r"KVTIER_SERVICE_HOST$",
    ),
    re.M,
)
ANY_VLLM_INFO = re.compile(VLLM_INFO.format(file=r"\S+", msg=""), re.M)
# Any INFO line of kvtier's: the connector's and the settings' start with "kvtier", the service's lines
# with its own process name.
KVTIER_INFO = re.compile(
    VLLM_INFO.format(file=r"\S+", msg="kvtier") + r"|^\(kvtier-service pid=\d+\) INFO ", re.M
)


def _engine_log(model: str, shm: Path, **kvtier_env: str) -> str:
    """vLLM's own log output (its stream, stdout by default) of one engine with kvtier, one prompt."""
    shm.mkdir()
    job = {
        "model": model,
        "prompts": [make_prompt(7, 40)],
        "max_tokens": 2,
        "kv_config": kv_transfer_config(shm_dir=str(shm), cpu_size="16MiB"),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(PYTHONPATH=str(REPO), KVTIER_SERVICE_HOST="10.0.0.1", **kvtier_env)
    done = run_module("tests.e2e.engine_script", [json.dumps(job)], env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_kvtier_lines_are_in_vllms_log_at_kvtiers_level(tiny_model: str, tmp_path: Path) -> None:
    log = _engine_log(tiny_model, tmp_path / "info")
    assert READY.search(log), log[-3000:]
    assert SERVING.search(log), log[-3000:]
    assert IGNORED.search(log), log[-3000:]

    quiet = _engine_log(tiny_model, tmp_path / "warning", KVTIER_LOG_LEVEL="WARNING")
    assert ANY_VLLM_INFO.search(quiet), quiet[-3000:]  # vLLM's own INFO lines are still there
    assert KVTIER_INFO.findall(quiet) == []
