"""`kvtier bench kill`: vLLM's serving benchmark with kvtier's embedded service SIGKILLed mid-run.

The workload of `kvtier bench serve` (vLLM's own client, `prefix_repetition`, 12 prefixes of 1,024
tokens, concurrency 4) against vLLM's OpenAI server with vLLM's own process layout (the engine core
and a worker process, which vLLM binds to the core it computes on), kvtier on its embedded default
over a 48 MiB CPU tier and a disk tier. Per run, two servers one after the other:

- ceiling: vLLM's prefix cache with KV memory for every block of the workload, no kvtier;
- kvtier: KV memory for `concurrency` requests, kvtier through the README's flag, and its service
  SIGKILLed --kill-at seconds after the client started.

Per run: each server's request throughput, kvtier's over the ceiling's, the seconds from the kill
until a new service answers on the engine's socket (polled every 10 ms), which process of the
engine restarted it (from the server's log), and failed requests (none allowed: the run fails).
The medians over --runs, with every run's values, go under "serve_kill" in kvtier-bench.json (in the
working directory, unless --out says where).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.app.embedded import probe
from kvtier.bench.harness import kv_transfer_config
from kvtier.bench.models import build_model
from kvtier.bench.ports import free_port
from kvtier.bench.progress import note, step
from kvtier.bench.serve import (
    DTYPE_BYTES,
    RESULTS,
    SHAPE,
    Server,
    environment,
    run_client,
    running_server,
    save,
    server_argv,
    workdir,
)
from kvtier.bench.serve_plan import Workload, median, size_kv, spread

SECTION = "serve_kill"
WORKLOAD = Workload(num_prefixes=12, prompts_per_prefix=8)
TIERS = {"cpu_size": "48MiB"}  # and a disk tier in the run's work directory
POLL_S = 0.01
RESPAWN_WAIT_S = 120.0
SPAWNER = re.compile(r"\((\w+) pid=\d+\).*starting the embedded kvtier service")


@dataclass(frozen=True)
class KillRun:
    """One repetition's figures."""

    ceiling_rps: float
    kvtier_rps: float
    respawn_s: float  # kill -> a service answers on the engine's socket again
    respawned_by: str  # the vLLM process that started the new service, as vLLM's log names it

    @property
    def ratio(self) -> float:
        """kvtier's throughput over the ceiling's."""
        return self.kvtier_rps / self.ceiling_rps


def default_layout_env(work: Path) -> dict[str, str]:
    """The benchmark's environment with vLLM's own process layout (a worker process per rank)."""
    env = environment(work)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # kvtier.bench.harness turns it off for itself
    return env


def _argv(model: str, port: int, blocks: int, kvtier: dict[str, Any] | None) -> list[str]:
    block_bytes = WORKLOAD.block_size * SHAPE.kv_bytes_per_token_of(DTYPE_BYTES)
    argv = server_argv(model, port, WORKLOAD, blocks, block_bytes)
    at = argv.index("--distributed-executor-backend")
    del argv[at : at + 2]  # vLLM's default executor
    if kvtier is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(**kvtier))]
    return argv


