"""The checks that need the stack running: OpenAI API hits, Redis, restarts, uid, tmpfs, health, logs."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from stack import MODEL_MOUNT, Stack, http_json, http_text
from tally import Tally, compose_duration, metric_sum, size_bytes

KVTIER_UID = "10001"
CHUNK_TOKENS_MIN = 1024  # four chunks of 256: what a prompt of ~1,200 tokens stores
CHUNKS_MIN = CHUNK_TOKENS_MIN // 256
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
)


def prompt_text(seed: int, words: int = 1100) -> str:
    """A prompt of about 1,200 tokens of the tiny model, distinct per seed."""
    return " ".join(f"{WORDS[(seed * 7 + i * 5) % len(WORDS)]} {seed}" if i % 50 == 0 else
                    WORDS[(seed * 3 + i * 11) % len(WORDS)] for i in range(words))  # fmt: skip


class Api:
    """vLLM's OpenAI API and /metrics on the published port."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def complete(self, prompt: str, timeout: float = 120) -> str:
        body = {"model": MODEL_MOUNT, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        answer = http_json(self.stack.url("API_PORT", "/v1/completions"), body, timeout=timeout)
        return str(answer["choices"][0]["text"])

    def tokens(self, prompt: str) -> int:
        answer = http_json(self.stack.url("API_PORT", "/tokenize"), {"model": MODEL_MOUNT, "prompt": prompt})
        return int(answer["count"])

    def metrics(self) -> str:
        return http_text(self.stack.url("API_PORT", "/metrics"))

    def counter(self, name: str, **labels: str) -> float:
        return metric_sum(self.metrics(), name, **labels) + metric_sum(
            self.metrics(), name + "_total", **labels
        )

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (not kvtier's), so a repeated prompt can only come from kvtier."""
        http_text(self.stack.url("API_PORT", "/reset_prefix_cache"), method="POST")


def kvtier_stats(stack: Stack) -> dict[str, Any]:
    """`kvtier stats --json` run in the kvtier container."""
    result = stack.exec("kvtier", "kvtier", "stats", "--json")
    if result.returncode != 0:
        raise RuntimeError(f"kvtier stats exited {result.returncode}: {result.stderr[-500:]}")
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def stats_hit_tokens(stats: dict[str, Any], tier: str) -> float:
    """Hit tokens the service counted for one tier."""
    return float(stats.get("hit_tokens", {}).get(tier, 0))


def stats_chunks(stats: dict[str, Any]) -> dict[str, int]:
    """Chunks each tier holds; for Redis (shared, so kvtier does not count what it holds) the stores."""
    tiers = stats.get("tiers", {})
    return {name: int(tier.get("stores" if name == "redis" else "chunks", 0)) for name, tier in tiers.items()}


def check_hit(tally: Tally, stack: Stack, api: Api) -> tuple[str, str]:
    """A prompt is stored; the same prompt again (vLLM's own prefix cache emptied) loads from kvtier.
    Returns the prompt and its output."""
    prompt = prompt_text(1)
    count = api.tokens(prompt)
    tally.check("prompt is long enough for four chunks", count > CHUNK_TOKENS_MIN, f"{count} tokens")
    saved0, hits0 = api.counter("vllm:kvtier_saved_tokens"), stats_hit_tokens(kvtier_stats(stack), "cpu")
    first = api.complete(prompt)
    deadline = time.monotonic() + 30
    while api.counter("vllm:kvtier_saved_tokens") - saved0 < CHUNK_TOKENS_MIN and time.monotonic() < deadline:
        time.sleep(1)
    saved = api.counter("vllm:kvtier_saved_tokens") - saved0
    tally.check(
        "first prompt stored in kvtier (vllm:kvtier_saved_tokens)", saved >= CHUNK_TOKENS_MIN, f"{saved:.0f}"
    )
    want = {"cpu", "disk", "redis", "object"}
    chunks = stats_chunks(kvtier_stats(stack))
    while time.monotonic() < deadline and not all(chunks.get(t, 0) >= CHUNKS_MIN for t in want):
        time.sleep(1)
        chunks = stats_chunks(kvtier_stats(stack))
    stored = all(chunks.get(t, 0) >= CHUNKS_MIN for t in want)
    detail = f"chunks {chunks} (Redis: stores)"
    tally.check("`kvtier stats`: the chunks went to the CPU, disk, Redis and object tiers", stored, detail)
    api.reset_prefix_cache()
    ext0, cpu0 = api.counter("vllm:kvtier_external_tokens"), api.counter("vllm:kvtier_hit_tokens", tier="cpu")
    second = api.complete(prompt)
    ext = api.counter("vllm:kvtier_external_tokens") - ext0
    cpu = api.counter("vllm:kvtier_hit_tokens", tier="cpu") - cpu0
    tally.check(
        "same prompt again is a kvtier hit (vllm:kvtier_external_tokens)",
        ext >= CHUNK_TOKENS_MIN,
        f"{ext:.0f}",
    )
    tally.check(
        "the hit came from kvtier's CPU tier (vllm:kvtier_hit_tokens{tier=cpu})",
        cpu >= CHUNK_TOKENS_MIN,
        f"{cpu:.0f}",
    )
    tally.check("the hit's output equals the computed one", first == second, f"{first!r} / {second!r}")
    stats = kvtier_stats(stack)
    hits = stats_hit_tokens(stats, "cpu") - hits0
    engines = len(stats.get("engines", []))
    tally.check("`kvtier stats` counts the hit (hit_tokens.cpu)", hits >= CHUNK_TOKENS_MIN, f"+{hits:.0f}")
    tally.check("`kvtier stats` lists the connected vLLM engine", engines >= 1, f"{engines} engines")
    tally.check("vllm:kvtier_active is 1", metric_sum(api.metrics(), "vllm:kvtier_active") >= 1)
    return prompt, first


def check_object(tally: Tally, stack: Stack, api: Api, prompt: str, output: str) -> None:
    """The object profile: the chunks are objects in its bucket, and with the CPU, disk and Redis
    tiers emptied (`kvtier clear`) the same prompt is a hit from the object tier, output unchanged."""
    listing = stack.exec(
        "seaweedfs", "wget", "-q", "-O", "-", "http://127.0.0.1:8333/kvtier?list-type=2&prefix=chunks/"
    )
    objects = listing.stdout.count("<Key>")
    held = objects >= CHUNKS_MIN
    tally.check("the bucket s3://kvtier/chunks holds kvtier's chunks", held, f"{objects} objects")
    cleared = stack.exec("kvtier", "kvtier", "clear", "--tier", "cpu,disk,redis", "--json")
    said = (cleared.stdout + cleared.stderr)[-300:]
    tally.check("`kvtier clear --tier cpu,disk,redis`", cleared.returncode == 0, said)
    api.reset_prefix_cache()
    before = api.counter("vllm:kvtier_hit_tokens", tier="object")
    again = api.complete(prompt)
    hit = api.counter("vllm:kvtier_hit_tokens", tier="object") - before
    tally.check(
        "the prompt again is a hit from the object tier (vllm:kvtier_hit_tokens{tier=object})",
        hit >= CHUNK_TOKENS_MIN,
        f"{hit:.0f}",
    )
    tally.check("the object hit's output equals the computed one", again == output, f"{output!r} / {again!r}")


def check_redis(tally: Tally, stack: Stack) -> None:
    """The Redis container holds kvtier's chunks (keys kvtier:<namespace>:<hash>)."""
    deadline, keys = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        result = stack.exec("redis", "redis-cli", "--scan", "--pattern", "kvtier:*")
        keys = result.stdout.split()
        if len(keys) >= CHUNKS_MIN:
            break
        time.sleep(1)
    tally.check("Redis holds kvtier's chunks", len(keys) >= CHUNKS_MIN, f"{len(keys)} keys kvtier:*")


def check_restart(tally: Tally, stack: Stack, api: Api, stored: str) -> None:
    """`docker compose restart kvtier` while requests run: none fails (recompute); hits resume after it."""
    errors: list[str] = []
    done = threading.Event()
    started: list[float] = []  # when each request was sent

    def load() -> None:  # bounded: one request at a time, at most 1,000, until told to stop
        for seed in range(100, 1100):
            if done.is_set():
                return
            started.append(time.monotonic())
            try:
                api.complete(prompt_text(seed, words=400), timeout=120)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.2)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(2)
    restart_start = time.monotonic()
    stack.compose("restart", "kvtier", timeout=180)
    stack.wait_healthy(["kvtier"], timeout=120)
    restart_end = time.monotonic()
    time.sleep(3)
    done.set()
    worker.join(timeout=180)
    during = sum(restart_start <= t <= restart_end for t in started)
    ok = not errors and during > 0
    detail = f"{len(started)} requests, {during} sent during the {restart_end - restart_start:.0f} s restart"
    tally.check("no request lost while kvtier restarted", ok, f"{detail}, {len(errors)} failed {errors[:2]}")
    before = {t: api.counter("vllm:kvtier_hit_tokens", tier=t) for t in ("cpu", "disk", "redis", "object")}
    deadline, ext = time.monotonic() + 90, 0.0
    while time.monotonic() < deadline:
        api.reset_prefix_cache()
        ext0 = api.counter("vllm:kvtier_external_tokens")
        api.complete(stored)
        ext = api.counter("vllm:kvtier_external_tokens") - ext0
        if ext >= CHUNK_TOKENS_MIN:
            break
        time.sleep(3)
    tiers = {t: api.counter("vllm:kvtier_hit_tokens", tier=t) - before[t] for t in before}
    tally.check(
        "hits resume after the kvtier restart", ext >= CHUNK_TOKENS_MIN, f"{ext:.0f} tokens, by tier {tiers}"
    )


def _mount(stack: Stack, service: str, path: str) -> tuple[str, str]:
    """(fstype, options) of the mount at path inside a service's container."""
    for line in stack.exec(service, "cat", "/proc/mounts").stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == path:
            return parts[2], parts[3]
    return "", ""


def _df_bytes(stack: Stack, service: str, path: str) -> int:
    out = stack.exec(service, "df", "-B1", "--output=size", path).stdout.split()
    return int(out[-1]) if out and out[-1].isdigit() else -1


def check_sharing(tally: Tally, stack: Stack) -> None:
    """uid 10001 in both containers; the socket and arena are the same files, owner-only, in both."""
    for service in ("kvtier", "vllm-cpu"):
        uid = stack.exec(service, "id", "-u").stdout.strip()
        tally.check(f"{service} runs as uid {KVTIER_UID}", uid == KVTIER_UID, uid)
    stat = ["stat", "-c", "%i %u %a %F %n"]
    sock = {s: stack.exec(s, *stat, "/run/kvtier/kvtier.sock").stdout.strip() for s in ("kvtier", "vllm-cpu")}
    same = (
        sock["kvtier"] == sock["vllm-cpu"]
        and " socket " in sock["kvtier"]
        and f" {KVTIER_UID} " in sock["kvtier"]
    )
    tally.check("the service's socket is one file, uid 10001, seen by both containers", same, sock["kvtier"])
    ls = ["sh", "-c", "stat -c '%i %u %a %s %n' /var/lib/kvtier/shm/*"]
    arena = {s: stack.exec(s, *ls).stdout.strip() for s in ("kvtier", "vllm-cpu")}
    owned = bool(arena["kvtier"]) and all(f" {KVTIER_UID} " in line for line in arena["kvtier"].splitlines())
    same = owned and arena["kvtier"] == arena["vllm-cpu"]
    detail = arena["kvtier"].replace("\n", "; ")
    tally.check("the arena is the same owner-only files in both containers", same, detail)


def check_tmpfs(tally: Tally, stack: Stack) -> None:
    """tmpfs sizes and options as compose.yaml and the env file set them; /dev/shm raised for vLLM."""
    want = {
        ("kvtier", "/run/kvtier"): size_bytes("1m"),
        ("vllm-cpu", "/run/kvtier"): size_bytes("1m"),
        ("kvtier", "/var/lib/kvtier/shm"): size_bytes(stack.env["ARENA_TMPFS_SIZE"]),
        ("vllm-cpu", "/var/lib/kvtier/shm"): size_bytes(stack.env["ARENA_TMPFS_SIZE"]),
        ("vllm-cpu", "/dev/shm"): size_bytes(stack.env["SHM_SIZE"]),
    }
    for (service, path), size in want.items():
        fstype, options = _mount(stack, service, path)
        got = _df_bytes(stack, service, path)
        ok = fstype == "tmpfs" and got == size
        if path != "/dev/shm":
            ok = ok and "uid=10001" in options and "mode=700" in options
        tally.check(f"{service}: {path} is a tmpfs of {size} bytes", ok, f"{fstype} {got} B ({options})")
    arena = size_bytes(stack.env["KVTIER_CPU_SIZE"].replace("iB", ""))
    tally.check("the arena tmpfs holds KVTIER_CPU_SIZE", size_bytes(stack.env["ARENA_TMPFS_SIZE"]) > arena)


def check_healthchecks(tally: Tally, stack: Stack, services: list[str], times: dict[str, float]) -> None:
    """Each container's healthcheck is compose.yaml's (interval, timeout, retries, start period)."""
    model = stack.config()["services"]
    for service in services:
        want = model[service].get("healthcheck", {})
        have = stack.inspect(service)["Config"].get("Healthcheck") or {}
        pairs = [("interval", "Interval"), ("timeout", "Timeout"), ("start_period", "StartPeriod")]
        ok = bool(want) and have.get("Retries", 0) == want.get("retries", 0)
        for key, field in pairs:
            if key in want:
                ok = ok and abs(have.get(field, 0) / 1e9 - compose_duration(str(want[key]))) < 1e-3
        took = times.get(service)
        keys = ("interval", "timeout", "retries", "start_period")
        detail = "/".join(str(want.get(key, "-")) for key in keys)
        if took is not None:
            detail += f", healthy {took:.0f} s after `up` began"
        healthy = ok and stack.health(service) == "healthy"
        tally.check(f"{service}: healthcheck as compose.yaml sets it, healthy", healthy, detail)


LOG_LINES = {
    "redis": ["Ready to accept connections"],
    "kvtier": ["serving"],
    "vllm-cpu": ["kvtier connector (scheduler) ready", "kvtier (scheduler) serves again"],
}


def check_logs(tally: Tally, stack: Stack) -> None:
    """`docker compose logs` shows each service start, the connector attach and reconnect."""
    for service, lines in LOG_LINES.items():
        text = stack.logs(service)
        missing = [line for line in lines if line not in text]
        tally.check(f"{service} logs show {lines}", not missing, f"missing {missing}" if missing else "")
    kvtier = stack.logs("kvtier")
    tally.check("kvtier logs have no traceback", "Traceback" not in kvtier)


def check_prometheus(tally: Tally, stack: Stack) -> None:
    """The metrics profile's Prometheus scrapes kvtier (and vLLM through its alias)."""
    deadline, health = time.monotonic() + 90, {}
    while time.monotonic() < deadline:
        answer = http_json(stack.url("PROMETHEUS_HOST_PORT", "/api/v1/targets"))
        health = {t["labels"]["job"]: t["health"] for t in answer["data"]["activeTargets"]}
        if health.get("kvtier") == "up" and health.get("vllm") == "up":
            break
        time.sleep(3)
    tally.check(
        "Prometheus scrapes kvtier:9400 and vllm:8000", health == {"kvtier": "up", "vllm": "up"}, str(health)
    )
    query = stack.url("PROMETHEUS_HOST_PORT", "/api/v1/query?query=kvtier_build_info")
    result = http_json(query)["data"]["result"]
    tally.check("Prometheus has kvtier_build_info", bool(result), f"{len(result)} series")
