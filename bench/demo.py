"""`make demo`: real vLLM (OpenAI server, CPU build) with kvtier on its embedded default.

Plays a multi-turn chat whose turns share a growing prefix, first against vLLM without kvtier, then
with kvtier (CPU tier plus a disk tier in a temporary folder, no Redis), then once more after a
restart of the kvtier engine, when only the disk tier remembers. Prints, per round, the time to first
token without and with kvtier, the prompt tokens kvtier served per tier, and whether the outputs were
identical. vLLM's own prefix cache is off in every run, so each reuse shown comes from kvtier (in
production the GPU cache keeps only the hottest prefixes; kvtier keeps the rest).

Both engines are warmed up with a prompt longer than the first round's, and the kvtier run lets the
service finish writing each turn to disk before the next one (a user reading the answer), so round 1
shows a miss of a warm engine, not the one-off costs of an engine's first long prompt.

Progress (each engine start, each phase with its time) goes to stderr; the table to stdout, and a
chart of it to kvtier-demo.png in the working directory (--chart PATH to choose, --no-chart for
none; the chart needs matplotlib, the `plot` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.arena_dir import arena_dir
from kvtier.bench.chart import demo_chart
from kvtier.bench.models import BENCH, WORDS, build_model
from kvtier.bench.ports import free_port
from kvtier.bench.progress import note, step

STARTUP_TIMEOUT_S = 300.0
STARTUP_NOTE_EVERY_S = 20.0  # a line while an engine starts, so a slow start is not mistaken for a hang
CHART = Path("kvtier-demo.png")  # in the working directory
SETUP = "random-weight Llama (8 layers), vLLM's CPU build, its prefix cache off; kvtier: CPU + disk tiers"
ARENA_BYTES = 512 << 20  # the embedded service's CPU tier
# vLLM's CPU build reserves one more core whenever any KV connector is configured (for NIXL's threads).
# kvtier needs none; pinning the reservation keeps both runs on the same OpenMP thread layout, which
# bf16 results depend on, so "identical" compares like with like.
CPU_RESERVED = "1"


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def warm_up(server: Server) -> None:
    """One prompt longer than the first round's, on a topic of its own, so round 1 times a warm
    engine: an engine's first long prompt is slower by itself (docs/performance.md)."""
    rng = random.Random(1)
    server.chat("demo", [{"role": "user", "content": "Warm-up: " + _text(rng, 1500)}], 4)


def conversation(rounds: int, seed: int = 7) -> tuple[str, list[str]]:
    """A long system prompt and one user message per round."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. Reference material: " + _text(rng, 900)
    return system, [f"Question {i + 1}: " + _text(rng, 120) for i in range(rounds)]


@dataclass
class Server:
    """A vLLM OpenAI server in a subprocess."""

    port: int
    proc: subprocess.Popen
    log_path: Path

    def request(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
        """A JSON request; returns the decoded body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = json.dumps(body) if body is not None else None
            conn.request("POST" if body else "GET", path, payload, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:300]!r}")
            return json.loads(data) if data else None
        finally:
            conn.close()

    def chat(self, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
        """Stream one greedy chat completion; returns (seconds to first token, text)."""
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        start = time.perf_counter()
        ttft = None
        parts: list[str] = []
        try:
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"chat: HTTP {resp.status}: {resp.read()[:300]!r}")
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(delta)
        finally:
            conn.close()
        return (ttft if ttft is not None else time.perf_counter() - start), "".join(parts)


@contextlib.contextmanager
def vllm_server(model: str, workdir: Path, kv_config: dict[str, Any] | None, name: str) -> Iterator[Server]:
    """Start vLLM's OpenAI server; stop it (and with it the embedded kvtier service) on every path."""
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", "demo", "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "bfloat16", "--block-size", "32", "--enforce-eager", "--max-model-len", "4096",
        "--kv-cache-memory-bytes", str(256 << 20), "--no-enable-prefix-caching",
    ]  # fmt: skip
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", CPU_RESERVED)
    # vLLM leaves its ZeroMQ socket files behind when it exits (in /tmp by default): in the demo's
    # directory they go with it.
    env.setdefault("VLLM_RPC_BASE_PATH", str(workdir))
    log_path = workdir / f"vllm-{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(port, proc, log_path)
    try:
        with step(f"starting vLLM ({name}; its log: {log_path.name})"):
            _wait_ready(server)
        yield server
    finally:
        stop_server(proc)


