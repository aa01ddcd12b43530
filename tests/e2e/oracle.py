"""What the end-to-end tests hold kvtier to, and the means to watch it on a real engine.

The oracle: outputs identical to the same engine's without a connector. The external-token rule
(Invariant 3) written out again here, so tests compute their expectations without the function under
test. The engine shape that forces a preemption. Probes that record, inside an engine running in this
process, what kvtier answered at each admission, what it planned to load and which blocks it
reported failed; and the waits a test needs (vLLM's own cache emptied, a tier's writes done).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.harness import BLOCK_SIZE, Outputs, generate
from tests.app import wait_until
from tests.e2e.service import RunningService


def assert_same_outputs(expected: Outputs, actual: Outputs) -> None:
    """Fail with the first differing token when two runs' greedy outputs are not identical."""
    problem = expected.diff(actual)
    assert not problem, f"outputs differ: {problem}"


# Forced preemption, as traced on the CPU build: two 34-token prompts, 35 new tokens each, and four
# usable 32-token blocks (one of the five is the null block) cannot hold both requests at once.
PREEMPTION_ENGINE = dict(max_model_len=128, num_gpu_blocks_override=5)
PREEMPTION_PROMPT_LEN = 34
PREEMPTION_MAX_TOKENS = 35


def expected_external(hit_chunks: int, local: int, num_tokens: int, chunk: int) -> int:
    """Tokens vLLM takes from kvtier by Invariant 3: kvtier's leading hit chunks, cut to whole blocks
    short of the last token (one is always left to compute), minus vLLM's own block-aligned hit."""
    loadable = (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    return max(0, min(hit_chunks * chunk, loadable) - local)


# A prompt shorter than a block: vLLM caches none of it and kvtier neither looks it up nor saves it.
_STEP_PROMPT = [2, 3, 4]


def forget_local_cache(llm: Any, timeout: float = 30) -> None:
    """Empty vLLM's own prefix cache, as memory pressure or a restart would.

    vLLM refuses while it still holds a finished request's blocks for kvtier's saves; it lets them
    go at a later engine step, so the engine is stepped with a prompt that touches no cache until
    vLLM agrees (bounded)."""
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise AssertionError(f"vLLM kept blocks held for {timeout} s: its prefix cache was not reset")
        generate(llm, [_STEP_PROMPT], 1)


def generate_each_cold(llm: Any, prompts: Sequence[list[int]], max_tokens: int) -> Outputs:
    """Greedy outputs of the prompts one at a time, each into an emptied vLLM cache (kvtier's stays)."""
    out: list[list[int]] = []
    for prompt in prompts:
        forget_local_cache(llm)
        out.extend(generate(llm, [prompt], max_tokens).tokens)
    return Outputs(out)


def wait_written(svc: RunningService, tier: str, chunks: int, timeout: float = 30) -> None:
    """Wait (bounded) until the write-behind queue has put `chunks` chunks into `tier`."""

    def written() -> bool:
        stats = svc.stats()
        return stats["write_queue_depth"] == 0 and stats["tiers"][tier]["stores"] >= chunks

    if not wait_until(written, timeout, interval=0.05):
        raise AssertionError(f"{tier} tier never stored {chunks} chunks: {svc.stats()}")


@dataclass(frozen=True)
class Admission:
    """kvtier's answer to vLLM for one request, as vLLM admitted it."""

    request_id: str
    preemptions: int  # vLLM's count for the request: > 0 is a re-admission
    num_tokens: int
    local: int  # vLLM's own hit, block-aligned
    hit_chunks: int  # leading chunks the service said it holds (0: no lookup was needed)
    external: int

    def expected(self, chunk: int) -> int:
        """External tokens the rule gives for this admission."""
        return expected_external(self.hit_chunks, self.local, self.num_tokens, chunk)


class Probe:
    """Records, inside an engine running in this process, kvtier's answers to vLLM's admissions, the
    loads its scheduler side planned and the blocks (or, in engines of several KV cache groups, the
    requests) its worker reported failed."""

    def __init__(self, scheduler_connector: Any, worker_connector: Any) -> None:
        self._answers: dict[tuple[str, int], Admission] = {}
        self.loads: dict[str, list[Any]] = {}  # request id -> the ChunkLoads planned for it
        self.failed_blocks: set[int] = set()
        self.failed_requests: set[str] = set()  # async loads failed whole (engines of several groups)
        self.worker = worker_connector._worker
        self._sched = sched = scheduler_connector._sched
        matched, meta = sched.get_num_new_matched_tokens, sched.build_connector_meta
        errors = worker_connector.get_block_ids_with_load_errors
        results = worker_connector.get_transfer_results

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            ext, is_async = matched(request, num_computed_tokens)
            if ext is not None:  # the last answer for a request is the one vLLM admitted it with
                key = (request.request_id, request.num_preemptions)
                hit = self._hit(request)
                self._answers[key] = Admission(*key, request.num_tokens, num_computed_tokens, hit, ext)
            return ext, is_async

        def build_connector_meta(so: Any) -> Any:
            built = meta(so)
            for job in built.loads:
                self.loads.setdefault(job.req_id, []).extend(job.chunks)
            return built

        def get_block_ids_with_load_errors() -> set[int]:
            failed = errors()
            self.failed_blocks |= failed
            return failed

        def get_transfer_results(finished_req_ids: set[str]) -> Any:
            got = results(finished_req_ids)
            self.failed_requests |= got.failed_recving
            return got

        sched.get_num_new_matched_tokens = get_num_new_matched_tokens
        sched.build_connector_meta = build_connector_meta
        worker_connector.get_block_ids_with_load_errors = get_block_ids_with_load_errors
        worker_connector.get_transfer_results = get_transfer_results

    def _hit(self, request: Any) -> int:
        answer = self._sched._reqs[request.request_id].answer
        return 0 if answer is None or answer.hit is None else answer.hit.num_hit

    def admissions(self) -> list[Admission]:
        """Every admission so far, in the order of their first answer."""
        return list(self._answers.values())

    def blocks_of(self, request_id: str, chunks: Iterable[int]) -> set[int]:
        """vLLM block ids the scheduler side planned to load for these chunks of a request."""
        wanted = set(chunks)
        return {b for c in self.loads.get(request_id, []) if c.index in wanted for b in c.block_ids}


def delete_after_lookup(
    sched_connector: Any, disk: Path, num_chunks: int, doomed: Iterable[int]
) -> list[str]:
    """Delete the disk files of chunks `doomed` of the first request with `num_chunks` chunks, behind
    the service's back, as its lookup goes out: the service's index still lists them, so the lookup
    finds them and the read that follows (ahead at arrival, or at load) fails; returns (and fills in)
    that request's id."""
    return damage_after_lookup(sched_connector, disk, num_chunks, dict.fromkeys(doomed, Path.unlink))


def damage_after_lookup(
    sched_connector: Any, disk: Path, num_chunks: int, damage: dict[int, Callable[[Path], object]]
) -> list[str]:
    """delete_after_lookup with any damage: damage[i](path) is done to chunk i's disk file."""
    sched = sched_connector._sched
    original = sched._start_lookup
    hit: list[str] = []

    def lookup_then_damage(st: Any, hashes: list[bytes], **kwargs: Any) -> Any:
        if not hit and len(hashes) == num_chunks:
            hit.append(st.request.request_id)
            for i, harm in damage.items():
                (path,) = disk.rglob(f"{hashes[i].hex()}.kvt")
                harm(path)
        return original(st, hashes, **kwargs)

    sched._start_lookup = lookup_then_damage
    return hit
