"""A running Docker engine with Compose v2: Debian's packages installed, the daemon started, the plugins.

Debian bookworm's docker.io (20.10) brings the engine; its docker-compose is v1, so Compose v2 and buildx
(which newer docker CLIs need for BuildKit) come from Debian trixie's packages, downloaded with a private
apt configuration (the machine's own sources are left alone) and placed as docker CLI plugins.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

PLUGIN_DIR = Path("/usr/libexec/docker/cli-plugins")
# Debian packages that carry the docker CLI plugins, and the suite to take them from.
PLUGIN_PACKAGES = {"docker-compose": "docker-compose", "docker-buildx": "docker-buildx"}
PLUGIN_SUITE = "trixie"
MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


class EngineError(RuntimeError):
    """Docker cannot run here; the message says why."""


def run(args: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing its output as text."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise EngineError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()[-800:]}")
    return result


def _apt_install(*packages: str) -> None:
    if os.geteuid() != 0:
        raise EngineError(
            f"{', '.join(packages)} missing and not root: apt-get install -y {' '.join(packages)}"
        )
    print(f"compose-check: installing {' '.join(packages)} from Debian's packages", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *packages], check=True, env=env, capture_output=True)


def ensure_packages() -> None:
    """docker.io (engine, containerd, runc) and debootstrap (for stand-in base images)."""
    wanted = [
        pkg
        for pkg, tool in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
        if not shutil.which(tool)
    ]
    if not shutil.which("docker") and "docker.io" not in wanted:
        wanted.append("docker.io")
    if wanted:
        _apt_install(*wanted)


def daemon_answers() -> bool:
    """True when `docker info` reaches a daemon."""
    try:
        return (
            run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=20, check=False).returncode == 0
        )
    except subprocess.TimeoutExpired:
        return False


def ensure_daemon(log_path: Path) -> None:
    """Start dockerd in the background when no daemon answers (it keeps running after the check)."""
    if daemon_answers():
        return
    if os.geteuid() != 0:
        raise EngineError("no Docker daemon answers and only root may start one (dockerd)")
    print(f"compose-check: starting dockerd (log: {log_path})", flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        subprocess.Popen(
            ["dockerd"], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if daemon_answers():
            return
        time.sleep(1)
    tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
    raise EngineError(f"dockerd did not answer within 90 s; its log ends:\n{tail}")


def _has_plugin(name: str) -> bool:
    sub = name.removeprefix("docker-")
    return run(["docker", sub, "version"], timeout=30, check=False).returncode == 0


def _download_plugin_debs(cache: Path, packages: list[str]) -> list[Path]:
    """Debian trixie's .deb of each package, fetched once into cache with a private apt state."""
    root = cache / "apt-trixie"
    debs = root / "debs"
    found = [next(iter(sorted(debs.glob(f"{pkg}_*.deb"))), None) for pkg in packages] if debs.exists() else []
    if found and all(found):
        return [path for path in found if path]
    for sub in ("lists/partial", "cache/archives/partial", "debs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    sources = root / "sources.list"
    sources.write_text(f"deb [signed-by={KEYRING}] {MIRROR} {PLUGIN_SUITE} main\n")
    options = [
        f"-o=Dir::Etc::SourceList={sources}",
        "-o=Dir::Etc::SourceParts=/dev/null",
        f"-o=Dir::State::Lists={root / 'lists'}",
        f"-o=Dir::Cache={root / 'cache'}",
        "-o=Dir::State::status=/dev/null",
        "-o=APT::Sandbox::User=root",
    ]
    run(["apt-get", *options, "update", "-qq"], timeout=300)
    subprocess.run(["apt-get", *options, "download", *packages], cwd=debs, check=True, capture_output=True)
    return [next(iter(sorted(debs.glob(f"{pkg}_*.deb")))) for pkg in packages]


def ensure_plugins(cache: Path) -> None:
    """docker compose (v2) and docker buildx as CLI plugins, from Debian trixie's packages when absent."""
    missing = [name for name in PLUGIN_PACKAGES if not _has_plugin(name)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise EngineError(f"docker plugins missing ({', '.join(missing)}) and not root to install them")
    print(f"compose-check: installing {', '.join(missing)} from Debian {PLUGIN_SUITE}'s packages", flush=True)
    debs = _download_plugin_debs(cache, [PLUGIN_PACKAGES[name] for name in missing])
    PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
    for name, deb in zip(missing, debs, strict=True):
        unpacked = cache / "apt-trixie" / "unpacked" / name
        shutil.rmtree(unpacked, ignore_errors=True)
        unpacked.mkdir(parents=True)
        run(["dpkg-deb", "-x", str(deb), str(unpacked)])
        binary = unpacked / "usr/libexec/docker/cli-plugins" / name
        shutil.copy2(binary, PLUGIN_DIR / name)
    still = [name for name in missing if not _has_plugin(name)]
    if still:
        raise EngineError(f"docker plugins still not usable after installing: {', '.join(still)}")


def ensure_engine(cache: Path) -> str:
    """Everything the check needs from Docker; returns the compose version line."""
    ensure_packages()
    ensure_daemon(cache / "dockerd.log")
    ensure_plugins(cache)
    version = run(["docker", "compose", "version", "--short"]).stdout.strip()
    if not version.lstrip("v").startswith("2."):
        raise EngineError(f"docker compose {version} is not Compose v2")
    return version