def embedded_services(root: int) -> dict[int, str]:
    """{pid: socket path} of the kvtier services that processes below root started."""
    family = _descendants(root) | {root}
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            args = Path(entry.path, "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        wanted = "kvtier.app.server" in args and "--parent-pid" in args and "--url" in args
        if wanted and int(args[args.index("--parent-pid") + 1]) in family:
            found[int(entry.name)] = args[args.index("--url") + 1].removeprefix("unix://")
    return found


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _kill_then_time(server: Server, kill_at: float, started: float, out: dict[str, float]) -> None:
    """At kill_at seconds after started, SIGKILL the engine's service; record how long until a
    service answers on its socket again (out["respawn_s"]), or why not (out["error"])."""
    time.sleep(max(0.0, started + kill_at - time.monotonic()))
    services = embedded_services(server.proc.pid)
    if len(services) != 1:
        out["error"] = float(len(services))
        return
    ((pid, sock),) = services.items()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < RESPAWN_WAIT_S:
        if probe(sock, timeout=0.2) and pid not in embedded_services(server.proc.pid):
            out["respawn_s"] = time.monotonic() - killed
            return
        time.sleep(POLL_S)


def run_once(model: str, work: Path, index: int, kill_at: float) -> KillRun:
    """The ceiling, then kvtier with the kill, each on a fresh server."""
    sizing = size_kv(WORKLOAD)
    env = default_layout_env(work)
    port = free_port()
    with running_server(
        f"ceiling-{index}", _argv(model, port, sizing.ceiling_blocks, None), port, work, env
    ) as s:
        ceiling, _ = run_client(s, model, WORKLOAD, work)
    port = free_port()
    tiers = {**TIERS, "disk_path": str(work / f"disk-{index}")}
    name = f"kvtier-{index}"
    with running_server(name, _argv(model, port, sizing.constrained_blocks, tiers), port, work, env) as s:
        timing: dict[str, float] = {} if kill_at > 0 else {"respawn_s": 0.0}
        killer = threading.Thread(target=_kill_then_time, args=(s, kill_at, time.monotonic(), timing))
        if kill_at > 0:
            killer.start()
        kvtier, _ = run_client(s, model, WORKLOAD, work)
        if kill_at > 0:
            killer.join()
        log = s.log_path.read_text(errors="replace")
    if "respawn_s" not in timing:
        raise RuntimeError(f"{name}: no service answered again after the kill ({timing}):\n{log[-3000:]}")
    spawners = SPAWNER.findall(log)
    return KillRun(
        ceiling_rps=float(ceiling["request_throughput"]),
        kvtier_rps=float(kvtier["request_throughput"]),
        respawn_s=timing["respawn_s"],
        respawned_by=spawners[-1] if len(spawners) > 1 else "",
    )


def summarize(runs: list[KillRun], kill_at: float) -> dict[str, Any]:
    """Medians with every run's values."""
    ratios = [round(r.ratio, 3) for r in runs]
    respawns = [round(r.respawn_s, 3) for r in runs]
    return {
        "kill_at_s": kill_at,
        "runs": len(runs),
        "throughput_ratio_vs_ceiling": median(ratios),
        "throughput_ratio_vs_ceiling_runs": ratios,
        "throughput_ratio_vs_ceiling_spread": spread(ratios),
        "respawn_s": median(respawns),
        "respawn_s_runs": respawns,
        "respawn_s_spread": spread(respawns),
        "respawned_by": [r.respawned_by for r in runs],
        "ceiling_rps_runs": [round(r.ceiling_rps, 3) for r in runs],
        "kvtier_rps_runs": [round(r.kvtier_rps, 3) for r in runs],
        "setup": {"workload": WORKLOAD.__dict__, "tiers": {**TIERS, "disk": True}, "layout": "vLLM's"},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvtier bench kill`."""
    parser = argparse.ArgumentParser(prog="kvtier bench kill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--runs", type=int, default=5, help="repetitions (default 5)")
    parser.add_argument(
        "--kill-at", type=float, default=8.0, help="seconds into the client's run (default 8)"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"the JSON to write into (default: ./{RESULTS})"
    )
    parser.add_argument("--no-save", action="store_true", help="write no JSON file")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep logs and files in DIR")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    runs: list[KillRun] = []
    with (
        workdir(args.keep) as work,
        step(f"kvtier bench kill: {args.runs} runs, the kill at {args.kill_at}s"),
    ):
        model = str(build_model(work / "model", SHAPE))
        for index in range(args.runs):
            run = run_once(model, work, index, args.kill_at)
            by = run.respawned_by or "unknown"
            note(
                f"  run {index + 1}: {run.ratio:.3f} of the ceiling, "
                f"serving again after {run.respawn_s:.2f}s ({by})"
            )
            runs.append(run)
    section = summarize(runs, args.kill_at)
    if not args.no_save:
        save(section, args.out, SECTION)
    print(json.dumps(section, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