def _wait_ready(server: Server) -> None:
    """Poll /health until the server answers; a progress line every STARTUP_NOTE_EVERY_S."""
    start = time.monotonic()
    next_note = start + STARTUP_NOTE_EVERY_S
    while True:
        if server.proc.poll() is not None:
            log = server.log_path
            raise RuntimeError(f"vLLM exited early; see {log}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError, RuntimeError, json.JSONDecodeError):
            server.request("/health", timeout=2)
            return
        now = time.monotonic()
        if now > start + STARTUP_TIMEOUT_S:
            raise RuntimeError(
                f"vLLM did not become ready within {STARTUP_TIMEOUT_S:.0f} s; see {server.log_path}"
            )
        if now >= next_note:
            note(f"  vLLM still starting ({now - start:.0f} s so far)")
            next_note += STARTUP_NOTE_EVERY_S
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server started in its own process group: SIGTERM, then SIGKILL after 60 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _admin_stats(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/stats")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _wait_written(port: int, timeout: float = 30.0) -> None:
    """Wait until the service's write-behind queue is empty: between turns of a chat (a user reads
    the answer), the service writes the last turn's chunks to disk at idle priority."""
    deadline = time.monotonic() + timeout
    while _admin_stats(port).get("write_queue_depth") and time.monotonic() < deadline:
        time.sleep(0.05)


@dataclass
class Round:
    """One round's figures."""

    ttft_off: float = 0.0
    ttft_on: float = 0.0
    prompt_chars: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    same: bool = False


def play(
    server: Server, system: str, questions: list[str], answers: list[str] | None, max_tokens: int
) -> tuple[list[float], list[str]]:
    """Play the conversation; history uses `answers` when given (to replay exactly), else our own."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    ttfts, texts = [], []
    for i, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        ttft, text = server.chat("demo", history, max_tokens)
        ttfts.append(ttft)
        texts.append(text)
        history.append({"role": "assistant", "content": answers[i] if answers else text})
    return ttfts, texts


def run(rounds: int = 5, max_tokens: int = 24, chart: Path | None = CHART) -> int:
    """Run the demo, print its table and draw its chart (unless chart is None); returns the exit
    status (0 when every output was identical)."""
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp,
        arena_dir(Path(tmp), ARENA_BYTES) as shm,
        step(f"make demo: {rounds} chat rounds without kvtier, with it, and after a restart"),
    ):
        work = Path(tmp)
        with step("building a random-weight Llama (8 layers, 16 KiB of KV per token)"):
            model = str(build_model(work / "model", BENCH))
        system, questions = conversation(rounds)
        admin = free_port()
        kv = _kv_config(work / "disk", admin, shm)
        with step("[1/3] vLLM without kvtier"), vllm_server(model, work, None, "baseline") as srv:
            warm_up(srv)
            ttft_off, expected = play(srv, system, questions, None, max_tokens)
        table = [Round(ttft_off=t) for t in ttft_off]
        with (
            step("[2/3] vLLM with kvtier (embedded service: CPU tier + disk tier)"),
            vllm_server(model, work, kv, "kvtier") as srv,
        ):
            _play_with_kvtier(srv, admin, system, questions, expected, table, max_tokens)
        with (
            step("[3/3] vLLM with kvtier after a restart: the CPU tier is gone, the disk tier remains"),
            vllm_server(model, work, kv, "restart") as srv,
        ):
            before = _admin_stats(admin)["hit_tokens"]
            ttft_restart, text = srv.chat("demo", _messages(system, questions, expected), max_tokens)
            after = _admin_stats(admin)["hit_tokens"]
        restart = Round(ttft_off=ttft_off[-1], ttft_on=ttft_restart, same=text == expected[-1])
        restart.hits = {t: after[t] - before.get(t, 0) for t in after}
    results = summary(table, restart)
    status = report(results)
    if chart is not None:
        demo_chart(results, chart)
    return status


def _kv_config(disk: Path, admin_port: int, shm: Path) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for kvtier on its embedded default, with a disk tier at disk."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_size": str(ARENA_BYTES),
            "disk_path": str(disk),
            "chunk_size": 128,
            "admin_port": admin_port,
            "shm_dir": str(shm),
        },
    }


def _play_with_kvtier(
    srv: Server,
    admin: int,
    system: str,
    questions: list[str],
    expected: list[str],
    table: list[Round],
    max_tokens: int,
) -> None:
    """Play the conversation on the engine with kvtier, filling each round's TTFT, hits and match."""
    warm_up(srv)
    _wait_written(admin)
    before = _admin_stats(admin)["hit_tokens"]
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    for i, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        table[i].ttft_on, text = srv.chat("demo", history, max_tokens)
        table[i].same = text == expected[i]
        after = _admin_stats(admin)["hit_tokens"]
        table[i].hits = {t: after[t] - before.get(t, 0) for t in after}
        before = after
        history.append({"role": "assistant", "content": text})
        _wait_written(admin)


def _messages(system: str, questions: list[str], answers: list[str]) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}]
    for i, q in enumerate(questions):
        msgs.append({"role": "user", "content": q})
        if i < len(questions) - 1:
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def summary(table: list[Round], restart: Round) -> dict[str, Any]:
    """The demo's figures as a dict (what report() prints and bench.chart.demo_chart draws)."""
    rows = [(f"round {i + 1}", r) for i, r in enumerate(table)]
    rows.append((f"round {len(table)} after restart", restart))
    return {
        "setup": SETUP,
        "rounds": [
            {
                "name": name,
                "ttft_off_ms": round(r.ttft_off * 1000, 1),
                "ttft_on_ms": round(r.ttft_on * 1000, 1),
                "hit_tokens": dict(r.hits),
                "identical": r.same,
            }
            for name, r in rows
        ],
    }


def report(results: dict[str, Any]) -> int:
    """Print the table of summary()'s dict; returns 0 when every output was identical, else 1."""
    print()
    print(f"{'round':<24}{'TTFT off (ms)':>14}{'TTFT on (ms)':>14}{'speed-up':>10}"
          f"{'cpu hits':>10}{'disk hits':>11}  identical")  # fmt: skip
    for row in results["rounds"]:
        off, on, hits = row["ttft_off_ms"], row["ttft_on_ms"], row["hit_tokens"]
        print(
            f"{row['name']:<24}{off:>14.1f}{on:>14.1f}{off / max(on, 1e-9):>9.2f}x"
            f"{hits.get('cpu', 0):>10}{hits.get('disk', 0):>11}  {'yes' if row['identical'] else 'NO'}"
        )
    ok = all(row["identical"] for row in results["rounds"])
    print()
    print("every output identical to vLLM without kvtier" if ok else "OUTPUTS DIFFER: this is a bug")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.demo", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--chart", type=Path, default=CHART, help=f"where to draw the chart (PNG; default: ./{CHART})"
    )
    parser.add_argument("--no-chart", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return run(args.rounds, args.max_tokens, None if args.no_chart else args.chart)


if __name__ == "__main__":
    sys.exit(main())
