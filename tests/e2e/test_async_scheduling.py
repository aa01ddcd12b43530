"""Async scheduling forced on (EngineCore driven directly): preemption and decode saving stay exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.engine_core import run_engine_core
from kvtier.bench.harness import generate_each, kv_transfer_config, make_prompt, running_engine
from tests.e2e.oracle import (
    PREEMPTION_ENGINE,
    PREEMPTION_MAX_TOKENS,
    PREEMPTION_PROMPT_LEN,
    assert_same_outputs,
)
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e
ENGINE = dict(PREEMPTION_ENGINE, enable_prefix_caching=False)


def test_async_scheduling_with_preemption_and_decode_saving(tiny_model: str, tmp_path: Path) -> None:
    prompts = [make_prompt(41, PREEMPTION_PROMPT_LEN), make_prompt(42, PREEMPTION_PROMPT_LEN)]
    with running_engine(tiny_model, **ENGINE) as llm:
        expected = generate_each(llm, prompts, PREEMPTION_MAX_TOKENS)
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=32, save_decode=True)
        run = run_engine_core(tiny_model, prompts, PREEMPTION_MAX_TOKENS, cfg, **ENGINE)
        stats = svc.stats()
        # The same prompts again: every chunk saved under async scheduling is found and loaded.
        again = run_engine_core(tiny_model, prompts, PREEMPTION_MAX_TOKENS, cfg, **ENGINE)
    assert run.async_scheduling, "the engine really ran with async scheduling"
    assert run.preemptions >= 1
    assert_same_outputs(expected, run.outputs)
    assert_same_outputs(expected, again.outputs)
    # 34-token prompts + 35 generated = 68 tokens with KV: two 32-token chunks per request, the
    # second of them filled by decoding (its hash appears a step late under async scheduling).
    assert stats["tiers"]["cpu"]["stores"] >= 4
    assert run.connector_totals["readmissions"] >= 1
    assert again.connector_totals["external_tokens"] >= 2 * 32
