"""What the end-to-end tests hold kvtier to: outputs identical to the same engine's without a connector.

Also the engine shape that forces a preemption, for the tests that check the oracle under one.
"""

from __future__ import annotations

from kvtier.bench.harness import Outputs


def assert_same_outputs(expected: Outputs, actual: Outputs) -> None:
    """Fail with the first differing token when two runs' greedy outputs are not identical."""
    problem = expected.diff(actual)
    assert not problem, f"outputs differ: {problem}"


# Forced preemption, as traced in the facts file: two 34-token prompts, 35 new tokens each, and four
# usable 32-token blocks (one of the five is the null block) cannot hold both requests at once.
PREEMPTION_ENGINE = dict(max_model_len=128, num_gpu_blocks_override=5)
PREEMPTION_PROMPT_LEN = 34
PREEMPTION_MAX_TOKENS = 35
