"""The `kvtier` CLI: config acceptance, --help everywhere, invalid settings stop every command."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from kvtier.app import cli
from kvtier.app import protocol as p
from tests.app import ROOT, RawConn, kvtier_cmd, python_env, thread_service
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

PASSWORD = "hunter2-pa55word"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVTIER_"):
            monkeypatch.delenv(key)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse --help and usage errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_config_names_a_bad_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_CPU_SIZE", "banana")
    code, out, err = _run(["config"], capsys)
    assert code != 0 and "KVTIER_CPU_SIZE" in err and not out


def test_config_names_an_unknown_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_NOPE", "1")
    code, _, err = _run(["config"], capsys)
    assert code != 0 and "KVTIER_NOPE" in err


def test_config_json_shows_value_and_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_CPU_SIZE", "3GiB")
    code, out, _ = _run(["config", "--json"], capsys)
    assert code == 0
    assert json.loads(out)["cpu_size"] == {"value": 3221225472, "source": "env"}


@pytest.mark.parametrize("extra", [{}, {"KVTIER_CPU_SIZE": "banana"}])
def test_redis_password_is_never_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extra: dict[str, str]
) -> None:
    monkeypatch.setenv("KVTIER_REDIS_URL", f"redis://user:{PASSWORD}@127.0.0.1:6379/0")
    monkeypatch.setenv("KVTIER_AUTH_TOKEN", "tok-" + PASSWORD)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    for argv in (["config"], ["config", "--json"]):
        _code, out, err = _run(argv, capsys)
        assert PASSWORD not in out + err
    monkeypatch.setenv("KVTIER_REDIS_URL", f"redis://user:{PASSWORD}@/0")  # invalid: no host
    _code, out, err = _run(["config"], capsys)
    assert "KVTIER_REDIS_URL" in err and PASSWORD not in out + err


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["config", "--help"],
        ["serve", "--help"],
        ["stats", "--help"],
        ["bench", "--help"],
        ["bench", "service", "--help"],
    ],
)
def test_help_on_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(argv, capsys)
    assert code == 0 and "usage:" in out


def test_help_of_other_benchmarks_when_installed(capsys: pytest.CaptureFixture[str]) -> None:
    for name, (module, _) in cli.BENCHES.items():
        code, out, err = _run(["bench", name, "--help"], capsys)
        if importlib.util.find_spec(module) is None:
            assert code == 2 and "not available" in err
        else:
            assert code == 0 and "usage:" in out, (name, err)


@pytest.mark.parametrize(
    "argv", [["serve"], ["stats", "--json"], ["bench", "service", "--json"], ["bench", "storage"]]
)
def test_invalid_configuration_stops_every_command(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("KVTIER_LEASE_TTL", "-1")
    code, out, err = _run(argv, capsys)
    assert code == 2 and "KVTIER_LEASE_TTL" in err and not out
    assert not list(tmp_path.iterdir())  # nothing was started


def test_serve_refuses_a_public_tcp_address_without_a_token(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = python_env(KVTIER_SHM_DIR=str(tmp_path))
    out = subprocess.run(
        kvtier_cmd("serve", "--url", f"tcp://0.0.0.0:{port}"),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "KVTIER_AUTH_TOKEN" in out.stderr
    assert not list(tmp_path.iterdir())


def test_console_entry_point_runs(tmp_path: Path) -> None:
    env = python_env(KVTIER_CPU_SIZE="banana")
    out = subprocess.run(kvtier_cmd("config"), env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "KVTIER_CPU_SIZE" in out.stderr


def test_stats_lists_the_engines_connected_and_their_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with thread_service(tmp_path) as svc, RawConn(svc.url) as sched, RawConn(svc.url) as worker:
        sched.hello()
        worker.hello()
        sched.call(p.Report(id=2, engine_id="engine-7", role="scheduler", active=True))
        worker.call(p.Report(id=2, engine_id="engine-7", role="worker", active=False, reason="1-D KV"))
        code, out, _ = _run(["stats", "--url", svc.url], capsys)
        assert code == 0
        assert "engines            2" in out
        assert "  engine-7  scheduler  active" in out
        assert "  engine-7  worker     idle: 1-D KV" in out
        code, out, _ = _run(["stats", "--url", svc.url, "--json"], capsys)
        assert code == 0
        assert json.loads(out)["engines"] == [
            {"engine_id": "engine-7", "role": "scheduler", "active": True, "reason": ""},
            {"engine_id": "engine-7", "role": "worker", "active": False, "reason": "1-D KV"},
        ]
