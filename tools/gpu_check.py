"""`python -m tools.gpu_check [--json [PATH]]`: the CUDA copy path's correctness checks in one run.

Run it from the repository root of a checkout; kvtier needs no install there (``tools`` maps
``kvtier.*`` to the checkout's folders where it is not installed). What the GPU machine lacks: nothing,
today. This script imports torch (with Triton and numpy) and
kvtier's ``connector.copy`` (with ``connector.block_ids``, ``connector.copy_thread``,
``connector.layout``, ``connector.copy_cuda``, ``connector.cuda_kernels``, ``runtime.affinity``,
``runtime.handoff``), ``connector.pinning`` and ``bench.kv_views``: none needs more. Worker-side
checks that import ``connector.worker`` pull in ``app.settings`` and ``app.client`` (pydantic,
msgspec, redis); carry those wheels in ``.whl/`` (git-ignored; the device machine reaches no
registry)::

    pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_17_x86_64 --implementation cp -d .whl \\
        pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \\
        typing-inspection==0.4.5 python-dotenv==1.2.4 msgspec==0.22.0 redis==6.4.0 hiredis==3.5.0
    # on the device machine, .whl carried:
    python -m pip install --no-index --no-deps .whl/*.whl
    python -m tools.gpu_check --json "$OUT/gpu_check.json"

Each check prints ``PASS name``, ``FAIL name: why`` or ``SKIP name: why``; the exit status is 1 if
any failed. Without CUDA the CUDA-only checks are skipped and the layout round trips run on the CPU.

Checks, in order (``checks()``):
  roundtrip <case>       every KVCacheLayout, kernel-block split and MLA, fp8 views in blocks of 64,
                         DeepSeek's padded fp8 MLA page, many heads (a plane per head): saves and
                         loads of ascending, descending, scattered and partial chunks, byte for byte
                         (any device)
  save_after_compute     a save sees what the current stream wrote before it (behind a _sleep)
  load_before_read       a load() is in place for what the current stream reads after it
  load_layers_before_read  the same for load_layers() with wait_layer(i) before each layer's read
  wait_layer_nonblocking wait_layer() returns to the host while the loads still wait on the GPU
  stream_left_as_found   a non-default current stream is current again after every copier call
  offsets_past_4gib      blocks whose bytes lie past 2**31 and 2**32 in a > 4 GiB KV buffer
  pin_unpin_pin          pin, unpin, pin again, a refused second pin: no CUDA error left behind
  failed_save_batch      a batch with a bad block id reports an error with the copier's streams idle
  load_pieces_ring_wrap  chunks of one-layer pieces, several per call: the staging ring wraps inside
                         a layer-by-layer load and a save batch, every byte in place
  misaligned_ids_timed   scattered chunks of odd length in one batch compile no kernel variant (and
                         take about as long as the same batch again)
  worker_save            WorkerSide (vLLM's metadata reduced to what it reads): a saved chunk, exact
  worker_load            a CPU-tier hit in its blocks once each layer's wait returned; lease released
  worker_failed_load     a hit whose slot is gone reported as exactly its blocks
  worker_preemption_fence  deferred saves ended once handle_preemptions returns
  worker_full_graph_replay a full CUDA graph replayed after start_load_kv reads the loaded bytes
  worker_v2_drafter      V2's hook order: a FULL-graph drafter after finish_forward reads loaded bytes,
                         and its unwaited layer fails no load (any device)
  grouped_copier         a hybrid engine's copier (two KV cache groups) saves and loads exactly (any device)
  arena_pinned           the arena is really pinned (CUDA says so of its memory), at start-up and on the
                         pin thread, which runs on the KV cache's device
  rank_on_device_1       with two GPUs, a process whose KV cache is on cuda:1: saves, loads, the save
                         waiter and the pin thread leave no CUDA context on device 0 (skipped on one GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tools.gpu_check_cuda import cuda_checks
from tools.gpu_check_layouts import Skipped, layout_checks
from tools.gpu_check_worker import worker_checks

Check = Callable[[torch.device], None]


@dataclass(frozen=True)
class Outcome:
    """One check's result: status is PASS, FAIL or SKIP."""

    name: str
    status: str
    why: str = ""

    def line(self) -> str:
        return f"{self.status} {self.name}" + (f": {self.why}" if self.why else "")


def checks() -> list[tuple[str, Check, bool]]:
    """Every check as (name, function, needs CUDA), in the order they run."""
    out: list[tuple[str, Check, bool]] = [(name, fn, False) for name, fn in layout_checks()]
    out += [(name, fn, True) for name, fn in cuda_checks()]
    out += [(name, fn, False) for name, fn in worker_checks()]
    return out


def run_check(name: str, fn: Check, device: torch.device) -> Outcome:
    """Run one check: an exception is its failure (or its skip), with the exception's text as why."""
    try:
        fn(device)
    except Skipped as exc:
        return Outcome(name, "SKIP", str(exc))
    except AssertionError as exc:
        return Outcome(name, "FAIL", str(exc) or "assertion failed")
    except Exception as exc:
        return Outcome(name, "FAIL", f"{type(exc).__name__}: {exc}")
    return Outcome(name, "PASS")


def run_all(device: torch.device | None = None, echo: bool = True) -> list[Outcome]:
    """Run every check on ``device`` (CUDA where there is one); CUDA-only checks skip elsewhere."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    outcomes = []
    for name, fn, needs_cuda in checks():
        if needs_cuda and device.type != "cuda":
            outcome = Outcome(name, "SKIP", "no CUDA")
        else:
            outcome = run_check(name, fn, device)
        if echo:
            print(outcome.line(), flush=True)
        outcomes.append(outcome)
    return outcomes


def summary(outcomes: list[Outcome], device: torch.device) -> dict[str, object]:
    """The JSON summary: counts by status, the device, and every outcome."""
    counts = {status: sum(o.status == status for o in outcomes) for status in ("PASS", "FAIL", "SKIP")}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "torch": torch.__version__,
        "passed": counts["PASS"],
        "failed": counts["FAIL"],
        "skipped": counts["SKIP"],
        "checks": [asdict(o) for o in outcomes],
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m tools.gpu_check`: 1 if any check failed, else 0."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--json", nargs="?", const="-", metavar="PATH", help="also write a JSON summary to PATH (or stdout)"
    )
    parser.add_argument("--device", help="run on this device (default: cuda where there is one, else cpu)")
    args = parser.parse_args(argv)
    device = torch.device(args.device) if args.device else None
    outcomes = run_all(device)
    if args.json:
        used = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        text = json.dumps(summary(outcomes, used))
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as out:
                out.write(text + "\n")
    return 1 if any(o.status == "FAIL" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
