"""kv_load_failure_policy "fail": a load that fails fails its request, as vLLM defines it, and only it.

vLLM's scheduler (``_handle_invalid_blocks``) finishes a request whose external blocks the connector
reports failed with ``RequestStatus.FINISHED_ERROR``: its output ends with finish_reason "error" and
no token (the OpenAI server answers 500). The other requests of the engine go on. kvtier reports the
failed blocks exactly (``get_block_ids_with_load_errors``) and stores nothing the failed request
would have computed.

vLLM's prefix cache is on, as by default; its content is emptied (``forget_local``) before the round
whose prefixes must come from kvtier's disk tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.harness import (
    Outputs,
    generate,
    generate_each,
    kv_transfer_config,
    make_prompt,
    running_engine,
)
from kvtier.bench.introspect import scheduler_connector
from kvtier.storage.base import Tier
from tests.app import wait_until
from tests.e2e.oracle import assert_same_outputs
from tests.e2e.service import RunningService, running_service
from tests.reliability.conftest import delta, forget_local, local_hits, sched_counts, worker_counts

pytestmark = pytest.mark.e2e

CHUNK = 64
MAX_TOKENS = 12
PREFIX_TOKENS = 192  # three whole chunks of each prompt's 200-token prefix
# Two prefix groups: a request of A loses a chunk between its lookup and its load, B's loads succeed.
A = [make_prompt(500, 200) + make_prompt(501 + j, 21 + j) for j in range(2)]
B = [make_prompt(600, 200) + make_prompt(601 + j, 22 + j) for j in range(2)]


def _generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    """Each prompt's completion output (token ids and finish reason), all submitted together."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [r.outputs[0] for r in results]


def _finished(llm: Any, reason: str) -> int:
    """Requests vLLM counted as finished with this reason ("length", "error", ...)."""
    return sum(
        int(m.value)
        for m in llm.get_metrics()
        if m.name == "vllm:request_success" and m.labels.get("finished_reason") == reason
    )


def _quiet(svc: RunningService, disk_stores: int) -> dict[str, Any]:
    """Stats once the disk tier has counted disk_stores stores and no write or lease is pending."""

    def done() -> dict[str, Any] | None:
        stats = svc.stats()
        ready = stats["tiers"]["disk"]["stores"] >= disk_stores and not stats["write_queue_depth"]
        return stats if ready and not stats["leases_active"] else None

    stats = wait_until(done, 30)
    assert stats, f"the service did not settle with {disk_stores} disk stores: {svc.stats()}"
    return stats


def test_failed_load_fails_only_its_request_and_stores_nothing(tiny_model: str, tmp_path: Path) -> None:
    with running_engine(tiny_model) as llm:
        expected = generate_each(llm, [A[0], B[0], A[1], B[1]], MAX_TOKENS)
    disk = tmp_path / "disk"
    with running_service(tmp_path / "svc", disk_path=disk) as svc:
        cfg = kv_transfer_config(service_url=svc.url, chunk_size=CHUNK)
        cfg["kv_load_failure_policy"] = "fail"  # the README's flag, with the policy this test is about
        with running_engine(tiny_model, cfg) as llm:
            first = generate(llm, [A[0], B[0]], MAX_TOKENS)
            _quiet(svc, 2 * 3)
            # Only the disk tier holds the prefixes now: a hit is staged a step after its lookup.
            svc.clear(Tier.CPU)
            forget_local(llm)
            sched = scheduler_connector(llm)._sched
            original = sched._start_lookup

            def lookup_then_delete(st: Any, hashes: list[bytes], *args: Any, **kwargs: Any) -> Any:
                if list(st.request.prompt_token_ids) == A[1]:
                    # Behind the service's back: its index still lists the middle chunk, so A's
                    # lookup finds all three and the read of the middle one fails.
                    (path,) = disk.rglob(f"{hashes[1].hex()}.kvt")
                    path.unlink()
                return original(st, hashes, *args, **kwargs)

            sched._start_lookup = lookup_then_delete
            before, s0, w0, local0 = svc.stats(), sched_counts(llm), worker_counts(), local_hits(llm)
            errors0 = _finished(llm, "error")
            failed, ok = _generate(llm, [A[1], B[1]])
            sched._start_lookup = original
            lookups, loads = delta(sched_counts(llm), s0), delta(worker_counts(), w0)
            local = local_hits(llm) - local0
            after = _quiet(svc, 0)
            # vLLM got back every block of the failed request; A again finds only its first chunk.
            forget_local(llm)
            s1 = sched_counts(llm)
            again = generate(llm, [A[1]], MAX_TOKENS)
            rerun = delta(sched_counts(llm), s1)
            errors = _finished(llm, "error") - errors0
    assert_same_outputs(Outputs(expected.tokens[:2]), first)
    assert (failed.finish_reason, list(failed.token_ids)) == ("error", []), failed
    assert ok.finish_reason == "length"
    assert_same_outputs(Outputs(expected.tokens[3:]), Outputs([list(ok.token_ids)]))
    assert_same_outputs(Outputs(expected.tokens[2:3]), again)
    assert errors == 1, "vLLM counted the failed request as finished with an error"
    # Both prefixes were asked of kvtier (vLLM's own cache was empty) and promised from disk.
    assert local == 0
    assert lookups["external_tokens"] == 2 * PREFIX_TOKENS, lookups
    # Exactly A's middle chunk failed (two 32-token blocks); A's other two and B's three were copied.
    assert loads["failed_load_chunks"] == 1 and loads["failed_load_blocks"] == CHUNK // 32, loads
    assert loads["loaded_chunks"] == 5, loads
    # Nothing computed in that round was stored: no save at all, no disk write, the removed chunk gone.
    assert loads["saved_chunks"] == 0, loads
    disk0, disk1 = before["tiers"]["disk"], after["tiers"]["disk"]
    assert disk1["stores"] == disk0["stores"] and disk1["chunks"] == 5, disk1
    assert disk1["errors_by_kind"] == {"missing": 1}, disk1
    assert rerun["external_tokens"] == CHUNK, rerun
    assert after["leases_active"] == 0
