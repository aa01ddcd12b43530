"""Invalid settings of every kind: a clear error naming the key, a non-zero exit, nothing started.

`kvtier serve` and `kvtier config` run as real processes, with each bad value given as a KVTIER_*
variable or in the YAML file named by KVTIER_CONFIG_FILE; afterwards no socket and no arena file may
exist. An engine whose kv_connector_extra_config holds a bad value must not start.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.app.settings import SettingsError
from kvtier.bench.harness import kv_transfer_config, running_engine
from tests.reliability.openai_load import REPO, kvtier_files, service_pids

# A bad value for every setting whose domain is narrower than "any string", as the environment gives
# it (a string). Checked a group at a time: the error must name every bad key of its group.
ENV_CASES = [
    ("service_url", "http://127.0.0.1:7000"),
    ("chunk_size", "0"),
    ("cpu_size", "512KiB"),
    ("disk_size", "-1GB"),
    ("disk_fsync", "maybe"),
    ("redis_url", "ftp://127.0.0.1:6379"),
    ("redis_cluster", "perhaps"),
    ("redis_ttl", "-1"),
    ("redis_timeout", "0"),
    ("redis_pool_size", "100000"),
    ("breaker_period", "-2"),
    ("write_policy", "sometimes"),
    ("write_queue_size", "0"),
    ("save_decode", "maybe"),
    ("lease_ttl", "0"),
    ("lookup_budget_ms", "-1"),
    ("admin_port", "70000"),
    ("log_level", "LOUD"),
    ("chunk_size", "many"),
    ("cpu_size", "lots"),
    ("service_url", "unix://"),
]
ENV_GROUP = 7
# String settings can only be of the wrong type, which YAML can express; and YAML can be broken.
YAML_CASES = [
    (["auth_token", "disk_path", "admin_host", "shm_dir"],
     "auth_token: [a, b]\ndisk_path: {a: 1}\nadmin_host: [1]\nshm_dir: [1]\n"),
    (["chunk_size"], "chunk_size: -5\n"),
    (["no_such_setting"], "no_such_setting: 1\n"),
    (["KVTIER_CONFIG_FILE"], "cpu_size: [unclosed\n"),  # not YAML
    (["KVTIER_CONFIG_FILE"], "- a\n- b\n"),  # not a mapping
]  # fmt: skip


def _kvtier() -> list[str]:
    script = Path(sys.executable).with_name("kvtier")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.app.cli"]


@dataclass
class Outcome:
    """One `kvtier` run: exit status, stderr, and the kvtier files in its directory afterwards."""

    argv: str
    returncode: int
    stderr: str
    files: list[str]


def _run(args: list[str], env: dict[str, str], where: Path) -> Outcome:
    where.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            [*_kvtier(), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=30
        )
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:  # it started serving: that is the failure
        code, err = -9, f"still running after 30s: {exc.stderr!r}"
    files = [p.name for p in kvtier_files(where)]
    shutil.rmtree(where, ignore_errors=True)
    return Outcome(" ".join(args), code, err, files)


def _base_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)
    env["KVTIER_SHM_DIR"] = str(tmp)
    env["KVTIER_CPU_SIZE"] = "8MiB"
    return env


def _check(outcome: Outcome, names: list[str], problems: list[str], every: bool = True) -> None:
    """Non-zero exit, the key(s) named (all of them, or any spelling of one), nothing left behind."""
    if outcome.returncode == 0 or outcome.returncode < 0:
        problems.append(f"{outcome.argv} with {names}: exit {outcome.returncode}")
    elif "Traceback" in outcome.stderr:
        problems.append(f"{outcome.argv} with {names}: crashed instead of a clear error: {outcome.stderr!r}")
    else:
        named = [n for n in names if n in outcome.stderr]
        if (every and len(named) != len(names)) or not named:
            missing = sorted(set(names) - set(named))
            problems.append(f"{outcome.argv}: the error does not name {missing}: {outcome.stderr.strip()!r}")
    if outcome.files:
        problems.append(f"{outcome.argv} with {names}: left {outcome.files}")


def test_serve_and_config_refuse_every_invalid_setting(tmp_path: Path) -> None:
    jobs: list[tuple[list[str], dict[str, str], Path]] = []
    for i in range(0, len(ENV_CASES), ENV_GROUP):
        group = ENV_CASES[i : i + ENV_GROUP]
        env = {f"KVTIER_{key.upper()}": value for key, value in group}
        jobs.append((list(env), env, tmp_path / f"env{i}"))
    jobs.append((["KVTIER_NO_SUCH_SETTING"], {"KVTIER_NO_SUCH_SETTING": "1"}, tmp_path / "unknown"))
    absent = str(tmp_path / "absent.yaml")
    jobs.append((["KVTIER_CONFIG_FILE"], {"KVTIER_CONFIG_FILE": absent}, tmp_path / "no-file"))
    for i, (keys, text) in enumerate(YAML_CASES):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(text)
        names = [k if k.startswith("KVTIER_") else f"'{k}'" for k in keys]
        jobs.append((names, {"KVTIER_CONFIG_FILE": str(path)}, tmp_path / f"yaml{i}"))

    def both(job: tuple[list[str], dict[str, str], Path]) -> list[tuple[list[str], Outcome]]:
        names, extra, where = job
        env = {**_base_env(where), **extra}
        if "'shm_dir'" in names:  # the environment would override the file's (bad) value
            del env["KVTIER_SHM_DIR"]
        serve = _run(["serve", "--url", f"unix://{where}/kvtier.sock"], env, where)
        config = _run(["config"], env, where)
        return [(names, serve), (names, config)]

    problems: list[str] = []
    with ThreadPoolExecutor(4) as pool:
        for results in pool.map(both, jobs):
            for names, outcome in results:
                _check(outcome, names, problems)
    assert not problems, "\n".join(problems)


def test_a_secret_setting_of_the_wrong_type_is_a_clear_error(tmp_path: Path) -> None:
    """`redis_url: 5` in the YAML file: an error naming the key, not a traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text("redis_url: 5\n")
    env = {**_base_env(tmp_path / "shm"), "KVTIER_CONFIG_FILE": str(path)}
    problems: list[str] = []
    for args in (["serve", "--url", f"unix://{tmp_path}/shm/kvtier.sock"], ["config"]):
        _check(_run(args, env, tmp_path / "shm"), ["'redis_url'"], problems)
    assert not problems, "\n".join(problems)


