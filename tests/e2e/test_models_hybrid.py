"""A sliding-window hybrid (Gemma-3-shaped: sliding-window layers around a full-attention one).

kvtier's connector does not declare ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off:
every layer, sliding-window ones included, keeps all its blocks in one KV cache group of
``FullAttentionSpec`` and a chunk holds every layer's blocks. The baseline engine without a
connector runs with the hybrid manager on; only outputs are compared, and they must be identical.

The rounds below are shared with the MLA tests: one engine stores, then hits from the CPU, disk and
Redis tiers, and a load whose disk chunks vanish between lookup and load is recomputed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.bench.harness import (
    Outputs,
    generate_each,
    kv_transfer_config,
    running_engine,
)
from kvtier.bench.models import build_gemma3_model, build_granite_hybrid_model
from tests.e2e.family_cases import (
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
)

pytestmark = pytest.mark.e2e


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
    check_tier_rounds(rounds, block=32)


def test_preempted_request_reloads_its_chunks(
    gemma3: str, baseline: dict[str, Outputs], tmp_path: Path
) -> None:
    run = run_preemption(gemma3, tmp_path, 32, **PREEMPTION_ENGINE)
    check_preemption(run, baseline["preemption"], block=32)


def test_a_state_space_hybrid_is_refused_by_vllm_at_start(tmp_path: Path) -> None:
    """Granite-4-shaped (Mamba-2 + attention): without SupportsHMA vLLM turns its hybrid manager off
    and cannot put Mamba state and attention blocks in one group, before any connector exists."""
    model = str(build_granite_hybrid_model(tmp_path / "tiny-granite-hybrid"))
    refused = re.escape("Failed to promote local KV cache specs to one unified type.")
    with pytest.raises(ValueError, match=f"^{refused}$"), running_engine(model, kv_transfer_config()):
        pass
