"""KV cache variants: `kv_cache_dtype` fp8 (e4m3 and e5m2) and `block_size` 64, with the tiny Llama.

Each variant runs the tier rounds (hits from the CPU, disk and Redis tiers, and a failed load) with
outputs token for token identical to the same engine (same dtype, same block size) without kvtier.
All variants share one service, one after the other: each one's first round finds the chunks the
variants before it stored for the same prompts, and must hit none of them (the namespace holds the
KV dtype setting and the block size). fp8_e4m3 and fp8_e5m2 have the same page size and the same
block hashes, and vLLM keeps both in uint8 tensors: only `kv_cache_dtype` in the namespace keeps their
chunks apart (an e5m2 engine that loads e4m3 bytes gives other outputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvtier.bench.harness import BLOCK_SIZE, Outputs, generate_each, running_engine
from kvtier.bench.models import TINY
from tests.e2e.family_cases import MAX_TOKENS, NO_HITS, PROMPTS, TierRounds, check_tier_rounds, tier_rounds_on
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e

# In the order they run on the shared service: fp8_e4m3 follows an engine of the default dtype (and
# another block size), fp8_e5m2 follows fp8_e4m3.
VARIANTS: dict[str, dict[str, Any]] = {
    "block_size_64": dict(block_size=64),
    "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
    "fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
}
# What each variant's namespace must name: KV dtype (the setting where it is not "auto", and the
# tensors' dtype) and block size; and the bytes of one KV element.
EXPECTED_SPEC = {
    "block_size_64": ("torch.bfloat16", 64, 2),
    "fp8_e4m3": ("fp8_e4m3/torch.uint8", BLOCK_SIZE, 1),
    "fp8_e5m2": ("fp8_e5m2/torch.uint8", BLOCK_SIZE, 1),
}


@dataclass(frozen=True)
class VariantRun:
    """One variant's rounds on the shared service, and the namespaces the service knew after them."""

    rounds: TierRounds
    namespaces_after: int


@pytest.fixture(scope="module")
def baselines(tiny_model: str) -> dict[str, Outputs]:
    """Outputs of each variant's engine without a connector, prompts one at a time."""
    out = {}
    for name, engine in VARIANTS.items():
        with running_engine(tiny_model, **engine) as llm:
            out[name] = generate_each(llm, PROMPTS, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def variant_runs(
    tiny_model: str,
    baselines: dict[str, Outputs],
    redis_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, VariantRun]:
    """Every variant's rounds, in VARIANTS' order, on one service with a disk tier and Redis."""
    tmp = tmp_path_factory.mktemp("kv-variants")
    disk = tmp / "disk"
    runs = {}
    with running_service(tmp / "svc", disk_path=disk, redis_url=redis_server.url) as svc:
        for name, engine in VARIANTS.items():
            expected = baselines[name]
            rounds = tier_rounds_on(svc, disk, tiny_model, expected, expected, expected.tokens[0], **engine)
            runs[name] = VariantRun(rounds, svc.stats()["namespaces"])
    return runs


def test_outputs_vary_so_the_oracle_can_fail(baselines: dict[str, Outputs]) -> None:
    for outputs in baselines.values():
        for tokens in outputs.tokens:
            assert len(set(tokens)) > len(tokens) // 2, f"the random model repeats itself: {tokens}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hits_from_every_tier_and_a_failed_load(variant: str, variant_runs: dict[str, VariantRun]) -> None:
    block = VARIANTS[variant].get("block_size", BLOCK_SIZE)
    check_tier_rounds(variant_runs[variant].rounds, block)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_namespace_names_the_variant(variant: str, variant_runs: dict[str, VariantRun]) -> None:
    """kvtier saw the engine's own KV dtype and block size, and chunks of its page size."""
    spec = variant_runs[variant].rounds.spec
    kv_dtype, block, itemsize = EXPECTED_SPEC[variant]
    assert (spec.kv_dtype, spec.block_size) == (kv_dtype, block)
    assert spec.page_bytes == TINY.kv_bytes_per_token_of(itemsize) // TINY.num_layers * block


def test_variants_on_one_service_never_hit_each_others_chunks(variant_runs: dict[str, VariantRun]) -> None:
    runs = list(variant_runs.values())
    # Each engine registered a namespace of its own beside those of the engines before it ...
    assert [run.namespaces_after for run in runs] == [1, 2, 3]
    assert len({run.rounds.namespace for run in runs}) == len(runs)
    # ... and its first round, with their chunks of the same prompts held in Redis, hit nothing.
    assert [run.rounds.hits["cold"] for run in runs] == [NO_HITS] * len(runs)
