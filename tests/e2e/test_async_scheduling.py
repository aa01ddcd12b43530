"""Async scheduling forced on (EngineCore driven directly): preemption and decode saving stay exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.engine_core import run_engine_core
from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
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
        longer = generate_each(llm, prompts, PREEMPTION_MAX_TOKENS + 1)
    expected = Outputs([tokens[:PREEMPTION_MAX_TOKENS] for tokens in longer.tokens])
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=32, save_decode=True)
        run = run_engine_core(tiny_model, prompts, PREEMPTION_MAX_TOKENS, cfg, **ENGINE)
        stats = svc.stats()
        # Prompts that end with what was decoded: their second chunk, filled by decoding under
        # async scheduling (its hash appears a step late), is found and loaded.
        extended = [p + out for p, out in zip(prompts, run.outputs.tokens, strict=True)]
        again = run_engine_core(tiny_model, extended, 1, cfg, **ENGINE)
    assert run.async_scheduling and again.async_scheduling, "vLLM ran its AsyncScheduler"
    assert run.preemptions >= 1
    assert_same_outputs(expected, run.outputs)
    assert again.outputs.tokens == [tokens[-1:] for tokens in longer.tokens]
    # 34-token prompts + 35 generated = 69 tokens with KV: two 32-token chunks per request.
    assert stats["tiers"]["cpu"]["stores"] == 4
    # Every re-admission after a preemption reloads the request's saved chunks.
    assert run.connector_totals["readmissions"] >= 1
    assert run.connector_totals["external_tokens"] >= 32 * run.connector_totals["readmissions"]
    assert again.connector_totals["external_tokens"] == 2 * 2 * 32
    assert again.connector_totals["readmissions"] == 0
