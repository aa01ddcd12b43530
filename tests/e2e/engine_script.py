"""Run one vLLM engine in a fresh process and print its greedy outputs as JSON (for layout tests).

Usage: python -m tests.e2e.engine_script '{"model": ..., "prompts": [[...]], "max_tokens": 16,
"kv_config": {...} | null, "multiprocess": true, "one_at_a_time": false, "engine": {...}}'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.warm import REPO, Finished, run_module


def run_engine_process(job: dict, env: dict[str, str] | None = None, cwd: Path | None = None) -> dict:
    """Run the job in a process of its own; its JSON result (fails the test if the engine failed).

    In the checkout it is a fork of the warm starter (tests/support/warm.py); with cwd, a fresh
    interpreter in that folder (`-m` puts it first on sys.path)."""
    base = dict(os.environ) if env is None else env
    env = {**base, "PYTHONPATH": str(REPO)}
    if cwd is None:
        done = run_module("tests.e2e.engine_script", [json.dumps(job)], env, timeout=300)
    else:
        argv = [sys.executable, "-m", "tests.e2e.engine_script", json.dumps(job)]
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        done = Finished(proc.returncode, proc.stdout, proc.stderr)
    result = done.result()
    result["kvtier_log"] = [line for line in done.stderr.splitlines() if "kvtier" in line]
    return result


def main() -> int:
    """Parse the job, run it, print {"tokens": [[...]], "preemptions": n} on the last line."""
    job = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job.get("multiprocess") else "0"
    from kvtier.bench.harness import generate, generate_each, metric, preemptions, running_engine

    overrides = job.get("engine", {})
    run = generate_each if job.get("one_at_a_time") else generate
    with running_engine(job["model"], job.get("kv_config"), **overrides) as llm:
        out = run(llm, job["prompts"], job.get("max_tokens", 16))
        count = preemptions(llm)
        external = metric(llm, "vllm:kvtier_external_tokens")
        skipped = metric(llm, "vllm:kvtier_save_skipped_chunks")
    result = {"tokens": out.tokens, "preemptions": count, "external_tokens": external}
    result["save_skipped"] = skipped
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
