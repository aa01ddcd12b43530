"""MLA (a DeepSeek-V2-shaped random model): a chunk holds each layer's latent page as vLLM lays it out.

On vLLM's CPU build, MLA runs on a reference backend (block size forced to 16) and vLLM turns its
own prefix cache off for it: that backend does not compute over a cached prefix as a full prefill
does (vLLM's own prefix cache, turned back on, changes some greedy outputs the same way). kvtier
therefore refuses MLA there, at vLLM's defaults, and says why.

To prove the latent pages themselves, the other tests turn vLLM's prefix cache back on, as a platform
whose MLA backend computes over a cached prefix would run: cold runs (a full prefill) must give the outputs of
the engine without kvtier, and loads from every tier, the failed load and the preemption are held to
exact tokens and blocks. Their outputs are not compared: with a cached prefix, the reference backend's
outputs depend on the batch and on what ran before, without kvtier too (the same prompt with the same
cached tokens gave other tokens after other requests; two 34-token prompts prefilled together gave
other first tokens than one at a time), so no run is an oracle for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from kvtier.bench.harness import generate_each, kv_transfer_config, running_engine
from kvtier.bench.introspect import scheduler_connector, worker_connector
from kvtier.bench.models import build_mla_model
from tests.e2e.family_cases import (
    CHUNK,
    MAX_TOKENS,
    PREEMPTION_PROMPTS,
    PROMPTS,
    check_preemption,
    check_tier_rounds,
    run_preemption,
    run_tier_rounds,
)
from tests.e2e.oracle import (
    PREEMPTION_MAX_TOKENS,
    PREEMPTION_PROMPT_LEN,
    assert_same_outputs,
    forget_local_cache,
)
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e

BLOCK = 16  # vLLM's CPU MLA backend forces it
# Four usable 16-token blocks per request at most: two requests of 34 + 35 tokens (5 blocks each)
# cannot both hold theirs, so one is preempted.
PREEMPTION_ENGINE = dict(max_model_len=128, num_gpu_blocks_override=9)
assert PREEMPTION_PROMPT_LEN + PREEMPTION_MAX_TOKENS > 4 * BLOCK


@contextlib.contextmanager
def vllm_prefix_cache_on() -> Iterator[None]:
    """Engines started in this process keep vLLM's prefix cache on for MLA (the CPU platform turns
    it off); the engine must run in this process (the harness's default)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    with mock.patch.object(CpuPlatform, "check_and_update_config", classmethod(check_and_update_config)):
        yield


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_mla_model(tmp_path_factory.mktemp("models") / "tiny-mla"))


@pytest.fixture(scope="module")
def vllm_own(mla: str) -> dict[str, Any]:
    """Cold outputs (full prefills, one prompt at a time) of the engine without kvtier, prefix cache on."""
    with vllm_prefix_cache_on(), running_engine(mla) as llm:
        cold = generate_each(llm, PROMPTS, MAX_TOKENS)
        forget_local_cache(llm)
        preemption = generate_each(llm, PREEMPTION_PROMPTS, PREEMPTION_MAX_TOKENS)
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
    return {"cold": cold, "preemption": preemption, "block": block_size}


def test_the_model_runs_mla_and_its_outputs_vary(vllm_own: dict[str, Any]) -> None:
    assert vllm_own["block"] == BLOCK
    for tokens in vllm_own["cold"].tokens + vllm_own["preemption"].tokens:
        assert len(set(tokens)) > len(tokens) // 2, f"the random model repeats itself: {tokens}"


def test_refused_at_vllms_defaults_where_vllm_turns_its_prefix_cache_off(
    mla: str, vllm_own: dict[str, Any], tmp_path: Path
) -> None:
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(mla, cfg) as llm:
            assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
            reasons = [
                scheduler_connector(llm).snapshot().idle_reason,
                worker_connector().snapshot().idle_reason,
            ]
            got = generate_each(llm, PROMPTS, MAX_TOKENS)
            got_again = generate_each(llm, PROMPTS, MAX_TOKENS)
            serving = [scheduler_connector(llm)._sched, worker_connector()._worker]
        hits = svc.hit_tokens()
    for reason in reasons:
        assert reason.startswith("kvtier does not serve MLA (MLAAttentionSpec) on vLLM's CPU platform")
    assert_same_outputs(vllm_own["cold"], got)
    assert_same_outputs(vllm_own["cold"], got_again)  # recomputed: neither vLLM nor kvtier served it
    assert hits == {"cpu": 0, "disk": 0, "redis": 0, "object": 0} and serving == [None, None]


def test_hits_from_every_tier_and_a_failed_load(
    mla: str, vllm_own: dict[str, Any], redis_server, tmp_path: Path
) -> None:
    with vllm_prefix_cache_on():
        rounds = run_tier_rounds(mla, tmp_path, redis_server.url, vllm_own["cold"], None, None)
    check_tier_rounds(rounds, block=BLOCK)


def test_preempted_request_reloads_its_chunks(mla: str, vllm_own: dict[str, Any], tmp_path: Path) -> None:
    with vllm_prefix_cache_on():
        run = run_preemption(mla, tmp_path, BLOCK, **PREEMPTION_ENGINE)
    check_preemption(run, None, block=BLOCK)