def _busy_port() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock


@pytest.mark.parametrize(
    "setting",
    ["shm_dir", "cpu_size", "auth_token", "admin_host", "admin_port"],
)
def test_serve_names_the_setting_it_cannot_start_with(tmp_path: Path, setting: str) -> None:
    """Values that are well-formed but cannot work on this machine fail at start, naming the key."""
    env = _base_env(tmp_path / "shm")
    args = ["serve", "--url", f"unix://{tmp_path}/shm/kvtier.sock"]
    busy = _busy_port()
    try:
        if setting == "shm_dir":
            env["KVTIER_SHM_DIR"] = str(tmp_path / "no-such-dir")
        elif setting == "cpu_size":
            env["KVTIER_CPU_SIZE"] = "64TiB"  # more than the shm_dir's filesystem holds
        elif setting == "auth_token":
            env["KVTIER_SERVICE_URL"] = "tcp://0.0.0.0:7711"  # non-loopback without a token
            args = ["serve"]
        elif setting == "admin_host":
            env.update(KVTIER_ADMIN_HOST="256.0.0.1", KVTIER_ADMIN_PORT="7712")
        else:
            env["KVTIER_ADMIN_PORT"] = str(busy.getsockname()[1])  # already in use
        outcome = _run(args, env, tmp_path / "shm")
    finally:
        busy.close()
    problems: list[str] = []
    _check(outcome, [setting, f"KVTIER_{setting.upper()}"], problems, every=False)
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------- the engine
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"chunk_size": "abc"}, "chunk_size"),
        ({"cpu_size": "1KiB"}, "cpu_size"),
        ({"no_such_key": 1}, "no_such_key"),
    ],
)
def test_engine_with_invalid_extra_config_does_not_start(
    tiny_model: str, tmp_path: Path, extra: dict, key: str
) -> None:
    cfg = kv_transfer_config(shm_dir=str(tmp_path), **extra)
    with pytest.raises(SettingsError) as info, running_engine(tiny_model, cfg):
        pass
    assert f"kv_connector_extra_config key '{key}'" in str(info.value), info.value
    assert not service_pids(os.getpid()), "a kvtier service was started"
    assert not kvtier_files(tmp_path), "an arena was created"


@pytest.mark.e2e
def test_engine_refuses_a_chunk_size_that_is_not_a_multiple_of_the_block_size(
    tiny_model: str, tmp_path: Path
) -> None:
    """chunk_size=48 with vLLM's block size 32 cannot be served: an error, not a silently idle cache."""
    cfg = kv_transfer_config(shm_dir=str(tmp_path), chunk_size=48)
    started = False
    try:
        with running_engine(tiny_model, cfg):
            started = True
    except Exception as exc:
        assert "chunk_size" in str(exc), exc
    assert not started, "the engine started with kvtier idle instead of refusing chunk_size=48"
