"""Real vLLM engines on the CPU build, for benchmarks and end-to-end tests: start, generate greedily.

An engine runs in the calling process unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` says otherwise;
``Outputs`` holds its greedy token ids, which the tests' oracle compares with another run's.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# Scheduler and worker in this process: ~3 s per engine instead of ~20 s. Set before vLLM reads it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's CPU build reserves one more core whenever a KV connector is configured, which changes the
# OpenMP thread count (and with it bf16 rounding) between runs with and without kvtier. Pin it.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

BLOCK_SIZE = 32
KV_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class Outputs:
    """Greedy token ids per prompt, in prompt order."""

    tokens: list[list[int]]

    def diff(self, other: Outputs) -> str:
        """A human-readable account of the first difference, or '' when equal."""
        if len(self.tokens) != len(other.tokens):
            return f"{len(self.tokens)} outputs vs {len(other.tokens)}"
        for i, (a, b) in enumerate(zip(self.tokens, other.tokens, strict=True)):
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                at = min(len(a), len(b)) if at is None else at
                return f"prompt {i} differs at output token {at}: {a[at : at + 8]} vs {b[at : at + 8]}"
        return ""


def make_prompt(seed: int, length: int, vocab_size: int = 1024) -> list[int]:
    """A deterministic prompt of token ids (special ids 0 and 1 avoided)."""
    rng = random.Random(seed)
    return [rng.randrange(2, vocab_size) for _ in range(length)]


def kv_transfer_config(**extra: Any) -> dict[str, Any]:
    """The README's kv-transfer-config (the connector found by name, through kvtier's vLLM plugin),
    with connector extra config."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def engine_kwargs(model: str, kv_config: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """Engine arguments that work on the CPU build with the tiny model."""
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=1024,
        seed=0,
        disable_log_stats=False,
    )
    if kv_config is not None:
        kwargs["kv_transfer_config"] = json.loads(json.dumps(kv_config))
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def heap_kept_frozen() -> Iterator[None]:
    """Freeze the garbage collector's view of the heap as it is, and keep it frozen while the block
    runs: vLLM's own gc.freeze() and gc.unfreeze() calls do nothing meanwhile.

    An in-process engine collects the whole heap six or seven times between its start and its stop
    (vLLM freezes at start, unfreezes at shutdown, collects around both), each pass over every
    object vLLM's imports left (docs/performance.md, "Cheaper engine tests"). Kept frozen, the
    passes walk only the engine's own objects, which stay collectable, so the engine is still freed
    when it stops.
    """
    gc.collect()
    gc.freeze()
    freeze, unfreeze = gc.freeze, gc.unfreeze
    gc.freeze = gc.unfreeze = _keep_frozen
    try:
        yield
    finally:
        gc.freeze, gc.unfreeze = freeze, unfreeze


def _keep_frozen() -> None:
    """Stands in for gc.freeze and gc.unfreeze inside heap_kept_frozen()."""


@contextlib.contextmanager
def running_engine(model: str, kv_config: dict[str, Any] | None = None, **overrides: Any) -> Iterator[Any]:
    """A vLLM LLM on the CPU build, shut down (connector included) on every path."""
    from vllm import LLM

    with heap_kept_frozen():
        llm = LLM(**engine_kwargs(model, kv_config, **overrides))
        try:
            yield llm
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def generate(llm: Any, prompts: Sequence[list[int]], max_tokens: int = 16) -> Outputs:
    """Greedy outputs of all prompts submitted together (they run concurrently)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return Outputs([list(r.outputs[0].token_ids) for r in results])


def generate_each(llm: Any, prompts: Sequence[list[int]], max_tokens: int = 16) -> Outputs:
    """Greedy outputs of the prompts submitted one at a time."""
    out: list[list[int]] = []
    for prompt in prompts:
        out.extend(generate(llm, [prompt], max_tokens).tokens)
    return Outputs(out)


def metric(llm: Any, name: str) -> float:
    """Sum of a vLLM counter or gauge over its label sets (e.g. 'vllm:num_preemptions')."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and hasattr(m, "value"):
            total += float(m.value)
    return total


def preemptions(llm: Any) -> int:
    """How many times vLLM's scheduler preempted a request in this engine."""
    return int(metric(llm, "vllm:num_preemptions"))
