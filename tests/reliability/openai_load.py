"""Helpers for the load and crash tests: vLLM's OpenAI server on the CPU build in a process of its own, a
threaded completions client, Prometheus text parsing, and /proc inspection for leak checks.

Standard library only (http.client, threads). Servers start in their own process group and are
stopped with SIGTERM to the group, as ``bench/demo.py`` does; an embedded kvtier service is not in
that group (it runs in a session of its own) and must go away by itself when its engine exits.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.harness import make_prompt
from kvtier.bench.ports import free_port
from tests.support.leak_check import descendants
from tests.support.warm import WarmProcess, start_server

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0
SERVED_NAME = "tiny"


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of one GET on 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def admin_stats(port: int) -> dict[str, Any]:
    """GET /stats of a kvtier admin server."""
    status, body = http_get(port, "/stats")
    if status != 200:
        raise RuntimeError(f"/stats answered {status}: {body[:200]!r}")
    result: dict[str, Any] = json.loads(body)
    return result


# ------------------------------------------------------------------------------------- servers
@dataclass
class OpenAIServer:
    """One `python -m vllm.entrypoints.openai.api_server` process."""

    name: str
    port: int
    proc: subprocess.Popen[bytes] | WarmProcess
    log_path: Path

    def post(self, path: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """POST JSON, return the decoded answer; raises on any status but 200."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"{self.name} {path}: HTTP {resp.status}: {data[:300]!r}")
        result: dict[str, Any] = json.loads(data)
        return result

    def metrics(self) -> str:
        """vLLM's Prometheus text."""
        status, body = http_get(self.port, "/metrics")
        if status != 200:
            raise RuntimeError(f"{self.name} /metrics: HTTP {status}")
        return body.decode()

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def server_argv(model: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The OpenAI server command line for the tiny model on the CPU build."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--block-size", "32", "--enforce-eager", "--seed", "0",
        "--disable-uvicorn-access-log", *extra,
    ]  # fmt: skip


def launch(
    model: str,
    workdir: Path,
    name: str,
    extra: Sequence[str] = (),
    kv_config: dict | None = None,
    env_overrides: Mapping[str, str] | None = None,
) -> OpenAIServer:
    """Start a server (not waiting for it); stdout and stderr go to workdir/vllm-<name>.log."""
    port = free_port()
    argv = server_argv(model, port, extra)
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    # The CPU build reserves one more core when a KV connector is configured; pin it so both
    # servers run the same OpenMP layout, which bf16 results depend on (see bench/demo.py).
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default layout
    env.update(env_overrides or {})
    log_path = workdir / f"vllm-{name}.log"
    with open(log_path, "wb") as log:
        proc = start_server(argv[2], argv[3:], env, log.fileno())
    return OpenAIServer(name, port, proc, log_path)


def wait_ready(server: OpenAIServer, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Block until GET /health answers 200; raise with the log if the server exits or hangs."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if http_get(server.port, "/health", timeout=2)[0] == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} not ready after {timeout:.0f}s:\n{server.log_tail()}")
        time.sleep(0.5)


def stop(server: OpenAIServer, timeout: float = 60.0) -> int | None:
    """SIGTERM the server's process group, SIGKILL it if it hangs; returns the exit status."""
    proc = server.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


@contextlib.contextmanager
def running_servers(
    model: str, workdir: Path, specs: Sequence[tuple[str, Sequence[str], dict | None]]
) -> Iterator[list[OpenAIServer]]:
    """Start several servers at once (their start-ups overlap), wait for all, stop all at the end."""
    servers: list[OpenAIServer] = []
    try:
        for name, extra, kv_config in specs:
            servers.append(launch(model, workdir, name, extra, kv_config))
        for server in servers:
            wait_ready(server)
        yield servers
    finally:
        for server in servers:
            stop(server)


def metric_total(text: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (all label sets) in exposition text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        if metric.split("{", 1)[0] == name:
            total += float(value)
    return total


# ------------------------------------------------------------------------------------ workload
def make_requests(count: int, seed: int, prefixes: int = 8) -> list[tuple[str, list[int]]]:
    """(id, prompt token ids): shared prefixes of 96 to 320 tokens, each with a tail of its own;
    about one request in five repeats an earlier prompt exactly."""
    rng = random.Random(seed)
    heads = [make_prompt(seed * 100 + k, 96 + 32 * k) for k in range(prefixes)]
    out: list[tuple[str, list[int]]] = []
    for i in range(count):
        if out and rng.random() < 0.2:
            prompt = list(rng.choice(out)[1])
        else:
            head = heads[rng.randrange(prefixes)]
            prompt = head + make_prompt(seed * 100_000 + i, rng.randrange(8, 72))
        out.append((f"s{seed}-r{i}", prompt))
    return out


@dataclass
class LoadResult:
    """Token ids per request id, failures, and the most requests seen in flight at once."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    max_in_flight: int = 0
    seconds: float = 0.0


def run_load(
    server: OpenAIServer,
    requests: Sequence[tuple[str, list[int]]],
    concurrency: int,
    max_tokens: int,
) -> LoadResult:
    """Send every request (greedy completion, prompt as token ids) from `concurrency` threads."""
    result = LoadResult()
    lock = threading.Lock()
    in_flight = [0]

    def one(item: tuple[str, list[int]]) -> None:
        req_id, prompt = item
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        with lock:
            in_flight[0] += 1
            result.max_in_flight = max(result.max_in_flight, in_flight[0])
        try:
            answer = server.post("/v1/completions", body)
            tokens = list(answer["choices"][0]["token_ids"])
            with lock:
                result.tokens[req_id] = tokens
        except Exception as exc:
            with lock:
                result.errors[req_id] = f"{type(exc).__name__}: {exc}"
        finally:
            with lock:
                in_flight[0] -= 1

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="load") as pool:
        list(pool.map(one, requests))
    result.seconds = time.monotonic() - start
    return result


# ------------------------------------------------------------------------------------ processes
def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of pid, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            rest = f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return int(rest[1]), rest[0]


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


def cmdline(pid: int) -> str:
    """The process's command line, space-joined ('' when gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def service_pids(root: int) -> set[int]:
    """kvtier services started by root or a process below it.

    An embedded service detaches from the process that spawned it (vLLM kills its processes'
    descendants), so it is found by the ``--parent-pid`` it was started with.
    """
    family = descendants(root) | {root}
    found: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        args = cmdline(int(entry.name)).split()
        if "kvtier.app.server" in args and alive(int(entry.name)):
            parent = args[args.index("--parent-pid") + 1] if "--parent-pid" in args[:-1] else ""
            if int(entry.name) in family or (parent.isdigit() and int(parent) in family):
                found.add(int(entry.name))
    return found


def rss_anon_kib(pid: int) -> int:
    """Anonymous resident memory of pid in KiB: RSS without shared file mappings (the arena)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def kvtier_files(*directories: Path) -> list[Path]:
    """Sockets and arena files of kvtier in these directories (not recursive)."""
    found: list[Path] = []
    for directory in directories:
        if directory.is_dir():
            found += [
                p
                for p in directory.iterdir()
                if p.name.endswith(".sock") or (p.name.startswith("kvtier-") and p.name.endswith(".arena"))
            ]
    return sorted(found)
