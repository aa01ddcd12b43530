"""kvtier under speculative decoding (vLLM's ngram drafter, which runs on the CPU build): outputs equal
the same engine's without kvtier, and chunks completed by multi-token decode steps load correctly."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.harness import Outputs, generate, kv_transfer_config, make_prompt, metric, running_engine
from tests.app import wait_until
from tests.e2e.service import REPO, running_service
from tests.support.warm import run_module

pytestmark = pytest.mark.e2e

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Local prefix caching off: the second round can only reuse KV through kvtier.
ENGINE: dict[str, Any] = dict(speculative_config=SPECULATIVE, enable_prefix_caching=False)
CHUNK = 64
MAX_TOKENS = 48
# A repeated phrase gives the ngram drafter matches from the first step. 120 and 100 prompt tokens
# hold one full chunk each; the second chunk of each is completed by decode steps of up to 4 tokens.
PROMPTS = [make_prompt(900, 30) * 4, make_prompt(901, 100)]
STORED_CHUNKS = 4
SUFFIXES = [make_prompt(902, 20), make_prompt(903, 20)]


def follow_ups(prompts: list[list[int]], answers: list[list[int]]) -> list[list[int]]:
    """Each prompt, its answer and a new question: the first two chunks are kvtier's to load."""
    return [p + a + s for p, a, s in zip(prompts, answers, SUFFIXES, strict=True)]


def _wait_stored(service_url: str, chunks: int) -> int:
    """Wait (bounded) until the service's CPU tier holds this many chunks; the last count seen."""
    from kvtier.app.client import ServiceClient

    client = ServiceClient(service_url, name="kvtier-test-client")

    def count() -> int:
        return int(client.stats().result(10)["tiers"]["cpu"]["chunks"])

    try:
        wait_until(lambda: count() == chunks, 20)
        return count()
    finally:
        client.close()


def both_rounds(model: str, service_url: str | None) -> dict[str, Any]:
    """Run both rounds on one speculative engine (with kvtier when service_url is set)."""
    from kvtier.connector import faults

    cfg = kv_transfer_config(service_url=service_url, chunk_size=CHUNK) if service_url else None
    with running_engine(model, cfg, **ENGINE) as llm:
        first = generate(llm, PROMPTS, MAX_TOKENS).tokens
        # Saves end after the outputs are returned: wait for both chunks of both requests.
        stored = _wait_stored(service_url, STORED_CHUNKS) if service_url else 0
        external_first = metric(llm, "vllm:kvtier_external_tokens")
        second = generate(llm, follow_ups(PROMPTS, first), 8).tokens
        return {
            "first": first,
            "second": second,
            "stored": stored,
            "external_first": external_first,
            "external": metric(llm, "vllm:kvtier_external_tokens"),
            "loaded": metric(llm, "vllm:kvtier_loaded_tokens"),
            "failed_load_blocks": metric(llm, "vllm:kvtier_failed_load_blocks"),
            "accepted": metric(llm, "vllm:spec_decode_num_accepted_tokens"),
            "kvtier_errors": [str(e) for e in faults.unexpected_errors()],
        }


def in_fresh_process(model: str, service_url: str | None = None) -> dict[str, Any]:
    """both_rounds in a process of its own: after an ngram engine has imported numba, vLLM 0.32's CPU
    build fails to start any later engine in that process (its kernel override scan reads llvmlite's
    library wrapper), so no speculative engine runs inside the test process."""
    job = json.dumps({"model": model, "service_url": service_url})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return run_module("tests.e2e.test_spec_decode", [job], env, timeout=300).result()


def test_ngram_speculation_keeps_outputs_and_loads_decoded_chunks(tiny_model: str, tmp_path: Path) -> None:
    expected = in_fresh_process(tiny_model)
    with running_service(tmp_path / "svc") as svc:
        got = in_fresh_process(tiny_model, svc.url)
        hits = svc.hit_tokens()
    assert got["kvtier_errors"] == []
    assert expected["accepted"] > 0 and got["accepted"] > 0, "decode steps added several tokens at once"
    assert got["first"] == expected["first"], Outputs(expected["first"]).diff(Outputs(got["first"]))
    assert got["stored"] == STORED_CHUNKS
    assert got["external_first"] == 0
    assert got["second"] == expected["second"], Outputs(expected["second"]).diff(Outputs(got["second"]))
    assert got["external"] == STORED_CHUNKS * CHUNK
    assert hits["cpu"] >= STORED_CHUNKS * CHUNK
    assert got["loaded"] == got["external"] and got["failed_load_blocks"] == 0


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    print(json.dumps(both_rounds(job["model"], job["service_url"])), flush=True)
