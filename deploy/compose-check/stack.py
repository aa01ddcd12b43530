"""The compose stack as the check drives it: the env file, the local torch index, compose commands, health."""

from __future__ import annotations

import functools
import http.server
import json
import shlex
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tally import parse_env, render_env

HERE = Path(__file__).resolve().parent
OVERRIDE = HERE / "compose.check.yaml"
PROJECT = "kvtier"  # compose.yaml's `name:`
MODEL_MOUNT = "/models/kvtier-tiny"
# The check's edits to .env.example: the cpu profile, the local model, sizes for a shared 2-core machine,
# the object tier on the object profile's SeaweedFS.
ENV_EDITS = {
    "COMPOSE_PROFILES": "cpu",
    "MODEL": MODEL_MOUNT,
    "MAX_MODEL_LEN": "4096",
    "CPU_KV_CACHE_BYTES": "64M",
    "SHM_SIZE": "1g",
    "KVTIER_CPU_SIZE": "256MiB",
    "ARENA_TMPFS_SIZE": "512m",
    "KVTIER_DISK_SIZE": "1GiB",
    "REDIS_MAXMEMORY": "256mb",
    "KVTIER_OBJECT_URL": "s3://kvtier/chunks",  # the object profile's bucket
}
TORCH_INDEX_PORT = 18777
PORT_VARS = ("API_PORT", "ADMIN_HOST_PORT", "PROMETHEUS_HOST_PORT", "GRAFANA_HOST_PORT")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_torch_index(wheels: Path, cache: Path) -> tuple[str, http.server.ThreadingHTTPServer]:
    """An index on 127.0.0.1 whose /torch/ lists the torch wheels of the local wheel folder."""
    found = sorted(wheels.glob("torch-*.whl"))
    if not found:
        raise RuntimeError(
            f"no torch wheel in {wheels} (the Makefile's WHEELS); PyTorch's index is not reachable"
        )
    root = cache / "torch-index"
    (root / "torch").mkdir(parents=True, exist_ok=True)
    for old in (root / "torch").iterdir():
        old.unlink()
    for wheel in found:
        (root / "torch" / wheel.name).symlink_to(wheel.resolve())
    handler = functools.partial(_QuietHandler, directory=str(root))
    try:  # a fixed port keeps the URL, a build argument, the same: docker's layer cache then holds
        server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/", server


@dataclass
class Stack:
    """docker compose on compose.yaml plus the check's override, with the check's env file."""

    repo: Path
    env_file: Path
    profiles: list[str] = field(default_factory=lambda: ["cpu"])
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def prepare(cls, repo: Path, cache: Path, model_dir: Path, torch_index: str) -> Stack:
        """Write the env file: .env.example with the check's edits, free host ports, the local extras."""
        edits = dict(ENV_EDITS)
        edits.update({name: str(free_port()) for name in PORT_VARS})
        edits["KVTIER_CHECK_MODEL_DIR"] = str(model_dir)
        edits["KVTIER_CHECK_TORCH_INDEX_URL"] = torch_index
        env_file = cache / "check.env"
        env_file.write_text(render_env((repo / ".env.example").read_text(), edits))
        return cls(repo, env_file, env=parse_env(env_file.read_text()))

    def base_args(self) -> list[str]:
        """The compose command line up to the subcommand."""
        args = [
            "docker",
            "compose",
            "--project-directory",
            str(self.repo),
            "-f",
            str(self.repo / "compose.yaml"),
        ]
        args += ["-f", str(OVERRIDE), "--env-file", str(self.env_file)]
        for profile in self.profiles:
            args += ["--profile", profile]
        return args

    def compose(self, *args: str, timeout: float = 600, check: bool = True, echo: bool = True) -> str:
        """Run one compose subcommand; its stdout (stderr is shown when it fails)."""
        command = self.base_args() + list(args)
        if echo:
            print(f"compose-check: $ docker compose {' '.join(shlex.quote(a) for a in args)}", flush=True)
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"docker compose {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
            )
        return result.stdout

    def config(self) -> dict[str, Any]:
        """The resolved compose model (`docker compose config --format json`)."""
        data: dict[str, Any] = json.loads(self.compose("config", "--format", "json", echo=False))
        return data

    def exec(self, service: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command in a service's container (no TTY)."""
        command = [*self.base_args(), "exec", "-T", service, *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)

    def container(self, service: str) -> str:
        """The id of a service's running container."""
        return self.compose("ps", "-q", service, echo=False).strip()

    def inspect(self, service: str) -> dict[str, Any]:
        """docker inspect of a service's container."""
        out = subprocess.run(
            ["docker", "inspect", self.container(service)], capture_output=True, text=True, check=True
        )
        data: dict[str, Any] = json.loads(out.stdout)[0]
        return data

    def health(self, service: str) -> str:
        """healthy, starting, unhealthy, or the container's state when it has no healthcheck."""
        try:
            state = self.inspect(service)["State"]
        except (subprocess.CalledProcessError, IndexError, json.JSONDecodeError):
            return "missing"
        return str(state.get("Health", {}).get("Status") or state.get("Status"))

    def wait_healthy(
        self, services: list[str], timeout: float, since: float | None = None
    ) -> dict[str, float]:
        """Seconds until each service was healthy (from since, default now); raises naming the rest."""
        start = time.monotonic() if since is None else since
        seen: dict[str, float] = {}
        while time.monotonic() - start < timeout:
            for service in services:
                if service not in seen and self.health(service) == "healthy":
                    seen[service] = time.monotonic() - start
            if len(seen) == len(services):
                return seen
            bad = [s for s in services if s not in seen and self.health(s) in ("unhealthy", "exited", "dead")]
            if bad:
                break
            time.sleep(2)
        states = {s: self.health(s) for s in services if s not in seen}
        raise RuntimeError(f"not healthy after {time.monotonic() - start:.0f} s: {states}")

    def logs(self, service: str) -> str:
        """A service's log lines so far."""
        return self.compose("logs", "--no-color", "--no-log-prefix", service, echo=False)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, volumes and networks of the project that still exist."""
        label = f"label=com.docker.compose.project={PROJECT}"
        found = {}
        for kind, args in (("containers", ["ps", "-a", "-q"]), ("volumes", ["volume", "ls", "-q"])):
            out = subprocess.run(
                ["docker", *args, "--filter", label], capture_output=True, text=True, check=True
            )
            found[kind] = out.stdout.split()
        out = subprocess.run(
            ["docker", "network", "ls", "-q", "--filter", label], capture_output=True, text=True
        )
        found["networks"] = out.stdout.split()
        return found

    def url(self, port_var: str, path: str) -> str:
        """http://127.0.0.1:PORT/path for a published port of the env file."""
        return f"http://127.0.0.1:{self.env[port_var]}{path}"


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    """GET (or POST body as JSON) a URL on this machine; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        raw = answer.read()
    return json.loads(raw) if raw.strip() else None


def http_text(url: str, timeout: float = 30, method: str = "GET") -> str:
    """The body of a GET (or another method without a body) as text."""
    request = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return str(answer.read().decode())
