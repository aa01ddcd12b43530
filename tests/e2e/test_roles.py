"""kv_role on one shared service: a prefill engine (kv_producer) only saves, a decode engine
(kv_consumer) only loads; the consumer's outputs equal an engine's without kvtier. Any other role is
refused at start with an error that names the served ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.harness import Outputs, generate, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_totals, worker_totals
from tests.app import wait_until
from tests.e2e.oracle import assert_same_outputs, forget_local_cache
from tests.e2e.service import RunningService, running_service

pytestmark = pytest.mark.e2e

CHUNK = 64
# 200 and 140 tokens hold 3 and 2 full chunks; the consumer's third prompt (2 chunks) is new to both.
PROMPTS = [make_prompt(900, 200), make_prompt(901, 140)]
NEW_PROMPT = make_prompt(902, 150)
STORED = 5
MAX_TOKENS = 4


def _role(svc: RunningService, role: str) -> dict[str, Any]:
    cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
    cfg["kv_role"] = role
    return cfg


def _cpu_chunks(svc: RunningService) -> int:
    return int(svc.stats()["tiers"]["cpu"]["chunks"])


def test_a_producer_only_saves_and_a_consumer_only_loads_on_one_service(
    tiny_model: str, tmp_path: Path
) -> None:
    with running_engine(tiny_model) as llm:
        baseline = generate(llm, [*PROMPTS, NEW_PROMPT], MAX_TOKENS)
    with running_service(tmp_path / "svc") as svc:
        with running_engine(tiny_model, _role(svc, "kv_producer")) as llm:
            first = generate(llm, PROMPTS, MAX_TOKENS)
            assert wait_until(lambda: _cpu_chunks(svc) == STORED, 20), svc.stats()
            forget_local_cache(llm)  # the prompts again, with vLLM's own cache emptied
            again = generate(llm, PROMPTS, MAX_TOKENS)
            sched, worker = scheduler_totals(llm), worker_totals()
        # The producer saved every chunk once and never looked anything up nor loaded.
        assert sched.get("lookup_count", 0) == 0 and sched.get("external_tokens", 0) == 0
        assert worker["saved_chunks"] == STORED and worker.get("loaded_chunks", 0) == 0
        assert sum(svc.hit_tokens().values()) == 0
        assert_same_outputs(Outputs(baseline.tokens[:2]), first)
        assert_same_outputs(first, again)
        svc.wait_leases_ended()
        with running_engine(tiny_model, _role(svc, "kv_consumer")) as llm:
            consumed = generate(llm, [*PROMPTS, NEW_PROMPT], MAX_TOKENS)
            sched, worker = scheduler_totals(llm), worker_totals()
        # The consumer loaded what the producer saved (every chunk short of each prompt's last
        # token) and stored nothing, not even the chunks of the prompt the producer never saw.
        assert sched["external_tokens"] == 192 + 128
        assert worker["loaded_chunks"] == STORED and worker.get("saved_chunks", 0) == 0
        assert sum(svc.hit_tokens().values()) == STORED * CHUNK
        assert _cpu_chunks(svc) == STORED and svc.stats()["tiers"]["cpu"]["stores"] == STORED
    assert_same_outputs(baseline, consumed)


def test_any_other_kv_role_is_refused_at_start(tiny_model: str) -> None:
    cfg = kv_transfer_config()
    cfg["kv_role"] = "kv_sender"
    # vLLM refuses it before kvtier starts (kvtier refuses it too: test_worker_ranks.py).
    served = r"(?s)kv_role.*'kv_producer', 'kv_both' or 'kv_consumer'.*input_value='kv_sender'"
    with pytest.raises(ValueError, match=served), running_engine(tiny_model, cfg):
        pass
