"""vLLM's cache reset with the connector (``reset_prefix_cache(reset_connector=True)``, as after a
weight update): the engine never loads a chunk stored before it, and stores and serves anew after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.bench.engine_proc import kvtier_bypassed
from kvtier.bench.harness import generate, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import model_runner
from tests.app import wait_until
from tests.e2e.oracle import assert_same_outputs, forget_local_cache
from tests.e2e.service import running_service

pytestmark = pytest.mark.e2e
CHUNK = 64
PROMPT = make_prompt(700, 200)  # 3 full chunks
CHUNKS = len(PROMPT) // CHUNK


def _new_weights(llm: Any) -> None:
    """Change the model's token embeddings in place, as a weight update would (a tensor the forward
    reads as it is: on the CPU build, scaling the attention layers' weight tensors changed no output)."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, param in model_runner(llm).model.named_parameters():
            if "embed_tokens" in name:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype)
                param.add_(noise * param.float().std().to(param.dtype))


def test_after_a_reset_with_the_connector_old_chunks_are_never_loaded(
    tiny_model: str, tmp_path: Path
) -> None:
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg) as llm:
            generate(llm, [PROMPT], 8)  # stored under the old weights
            assert wait_until(lambda: svc.stats()["tiers"]["cpu"]["chunks"] == CHUNKS, 10)
            _new_weights(llm)
            forget_local_cache(llm)
            with kvtier_bypassed(llm):
                fresh = generate(llm, [PROMPT], 8)  # the new weights' own answer
            # The negative control: a reset of vLLM's cache alone leaves kvtier's old chunks in use.
            forget_local_cache(llm)
            before = svc.hit_tokens()["cpu"]
            stale = generate(llm, [PROMPT], 8)
            assert svc.hit_tokens()["cpu"] - before == CHUNKS * CHUNK
            assert stale.tokens != fresh.tokens, "the old weights' KV must show in the output"
            assert llm.reset_prefix_cache(reset_connector=True)
            before = svc.hit_tokens()
            after_reset = generate(llm, [PROMPT], 8)
            assert svc.hit_tokens() == before, "nothing stored before the reset is hit"
            # The new generation stores the new weights' chunks and serves them.
            assert wait_until(lambda: svc.stats()["tiers"]["cpu"]["chunks"] == 2 * CHUNKS, 10)
            forget_local_cache(llm)
            again = generate(llm, [PROMPT], 8)
            hits = svc.hit_tokens()["cpu"] - before["cpu"]
            namespaces = svc.stats()["namespace_specs"]
    assert_same_outputs(fresh, after_reset)
    assert_same_outputs(fresh, again)
    assert hits == CHUNKS * CHUNK
    assert len(namespaces) == 2 and sum("~gen:" in s["model"] for s in namespaces.values()) == 1
