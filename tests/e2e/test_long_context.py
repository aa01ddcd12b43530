"""A 32k-token prompt: its hits from the CPU tier and from disk give vLLM's own outputs, token for
token, and load every token but the last one vLLM computes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvtier.bench.harness import Outputs, generate_each, kv_transfer_config, make_prompt, running_engine
from kvtier.storage.base import Tier
from tests.e2e.oracle import assert_same_outputs, expected_external, forget_local_cache, wait_written
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e
CHUNK = 256
CONTEXT = 32768
PROMPT = make_prompt(3200, CONTEXT + 1)  # whole chunks and one token: a full hit leaves it to compute
MAX_TOKENS = 10
STORED = CONTEXT // CHUNK  # 128 chunks
HIT = expected_external(STORED, 0, len(PROMPT), CHUNK)
# The prompt and its output: 32 MiB of the tiny model's KV (1 KiB a token), which vLLM's cache
# (harness.KV_CACHE_BYTES) and the test service's 64 MiB CPU tier hold twice over.
ENGINE = dict(max_model_len=CONTEXT + 64)


@pytest.fixture(scope="module")
def long_model(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with positions for a 32k-token prompt (its weights and tokenizer copied)."""
    path = tmp_path_factory.mktemp("models") / "tiny-long"
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2 * CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def expected(long_model: str) -> Outputs:
    with running_engine(long_model, **ENGINE) as llm:
        return generate_each(llm, [PROMPT], MAX_TOKENS)


def test_32k_token_prompt_hits_from_cpu_then_disk_give_vllms_outputs(
    long_model: str, expected: Outputs, tmp_path: Path
) -> None:
    with running_service(tmp_path / "svc", disk_path=tmp_path / "disk") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(long_model, cfg, **ENGINE) as llm:
            assert_same_outputs(expected, generate_each(llm, [PROMPT], MAX_TOKENS))  # a miss: stored
            wait_written(svc, "disk", STORED)
            assert svc.stats()["tiers"]["cpu"]["chunks"] == STORED
            forget_local_cache(llm)
            assert_same_outputs(expected, generate_each(llm, [PROMPT], MAX_TOKENS))  # the CPU hit
            cpu_hits = svc.hit_tokens()
            assert svc.clear(Tier.CPU) == STORED
            forget_local_cache(llm)
            assert_same_outputs(expected, generate_each(llm, [PROMPT], MAX_TOKENS))  # the disk hit
            disk_hits = svc.hit_tokens()
    assert HIT == CONTEXT  # every chunk but the prompt's last token
    assert cpu_hits == {"cpu": HIT, "disk": 0, "redis": 0, "object": 0}
    assert disk_hits == {"cpu": HIT, "disk": HIT, "redis": 0, "object": 0}
