"""Isolation on one shared service: the same prompts under another model, revision, set of weights,
LoRA adapter or cache salt never hit each other's chunks, and hit their own.

Each variant runs the prompts twice: the first round must find nothing (every other variant's chunks
are already stored) and store its own; the second must load exactly its own, with the same outputs.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest

from kvtier.bench.harness import Outputs, kv_transfer_config, make_prompt, running_engine
from kvtier.bench.introspect import scheduler_connector, scheduler_totals
from kvtier.bench.models import TINY, build_lora_adapter, build_model
from tests.app import wait_until
from tests.e2e.oracle import assert_same_outputs
from tests.e2e.service import RunningService, running_service

pytestmark = pytest.mark.e2e

# Local prefix caching off: a repeated prompt can only reuse KV through kvtier.
NO_LOCAL_CACHE = dict(enable_prefix_caching=False)
CHUNK = 64
# 200 and 140 tokens hold 3 and 2 full chunks; 4 new tokens complete no further chunk.
PROMPTS = [make_prompt(700, 200), make_prompt(701, 140)]
CHUNKS_PER_ROUND = 5
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's shape and tokenizer with other random weights, at another path."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama-other"
    return str(build_model(path, replace(TINY, seed=4321)))


def _generate(llm: Any, prompts: Sequence[list[int]], salt: str | None, lora: Any) -> Outputs:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    inputs: list[Any] = [{"prompt_token_ids": list(p)} for p in prompts]
    if salt is not None:
        for one in inputs:
            one["cache_salt"] = salt
    results = llm.generate(inputs, params, lora_request=lora, use_tqdm=False)
    return Outputs([list(r.outputs[0].token_ids) for r in results])


def _cpu_chunks(svc: RunningService) -> int:
    return int(svc.stats()["tiers"]["cpu"]["chunks"])


def _external_tokens(llm: Any) -> int:
    """Tokens the scheduler side has taken from kvtier since the engine started."""
    return int(scheduler_totals(llm).get("external_tokens", 0))


def run_variant(llm: Any, svc: RunningService, salt: str | None = None, lora: Any = None) -> Outputs:
    """Both rounds of one variant: no hit at first, then exactly its own chunks; returns the outputs."""
    stored = _cpu_chunks(svc)
    hits = sum(svc.hit_tokens().values())
    external = _external_tokens(llm)
    first = _generate(llm, PROMPTS, salt, lora)
    assert sum(svc.hit_tokens().values()) == hits, "a variant hit chunks stored under another"
    assert _external_tokens(llm) == external
    # Its chunks are new ones, stored beside the others' (their saves end after the outputs).
    want = stored + CHUNKS_PER_ROUND
    assert wait_until(lambda: _cpu_chunks(svc) == want, 20), f"{_cpu_chunks(svc)} chunks, not {want}"
    second = _generate(llm, PROMPTS, salt, lora)
    assert _external_tokens(llm) - external == CHUNKS_PER_ROUND * CHUNK
    assert sum(svc.hit_tokens().values()) - hits >= CHUNKS_PER_ROUND * CHUNK
    assert_same_outputs(first, second)
    return first


def run_engine_variant(model: str, svc: RunningService, **engine: Any) -> tuple[Outputs, str]:
    """One engine on the shared service: its outputs and the namespace it stored under."""
    cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
    with running_engine(model, cfg, **NO_LOCAL_CACHE, **engine) as llm:
        return run_variant(llm, svc), scheduler_connector(llm).snapshot().namespace


def test_two_models_never_share_chunks(tiny_model: str, second_model: str, tmp_path: Path) -> None:
    with running_service(tmp_path / "svc") as svc:
        first, ns_first = run_engine_variant(tiny_model, svc)
        second, ns_second = run_engine_variant(second_model, svc)
        assert svc.stats()["namespaces"] == 2
    assert ns_first != ns_second
    assert first.tokens != second.tokens, "the two models compute different KV"


def _fake_hub(root: Path, revisions: dict[str, str]) -> None:
    """A Hugging Face cache holding model kvtier/tiny: branch name -> the model directory it holds."""
    repo = root / "models--kvtier--tiny"
    (repo / "refs").mkdir(parents=True)
    for i, (branch, model) in enumerate(revisions.items()):
        commit = f"{i + 1:040x}"
        shutil.copytree(model, repo / "snapshots" / commit)
        (repo / "refs" / branch).write_text(commit)


def test_two_revisions_of_a_hub_model_never_share_chunks(
    tiny_model: str, second_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hub"
    _fake_hub(hub, {"main": tiny_model, "v2": second_model})
    # Offline, vLLM resolves a model id and revision to its snapshot in this cache.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    with running_service(tmp_path / "svc") as svc:
        main, ns_main = run_engine_variant("kvtier/tiny", svc, revision="main")
        v2, ns_v2 = run_engine_variant("kvtier/tiny", svc, revision="v2")
        assert svc.stats()["namespaces"] == 2
    assert ns_main != ns_v2
    assert main.tokens != v2.tokens


def test_weights_replaced_in_place_never_hit_the_old_chunks(
    tiny_model: str, second_model: str, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    with running_service(tmp_path / "svc") as svc:
        old, ns_old = run_engine_variant(str(model), svc)
        # Same path, same config, tokenizer and file size: only the weights' values change.
        shutil.copyfile(Path(second_model) / "model.safetensors", model / "model.safetensors")
        new, ns_new = run_engine_variant(str(model), svc)
        assert svc.stats()["namespaces"] == 2
    assert ns_old != ns_new
    assert old.tokens != new.tokens


def test_lora_adapters_and_the_base_model_never_share_chunks(tiny_model: str, tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    adapters = [build_lora_adapter(tmp_path / f"lora-{seed}", TINY, seed=seed) for seed in (1, 2)]
    lora = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE, **lora) as llm:
            base = run_variant(llm, svc)
            a = run_variant(llm, svc, lora=LoRARequest("adapter-a", 1, str(adapters[0])))
            b = run_variant(llm, svc, lora=LoRARequest("adapter-b", 2, str(adapters[1])))
        # One engine, one namespace: vLLM's block hashes hold the adapter's name and path.
        assert svc.stats()["namespaces"] == 1
    assert len({str(base.tokens), str(a.tokens), str(b.tokens)}) == 3, "each adapter changes the KV"


def test_cache_salts_never_share_chunks(tiny_model: str, tmp_path: Path) -> None:
    with running_service(tmp_path / "svc") as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        with running_engine(tiny_model, cfg, **NO_LOCAL_CACHE) as llm:
            unsalted = run_variant(llm, svc)
            salted = [run_variant(llm, svc, salt=salt) for salt in ("tenant-a", "tenant-b")]
        assert svc.stats()["namespaces"] == 1
    # A salt changes no computation, only which requests may share KV.
    for outputs in salted:
        assert_same_outputs(unsalted, outputs)
