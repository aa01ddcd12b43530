"""The oracle itself can fail: a difference in one output token is reported and fails the comparison.

vLLM's own behaviour (greedy outputs repeat, a forced preemption keeps them, an engine in a process
of its own answers as one in this process) is not tested here: every end-to-end test depends on it
and compares against it, and the tests that force a preemption assert that one happened.
"""

from __future__ import annotations

import pytest

from kvtier.bench.harness import Outputs
from tests.e2e.oracle import assert_same_outputs


def test_oracle_reports_a_difference() -> None:
    a = Outputs([[1, 2, 3], [4, 5, 6]])
    b = Outputs([[1, 2, 3], [4, 9, 6]])
    assert "prompt 1 differs at output token 1" in a.diff(b)
    with pytest.raises(AssertionError):
        assert_same_outputs(a, b)
