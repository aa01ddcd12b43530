"""The benchmarks' split of an engine's time into one vLLM call and kvtier's hooks (bench/phases.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.bench.engine_proc import Sample, engine_clock, hook_ms, kvtier_bypassed, phase_ms, time_prompt
from kvtier.bench.introspect import model_runner
from kvtier.bench.phases import PhaseClock


class _Clock:
    """A stand-in for time.perf_counter that each test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Runner:
    def __init__(self, clock: _Clock, connector: Any) -> None:
        self.clock, self.connector = clock, connector

    def _model_forward(self) -> str:
        self.clock.now += 0.100
        self.connector.wait_for_layer_load("layer.0")  # a per-layer hook, inside the forward
        self.clock.now += 0.050
        return "hidden"


class _Connector:
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.clock.now += 0.002

    def wait_for_save(self) -> None:
        self.clock.now += 0.010

    def get_finished(self, finished: set[str]) -> tuple[set[str], set[str]]:
        self.clock.now += 0.004
        raise RuntimeError("boom")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr("kvtier.bench.phases.time.perf_counter", fake)
    return fake


def test_hooks_inside_the_forward_count_as_kvtier_and_not_as_forward(clock: _Clock) -> None:
    connector = _Connector(clock)
    runner = _Runner(clock, connector)
    phases = PhaseClock()
    phases.time_span(runner, "_model_forward")
    phases.time_hooks(connector, ["wait_for_layer_load", "wait_for_save", "not_a_method"])

    assert runner._model_forward() == "hidden"
    assert runner._model_forward() == "hidden"
    connector.wait_for_save()
    took = phases.take()
    assert took.span == pytest.approx(0.300)  # two forwards of 0.152, their hooks left out
    assert took.calls == 2
    assert took.hooks == pytest.approx(0.014)
    assert took.by_hook == pytest.approx({"wait_for_layer_load": 0.004, "wait_for_save": 0.010})
    # take() starts afresh
    again = phases.take()
    assert (again.span, again.hooks, again.calls) == (0.0, 0.0, 0)
    assert again.by_hook == {"wait_for_layer_load": 0.0, "wait_for_save": 0.0}


def test_a_hook_that_raises_is_still_counted_and_restore_puts_the_methods_back(clock: _Clock) -> None:
    connector = _Connector(clock)
    phases = PhaseClock()
    phases.time_hooks(connector, ["get_finished", "wait_for_save"])
    assert "get_finished" in vars(connector)

    clock.now = 1.0
    with pytest.raises(RuntimeError, match="boom"):
        connector.get_finished(set())
    assert phases.take().hooks == pytest.approx(0.004)
    connector.wait_for_save()
    assert phases.take().hooks == pytest.approx(0.010)

    phases.restore()
    assert "get_finished" not in vars(connector) and "wait_for_save" not in vars(connector)
    connector.wait_for_save()
    assert phases.take().hooks == 0.0  # no longer timed


def test_bypassing_kvtier_keeps_the_timers_it_shadowed() -> None:
    class Scheduler:
        lookups = 0

        def on_new_request(self, request: Any) -> None:
            self.lookups += 1

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 5, False

    connector = Scheduler()
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            engine_core=SimpleNamespace(
                engine_core=SimpleNamespace(scheduler=SimpleNamespace(connector=connector))
            )
        )
    )
    phases = PhaseClock()
    phases.time_hooks(connector, ["get_num_new_matched_tokens"])
    timer = vars(connector)["get_num_new_matched_tokens"]

    with kvtier_bypassed(llm):
        connector.on_new_request(None)  # no lookup is sent while bypassed
        assert connector.lookups == 0
        assert connector.get_num_new_matched_tokens(None, 0) == (0, False)
        assert "build_connector_meta" in vars(connector)
    assert vars(connector)["get_num_new_matched_tokens"] is timer  # the timer, not the stand-in
    assert "build_connector_meta" not in vars(connector)  # nothing was there before: removed
    assert connector.get_num_new_matched_tokens(None, 0) == (5, False)
    connector.on_new_request(None)
    assert connector.lookups == 1


def test_model_runner_is_found_under_the_worker_wrapper_or_the_worker() -> None:
    runner = object()
    wrapped = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
    bare = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
    for executor in (wrapped, bare):
        llm = SimpleNamespace(
            llm_engine=SimpleNamespace(
                engine_core=SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))
            )
        )
        assert model_runner(llm) is runner
    empty = SimpleNamespace(
        llm_engine=SimpleNamespace(
            engine_core=SimpleNamespace(engine_core=SimpleNamespace(model_executor=SimpleNamespace()))
        )
    )
    with pytest.raises(RuntimeError, match="no model runner"):
        model_runner(empty)


def _engine(runner: Any, scheduler_connector: Any) -> Any:
    """An in-process LLM as bench/introspect.py reaches into it."""
    core = SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
        scheduler=SimpleNamespace(connector=scheduler_connector),
    )
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core)))


def test_time_prompt_splits_one_prompt_into_the_forward_kvtier_hooks_and_the_rest(
    clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _Connector(clock)
    runner = _Runner(clock, worker)
    llm = _engine(runner, SimpleNamespace())  # a scheduler side without hooks of its own
    monkeypatch.setattr("kvtier.bench.engine_proc.worker_connector", lambda: worker)
    prompts: list[list[int]] = []

    def generate(engine: Any, batch: list[list[int]], max_tokens: int) -> None:
        assert engine is llm and max_tokens == 1
        prompts.extend(batch)
        clock.now += 0.020  # vLLM's own work
        runner._model_forward()
        worker.wait_for_save()

    monkeypatch.setattr("kvtier.bench.engine_proc.generate", generate)
    timer = engine_clock(llm, kvtier=True)
    clock.now += 5.0  # before the prompt: not counted
    sample = time_prompt(llm, timer, [1, 2, 3])
    assert prompts == [[1, 2, 3]]
    assert sample.ttft == pytest.approx(0.182)
    assert sample.forward == pytest.approx(0.150)  # its per-layer hook left out
    assert sample.by_hook == pytest.approx(
        {"wait_for_layer_load": 0.002, "wait_for_save": 0.010, "get_finished": 0.0}
    )
    assert sample.kvtier == pytest.approx(0.012)

    timer.restore()
    assert "wait_for_save" not in vars(worker)
    plain = engine_clock(llm, kvtier=False)  # an engine without kvtier: the forward alone
    sample = time_prompt(llm, plain, [4])
    assert (sample.ttft, sample.forward, sample.by_hook) == (pytest.approx(0.182), pytest.approx(0.152), {})


def test_phase_and_hook_medians_of_samples_in_ms() -> None:
    samples = [
        Sample(0.010, 0.006, {"load": 0.001, "lookup": 0.002}),
        Sample(0.020, 0.012, {"load": 0.003}),  # no lookup: counted as 0
        Sample(0.030, 0.015, {"load": 0.002, "lookup": 0.004}),
    ]
    # kvtier: 3, 3 and 6 ms; other: 1, 5 and 9 ms
    assert phase_ms(samples) == pytest.approx({"forward": 12.0, "kvtier": 3.0, "other": 5.0})
    assert hook_ms(samples) == pytest.approx({"load": 2.0, "lookup": 2.0})
