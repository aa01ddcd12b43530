"""The wheel ships one import name, kvtier, and works on its own: installed into a fresh venv and run
from a folder that is not the checkout, it imports, runs the connector benchmark on a real engine and
serves hits to an engine."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("app", "storage", "connector", "bench", "runtime")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the checkout, built offline from a copy of its sources."""
    # A copy: setuptools writes build/ and *.egg-info beside the sources it builds, and a build/lib
    # left in the checkout by an earlier build would carry deleted modules into the wheel.
    src = tmp_path_factory.mktemp("src")
    for name in SHIPPED:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    built = subprocess.run(
        [*pip_wheel, "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (path,) = out.glob("kvtier-*.whl")
    return path


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_holds_the_product_under_kvtier_only(wheel: Path) -> None:
    names = _names(wheel)
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"kvtier", "kvtier-0.1.0.dist-info"}, tops
    for folder in SHIPPED:
        assert f"kvtier/{folder}/__init__.py" in names, folder
    assert "kvtier/connector/plugin.py" in names and "kvtier/app/cli.py" in names
    assert "kvtier/bench/harness.py" in names, "the benchmarks bring their own engine harness"
    assert "kvtier-0.1.0.dist-info/licenses/LICENSE" in names
    assert not any("/tests/" in name or name.startswith("tests/") for name in names)


def test_wheel_ships_every_module_of_the_tree(wheel: Path) -> None:
    """Every Python file under the shipped folders, subpackages included, is in the wheel under
    kvtier/<folder>/...: setup.py discovers packages, so a new subpackage cannot be left out."""
    names = set(_names(wheel))
    expected = {
        f"kvtier/{path.relative_to(REPO).as_posix()}"
        for folder in SHIPPED
        for path in (REPO / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert len(expected) > 100
    assert not expected - names, sorted(expected - names)
    for name in expected:
        folder = name.rsplit("/", 1)[0]
        assert f"{folder}/__init__.py" in names, f"{folder} is not a package: its modules cannot import"


def test_wheel_entry_points_name_the_kvtier_modules(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read("kvtier-0.1.0.dist-info/entry_points.txt").decode()
    points = configparser.ConfigParser()
    points.read_string(text)
    assert dict(points["console_scripts"]) == {"kvtier": "kvtier.app.cli:main"}
    assert dict(points["vllm.general_plugins"]) == {"kvtier": "kvtier.connector.plugin:register"}


def _third_party_site(tmp: Path) -> Path:
    """A folder of links to this venv's packages, kvtier's own install (editable) left out."""
    site = Path(sysconfig.get_paths()["purelib"])
    deps = tmp / "deps"
    deps.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("__editable__", "kvtier")) or name.endswith(".pth"):
            continue
        (deps / entry.name).symlink_to(entry)
    return deps


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed; third-party packages come from this venv (no download)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    own_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # A path line in a .pth file goes on sys.path after the venv's own site-packages.
    (own_site / "zz_third_party.pth").write_text(f"{_third_party_site(tmp)}\n")
    pip_install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
    installed = subprocess.run(
        [*pip_install, str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    return venv


@pytest.mark.e2e
def test_installed_wheel_imports_and_runs_the_connector_benchmark(wheel: Path, tmp_path: Path) -> None:
    venv = _fresh_venv(tmp_path, wheel)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("KVTIER_")}
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import json, sys, kvtier.connector, kvtier.bench.connector; "
         "print(json.dumps({'kvtier': list(kvtier.__path__), 'connector': kvtier.connector.__file__, "
         "'tests': 'tests' in sys.modules}))"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert len(found["kvtier"]) == 1 and Path(found["kvtier"][0]).is_relative_to(venv), found
    assert Path(found["connector"]).is_relative_to(venv), found
    assert not found["tests"], "nothing that ships imports the tests"

    # The quick subset: block copies, and one real engine with kvtier serving 16 requests.
    bench = subprocess.run(
        [str(venv / "bin" / "kvtier"), "bench", "connector", "--quick", "--json"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-3000:]
    figures = json.loads(bench.stdout)
    assert figures["copy"]["chunk_bytes"] > 0 and figures["copy_ratio"] > 0
    scheduler = figures["scheduler"]
    assert scheduler["steps"] > 0 and scheduler["schedule_ms_per_step"] > 0
    assert "ttft" not in figures

    # The installed connector serves an engine: hook timings prove nothing of it (vLLM times its
    # hooks when kvtier is idle too, and the benchmark's prompts share no prefix), hits do.
    served = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _HITS, str(tmp_path / "model"), str(tmp_path / "shm")],
        cwd=workdir, env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr[-3000:]
    (line,) = [x for x in served.stdout.splitlines() if x.startswith(_MARK)]  # vLLM logs to stdout too
    hits = json.loads(line.removeprefix(_MARK))
    # The second prompt shares 260 tokens with the first, which stored them: 4 whole chunks of 64.
    assert hits == {"external_tokens": 4 * 64, "active": 1.0, "unexpected_errors": []}, hits


# Run by the installed wheel's python, from a folder that is not the checkout: two prompts with a
# shared prefix on an engine with kvtier's embedded service; prints what kvtier served.
_HITS = """
import json, sys
from pathlib import Path
from kvtier.bench.harness import generate_each, kv_transfer_config, make_prompt, metric, running_engine
from kvtier.bench.models import build_model
from kvtier.connector import faults

model, shm = str(build_model(sys.argv[1])), Path(sys.argv[2])
shm.mkdir()
shared = make_prompt(300, 260)
prompts = [shared + make_prompt(301, 30), shared + make_prompt(302, 50)]
cfg = kv_transfer_config(chunk_size=64, cpu_size="64MiB", shm_dir=str(shm))
with running_engine(model, cfg, enable_prefix_caching=False) as llm:
    generate_each(llm, prompts, 4)
    served = {
        "external_tokens": metric(llm, "vllm:kvtier_external_tokens"),
        "active": metric(llm, "vllm:kvtier_active"),
        "unexpected_errors": faults.unexpected_errors(),
    }
print("@@kvtier-hits " + json.dumps(served), flush=True)
"""
_MARK = "@@kvtier-hits "
