"""`make compose-check`: start compose.yaml's stack for real (profiles cpu and object, then metrics) and
check it.

Steps: Docker from Debian's packages (daemon started, Compose v2); base images pulled or stood in;
a small random-weight model built locally; `docker compose --profile cpu --profile object up --build
-d`; every healthcheck waited for; then hits through vLLM's OpenAI API, Redis, the object tier's
bucket and a hit from it, a kvtier restart mid-run, uid and tmpfs sharing, healthcheck timings, logs,
Prometheus; finally `docker compose down -v` leaves nothing.
Prints `compose-check: N passed, N failed` last and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import engine
import probes
import standins
from stack import Stack, serve_torch_index
from tally import PREFIX, Tally

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = Path(os.environ.get("KVTIER_CHECK_CACHE", "/var/cache/kvtier-compose-check"))
CPU_SERVICES = ["redis", "kvtier", "vllm-cpu", "seaweedfs"]
UP_PROFILES = ["cpu", "object"]
ALL_PROFILES = ["cpu", "object", "metrics"]


def build_model(cache: Path) -> Path:
    """The tiny random-weight Llama of the tests, readable by the containers' uid 10001."""
    from kvtier.bench.models import TINY
    from kvtier.bench.models import build_model as build

    path: Path = build(cache / "model-tiny", TINY)
    for item in [path, *path.rglob("*")]:
        item.chmod(0o755 if item.is_dir() else 0o644)
    return path


def prepare(tally: Tally, cache: Path, wheels: Path) -> Stack | None:
    """Engine, images, model, env file; None (with the failure recorded) when the stack cannot start."""
    try:
        version = engine.ensure_engine(cache)
    except (engine.EngineError, OSError, subprocess.SubprocessError) as exc:
        tally.check("Docker runs here", False, str(exc))
        return None
    tally.check("Docker engine and Compose v2 run", True, f"compose {version}")
    torch_index, _server = serve_torch_index(wheels, cache)  # served on 127.0.0.1 until the check exits
    stack = Stack.prepare(REPO, cache, build_model(cache), torch_index)
    stack.profiles = ALL_PROFILES
    model = stack.config()
    stack.profiles = UP_PROFILES
    for image in standins.images_needed(REPO, [*CPU_SERVICES, "prometheus", "grafana"], model):
        outcome = standins.ensure_image(image, cache)
        if outcome.how == "unavailable":
            tally.note(f"{image}: {outcome.detail}")
        else:
            tally.check(f"image {image}", True, f"{outcome.how}: {outcome.detail}".rstrip(": "))
    return stack


def run_checks(tally: Tally, stack: Stack) -> None:
    """Up, the checks, restart, metrics profile; the stack is left for `down -v`."""
    start = time.monotonic()
    stack.compose("up", "--build", "-d", timeout=1800)
    took = f"{time.monotonic() - start:.0f} s"
    tally.check("docker compose --profile cpu --profile object up --build -d", True, took)
    times = stack.wait_healthy(CPU_SERVICES, timeout=600, since=start)
    tally.check("every healthcheck passes", True, ", ".join(f"{s} {t:.0f} s" for s, t in times.items()))
    api = probes.Api(stack)
    probes.check_sharing(tally, stack)
    probes.check_tmpfs(tally, stack)
    stored, output = probes.check_hit(tally, stack, api)
    probes.check_redis(tally, stack)
    probes.check_object(tally, stack, api, stored, output)
    probes.check_restart(tally, stack, api, stored)
    probes.check_healthchecks(tally, stack, CPU_SERVICES, times)
    probes.check_logs(tally, stack)
    if standins.image_label("prom/prometheus:v3.1.0") is None:
        tally.note("prom/prometheus:v3.1.0 is not available: the metrics profile is not started")
        return
    stack.profiles = ALL_PROFILES
    stack.compose("up", "-d", "prometheus", timeout=300)
    stack.wait_healthy(["prometheus"], timeout=120)
    probes.check_prometheus(tally, stack)
    tally.note("grafana (metrics profile) is not started: no stand-in for grafana/grafana:11.4.0")


def tear_down(tally: Tally, stack: Stack) -> None:
    """`docker compose down -v` leaves no container, volume or network of the project."""
    stack.profiles = ALL_PROFILES
    try:
        stack.compose("down", "-v", "--remove-orphans", timeout=300)
    except RuntimeError as exc:
        tally.check("docker compose down -v", False, str(exc))
    left = stack.leftovers()
    tally.check("down -v leaves no container, volume or network", not any(left.values()), str(left))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="reused between runs")
    parser.add_argument("--wheels", type=Path, default=Path(os.environ.get("WHEELS", "/opt/wheels")))
    parser.add_argument("--keep", action="store_true", help="leave the stack running (no down -v)")
    args = parser.parse_args(argv)
    tally = Tally()
    if not shutil.which("docker") and not shutil.which("apt-get"):
        tally.check("Docker runs here", False, "no docker and no apt-get to install Debian's docker.io")
        return tally.finish()
    args.cache.mkdir(parents=True, exist_ok=True)
    try:
        stack = prepare(tally, args.cache, args.wheels)
    except Exception as exc:  # images, model or env file: recorded, then the closing line
        traceback.print_exc()
        tally.check("the stack's images, model and env file are ready", False, f"{type(exc).__name__}: {exc}")
        return tally.finish()
    if stack is None:
        if os.environ.get("CI") != "true":
            print(f"{PREFIX}: Docker cannot run here (above); under CI=true that fails the run", flush=True)
        return tally.finish()
    try:
        stack.profiles = ALL_PROFILES
        stack.compose("down", "-v", "--remove-orphans", timeout=300, echo=False)  # a previous run's leftovers
        stack.profiles = UP_PROFILES
        run_checks(tally, stack)
    except Exception as exc:
        traceback.print_exc()
        tally.check("the stack runs through every check", False, f"{type(exc).__name__}: {exc}")
        for service in CPU_SERVICES:
            print(f"{PREFIX}: --- last log lines of {service}", flush=True)
            print("\n".join(stack.logs(service).splitlines()[-30:]), flush=True)
    finally:
        if not args.keep:
            tear_down(tally, stack)
    return tally.finish()


if __name__ == "__main__":
    sys.exit(main())
