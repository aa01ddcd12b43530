"""The harness itself works: the engine generates, preemption really happens, layouts agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.harness import Outputs, generate, generate_each, make_prompt, preemptions, running_engine
from tests.e2e.engine_script import run_engine_process
from tests.e2e.oracle import (
    PREEMPTION_ENGINE,
    PREEMPTION_MAX_TOKENS,
    PREEMPTION_PROMPT_LEN,
    assert_same_outputs,
)

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_engine_generates_deterministically(tiny_model: str) -> None:
    prompts = [make_prompt(1, 70), make_prompt(2, 100)]
    with running_engine(tiny_model) as llm:
        first = generate(llm, prompts, max_tokens=12)
        second = generate(llm, prompts, max_tokens=12)
    assert [len(t) for t in first.tokens] == [12, 12]
    assert_same_outputs(first, second)
    assert first.tokens[0] != first.tokens[1]


def test_forced_preemption_happens_and_keeps_outputs(tiny_model: str) -> None:
    prompts = [make_prompt(11, PREEMPTION_PROMPT_LEN), make_prompt(12, PREEMPTION_PROMPT_LEN)]
    with running_engine(tiny_model, **PREEMPTION_ENGINE) as llm:
        together = generate(llm, prompts, PREEMPTION_MAX_TOKENS)
        assert preemptions(llm) >= 1, "two requests in four blocks must preempt one of them"
        before = preemptions(llm)
        alone = generate_each(llm, prompts, PREEMPTION_MAX_TOKENS)
        assert preemptions(llm) == before, "one request at a time fits without preemption"
    assert_same_outputs(alone, together)


def test_oracle_reports_a_difference() -> None:
    a = Outputs([[1, 2, 3], [4, 5, 6]])
    b = Outputs([[1, 2, 3], [4, 9, 6]])
    assert "prompt 1 differs at output token 1" in a.diff(b)
    with pytest.raises(AssertionError):
        assert_same_outputs(a, b)


def test_multiprocess_layout_matches_in_process(tiny_model: str) -> None:
    prompts = [make_prompt(21, 80), make_prompt(22, 50)]
    with running_engine(tiny_model) as llm:
        expected = generate(llm, prompts, max_tokens=10)
    job = {"model": tiny_model, "prompts": prompts, "max_tokens": 10, "multiprocess": True}
    result = run_engine_process(job)
    assert_same_outputs(expected, Outputs(result["tokens"]))
