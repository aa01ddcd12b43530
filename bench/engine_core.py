"""Drive vllm.v1.engine.core.EngineCore directly, so async scheduling can be forced on the CPU build."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.bench.harness import Outputs, engine_kwargs


@dataclass
class CoreRun:
    """Outputs of one EngineCore run, and what the scheduler saw."""

    outputs: Outputs
    preemptions: int
    async_scheduling: bool  # vLLM ran its AsyncScheduler
    connector_totals: dict[str, Any]


def run_engine_core(
    model: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    kv_config: dict[str, Any] | None = None,
    async_scheduling: bool = True,
    on_start: Callable[[Any], None] | None = None,
    **overrides: Any,
) -> CoreRun:
    """Run the prompts together to completion on an EngineCore; shut it down on every path."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.engine import EngineCoreEventType
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor

    PREEMPTED = EngineCoreEventType.PREEMPTED
    kwargs = engine_kwargs(model, kv_config, **overrides)
    kwargs.pop("disable_log_stats", None)
    config = EngineArgs(**kwargs).create_engine_config()
    config.scheduler_config.async_scheduling = async_scheduling
    core = EngineCore(config, Executor.get_class(config), log_stats=True)
    try:
        if on_start is not None:
            on_start(core)
        _add_requests(core, prompts, max_tokens)
        tokens: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
        preempted = 0
        deadline = time.monotonic() + 600
        while core.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("EngineCore did not finish the requests")
            outputs, _ = core.step_fn()
            for engine_outputs in (outputs or {}).values():
                for out in engine_outputs.outputs:
                    tokens[out.request_id].extend(out.new_token_ids)
                    # vLLM's own preemption events (what its num_preemptions metric counts).
                    preempted += sum(1 for ev in out.events or () if ev.type == PREEMPTED)
        sched_conn = getattr(core.scheduler, "connector", None)  # vLLM's Scheduler has one
        totals = sched_conn.snapshot().totals if sched_conn is not None else {}
        return CoreRun(
            Outputs([tokens[f"req-{i}"] for i in range(len(prompts))]),
            preempted,
            isinstance(core.scheduler, AsyncScheduler),
            totals,
        )
    finally:
        core.shutdown()


def _add_requests(core: Any, prompts: Sequence[list[int]], max_tokens: int) -> None:
    """Hand the prompts to the EngineCore as requests req-0, req-1, ... (greedy, max_tokens each)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        request = EngineCoreRequest(
            request_id=f"req-{i}",
            prompt_token_ids=list(prompt),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        core.add_request(*core.preprocess_add_request(request))
