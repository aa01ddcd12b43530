"""A sliding-window hybrid (Gemma-3-shaped: sliding-window layers around a full-attention one).

kvtier's connector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on, with
kvtier as without it: three KV cache groups of one layer each (two of a 64-token window, one of full
attention), whose windowed groups free their blocks behind the window while requests run. A chunk
holds every group's layers; a load fills, of a windowed group, only the blocks vLLM allocated inside
its window, and every load is asynchronous (vLLM takes a failed load of such an engine only as a
failed request, which it recomputes whole).

The rounds below are shared with the MLA tests: one engine stores, then hits from the CPU, disk and
Redis tiers, and a load whose disk chunks vanish between lookup and load is recomputed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.bench.engine_core import run_engine_core
from kvtier.bench.harness import (
    Outputs,
    generate_each,
    kv_transfer_config,
    running_engine,
)
from kvtier.bench.introspect import scheduler_connector
from kvtier.bench.models import build_gemma3_model, build_granite_hybrid_model
from tests.e2e.family_cases import (
    CHUNK,
    HIT,
    MAX_TOKENS,
    PREEMPTION_PROMPTS,
    PROMPTS,
    check_preemption,
    check_tier_rounds,
    run_preemption,
    run_tier_rounds,
)
from tests.e2e.oracle import (
    PREEMPTION_ENGINE,
    PREEMPTION_MAX_TOKENS,
    assert_same_outputs,
)
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e

# The KV cache groups vLLM's hybrid manager makes of the model, as the namespace names them.
GEMMA3_GROUPS = "/groups:SlidingWindowSpec(63)x1,SlidingWindowSpec(63)x1,FullAttentionSpecx1"


# ------------------------------------------------------------------------------ the Gemma-3 tests
@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_gemma3_model(tmp_path_factory.mktemp("models") / "tiny-gemma3"))


@pytest.fixture(scope="module")
def baseline(gemma3: str) -> dict[str, Outputs]:
    """Outputs of the engine without a connector (hybrid KV cache manager on), prompts one at a time."""
    with running_engine(gemma3) as llm:
        return {
            "prompts": generate_each(llm, PROMPTS, MAX_TOKENS),
            "preemption": generate_each(llm, PREEMPTION_PROMPTS, PREEMPTION_MAX_TOKENS),
        }


def test_outputs_vary_so_the_oracle_can_fail(baseline: dict[str, Outputs]) -> None:
    for tokens in baseline["prompts"].tokens + baseline["preemption"].tokens:
        assert len(set(tokens)) > len(tokens) // 2, f"the random model repeats itself: {tokens}"


def test_hits_from_every_tier_and_a_failed_load(
    gemma3: str, baseline: dict[str, Outputs], redis_server, tmp_path: Path
) -> None:
    expected = baseline["prompts"]
    rounds = run_tier_rounds(gemma3, tmp_path, redis_server.url, expected, expected, expected.tokens[0])
    assert rounds.spec.kv_layout.endswith(GEMMA3_GROUPS), rounds.spec.kv_layout
    check_tier_rounds(rounds, block=32, groups=3)


def test_preempted_request_reloads_its_chunks(
    gemma3: str, baseline: dict[str, Outputs], tmp_path: Path
) -> None:
    # Three groups draw on one pool: 16 blocks hold one request of max_model_len, not both prompts.
    run = run_preemption(gemma3, tmp_path, 32, **{**PREEMPTION_ENGINE, "num_gpu_blocks_override": 16})
    check_preemption(run, baseline["preemption"], block=32)


def test_async_scheduling_stores_then_hits(gemma3: str, tmp_path: Path) -> None:
    """vLLM's GPU default, forced on: saves planned while the previous step still runs, loads of every
    group, and outputs as the same engine's without a connector."""
    expected = run_engine_core(gemma3, PROMPTS, MAX_TOKENS)
    assert expected.async_scheduling
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        stored = run_engine_core(gemma3, PROMPTS, MAX_TOKENS, cfg)
        hit = run_engine_core(gemma3, PROMPTS, MAX_TOKENS, cfg)
    for run in (stored, hit):
        assert run.async_scheduling
        assert_same_outputs(expected.outputs, run.outputs)
    assert stored.connector_totals["external_tokens"] == 0
    assert hit.connector_totals["external_tokens"] == hit.connector_totals["hit_tokens_cpu"] == HIT


def test_a_state_space_hybrid_leaves_kvtier_idle(tmp_path: Path) -> None:
    """Granite-4-shaped (Mamba-2 + attention): vLLM starts it with its hybrid manager on, and kvtier
    stays idle, naming the Mamba group (a chunk of blocks cannot hold a state-space layer's state).
    vLLM's CPU build itself then fails the model's first step, with or without a connector
    (``IndexError`` in ``mamba_mixer2``), so no generation is tried here."""
    model = str(build_granite_hybrid_model(tmp_path / "tiny-granite-hybrid"))
    with running_engine(model, kv_transfer_config()) as llm:
        idle = scheduler_connector(llm)._idle
    assert re.search(r"this engine has a KV cache group of MambaSpec$", idle), idle
