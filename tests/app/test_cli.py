"""The `kvtier` CLI: config acceptance, --help everywhere, invalid settings stop every command."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import subprocess
import tomllib
from pathlib import Path

import pytest

from kvtier.app import cli
from kvtier.app import protocol as p
from kvtier.app.client import ServiceClient
from tests.app import ROOT, SPEC, RawConn, hashes, kvtier_cmd, python_env, thread_service
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
        ["clear", "--help"],
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
    "argv",
    [["serve"], ["stats", "--json"], ["clear"], ["bench", "service", "--json"], ["bench", "storage"]],
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


# ------------------------------------------------------------------------------------------ --version
def _pyproject_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version: str = tomllib.load(f)["project"]["version"]
    return version


def test_version_names_kvtier_the_protocol_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    installed = importlib.metadata.version("kvtier")
    assert installed == _pyproject_version()  # the editable install is of this checkout
    code, out, err = _run(["--version"], capsys)
    python = platform.python_version()
    assert code == 0 and not err
    assert out == f"kvtier {installed} (protocol {p.PROTOCOL_VERSION}, Python {python})\n"


def test_version_from_a_checkout_without_metadata(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    code, out, _ = _run(["--version"], capsys)
    assert code == 0
    assert out.startswith(f"kvtier {_pyproject_version()}+checkout (protocol {p.PROTOCOL_VERSION}, ")
    assert out.endswith(f"; not installed: version read from {ROOT / 'pyproject.toml'})\n")


# --------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        ((1 << 20) - 1, "1.0 MiB"),
        (512 << 20, "512.0 MiB"),
        (2 << 30, "2.0 GiB"),
        (3 * 10**9, "2.8 GiB"),
        (5 << 40, "5.0 TiB"),
        (2048 << 50, "2048.0 PiB"),
    ],
)
def test_format_bytes_uses_binary_units(n: int, text: str) -> None:
    assert cli.format_bytes(n) == text


def test_config_shows_sizes_in_binary_units(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_CPU_SIZE", "3GiB")
    code, out, _ = _run(["config"], capsys)
    assert code == 0
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()}
    assert rows["cpu_size"].split() == ["3.0", "GiB", "(env)"]
    assert rows["disk_size"].split() == ["16.0", "GiB", "(default)"]
    assert rows["chunk_size"].split() == ["256", "(default)"]  # a count, not a size


def _store_chunks(url: str, n: int) -> None:
    with ServiceClient(url) as client:
        namespace = client.hello(SPEC).result(5).namespace
        keys = hashes(n)
        got = client.reserve(namespace, keys).result(5)
        client.commit(namespace, keys, got.slots).result(5)


def test_stats_shows_sizes_and_json_keeps_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with thread_service(tmp_path) as svc:
        _store_chunks(svc.url, 3)
        code, out, _ = _run(["stats", "--url", svc.url], capsys)
        assert code == 0
        lines = out.splitlines()
        assert lines[0].split() == [
            "tier", "chunks", "bytes", "capacity", "hits", "stores", "evictions", "errors", "read",
            "written", "state",
        ]  # fmt: skip
        cpu = next(line for line in lines if line.startswith("cpu "))
        assert cpu.split() == "cpu 3 6.0 KiB 4.0 MiB 0 3 0 0 0 B 6.0 KiB up".split()
        code, out, _ = _run(["stats", "--url", svc.url, "--json"], capsys)
        assert code == 0
        tier = json.loads(out)["tiers"]["cpu"]
        assert (tier["bytes"], tier["capacity"], tier["bytes_written"]) == (6 << 10, 4 << 20, 6 << 10)


# --------------------------------------------------------------------------------------------- clear
def test_clear_drops_the_chunks_of_the_named_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with thread_service(tmp_path, disk_path=str(tmp_path / "disk"), disk_size="1MiB") as svc:
        _store_chunks(svc.url, 3)

        def chunks() -> tuple[int, int]:
            tiers = svc.service.store.stats().tiers  # type: ignore[union-attr]
            return tiers["cpu"].chunks, tiers["disk"].chunks

        assert svc.wait_for(lambda: chunks() == (3, 3)), svc.call(chunks)  # written behind to disk
        code, out, err = _run(["clear", "--url", svc.url, "--tier", "cpu"], capsys)
        assert (code, out, err) == (0, "dropped 3 chunks from cpu\n", "")
        assert svc.call(chunks) == (0, 3)
        code, out, err = _run(["clear", "--url", svc.url, "--tier", "disk,redis"], capsys)
        assert (code, out) == (0, "dropped 3 chunks from disk\n")
        assert err == "kvtier clear: the service has no redis tier\n"
        assert svc.call(chunks) == (0, 0)
        _store_chunks(svc.url, 2)
        assert svc.wait_for(lambda: chunks() == (2, 2)), svc.call(chunks)
        code, out, _ = _run(["clear", "--url", svc.url, "--tier", "disk", "--tier", "cpu", "--json"], capsys)
        assert code == 0
        assert json.loads(out) == {"dropped": 4, "tiers": ["cpu", "disk"], "absent": []}
        assert svc.call(chunks) == (0, 0)


@pytest.mark.parametrize("tier", ["ssd", "cpu,ssd", "CPU,,gpu", ""])
def test_clear_names_an_unknown_tier_and_the_allowed_ones(
    tier: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(["clear", "--url", "unix:///nonexistent/kvtier.sock", "--tier", tier], capsys)
    bad = [name for name in tier.lower().split(",") if name and name not in ("cpu", "disk", "redis")]
    what = f"unknown tier {bad[0]!r}" if bad else "no tier named"
    assert code == 2 and not out
    assert f"argument --tier: {what}; allowed: cpu, disk, redis, object" in err


def test_clear_of_an_unreachable_service_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"unix://{tmp_path}/none.sock"
    code, out, err = _run(["clear", "--url", url, "--timeout", "2"], capsys)
    assert code == 1 and not out
    assert err.startswith(f"kvtier clear: kvtier service {url}: cannot connect")


# ------------------------------------------------------------------------------------- namespaces
def test_stats_lists_each_namespace_with_its_ranks_chunk_and_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a router operator needs for POST /lookup: each namespace id and whose KV it holds."""
    rank1 = dataclasses.replace(SPEC, tp_rank=1, tp_size=2)
    mla = dataclasses.replace(SPEC, model="mla-model", chunk_size=128, tp_rank=-1, tp_size=2)
    with thread_service(tmp_path) as svc, ServiceClient(svc.url) as client:
        code, out, _ = _run(["stats", "--url", svc.url], capsys)
        assert code == 0 and out.splitlines()[-1] == "namespaces         0"
        ids = [client.hello(spec).result(5).namespace for spec in (SPEC, rank1, mla)]
        code, out, _ = _run(["stats", "--url", svc.url], capsys)
    assert code == 0
    lines = out.splitlines()
    at = lines.index("namespaces         3")
    expected = {
        ids[0]: f"  {ids[0]}  tp 0/1  block 16  chunk 64  test-model",
        ids[1]: f"  {ids[1]}  tp 1/2  block 16  chunk 64  test-model",
        ids[2]: f"  {ids[2]}  tp all/2  block 16  chunk 128  mla-model",
    }
    assert lines[at + 1 :] == [expected[ns] for ns in sorted(ids)]  # sorted by id, as in the JSON
