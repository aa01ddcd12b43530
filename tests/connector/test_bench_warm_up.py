"""The connector benchmark warms each engine up until every KV block was used once."""

from __future__ import annotations

import pytest

from kvtier.bench.models import BENCH
from kvtier.bench.ttft import warm_up_prompts


@pytest.mark.parametrize(
    ("kv_cache_bytes", "prompt_tokens"), [(512 << 20, 6 * 256 + 1), (64 << 20, 4096), (1 << 20, 1537)]
)
def test_warm_up_uses_every_kv_block(kv_cache_bytes: int, prompt_tokens: int) -> None:
    engine = {"kv_cache_memory_bytes": kv_cache_bytes}
    count = warm_up_prompts(engine, prompt_tokens)
    prompt_bytes = prompt_tokens * BENCH.kv_bytes_per_token
    assert count * prompt_bytes >= kv_cache_bytes  # the last prompt reaches the last block
    assert (count - 2) * prompt_bytes < kv_cache_bytes  # and no more than one prompt beyond it


def test_warm_up_of_the_benchmarks_engine() -> None:
    # 16 KiB of KV per token: 24 MiB per prompt, so 22 prompts go through a 512 MiB cache.
    assert warm_up_prompts({"kv_cache_memory_bytes": 512 << 20}, 6 * 256 + 1) == 22
