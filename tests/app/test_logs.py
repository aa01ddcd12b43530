"""The service's log lines: JSON with ISO-8601 times for `kvtier serve`, vLLM-like text for the embedded
service, secrets scrubbed in both, and the format chosen by log_format. kvtier's lines inside vLLM's
processes go to vLLM's handlers at kvtier's level."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kvtier.app.logs import JsonFormatter, TextFormatter, iso_time, resolve_format, setup_logging
from kvtier.connector.logs import ToVllmHandlers, route_to_vllm, vllm_log_stream
from tests.app import ROOT, kvtier_cmd, python_env, wait_until
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401

# vLLM's own line: "(EngineCore pid=12) INFO 05-06 12:34:56 [core.py:101] message".
TEXT_LINE = re.compile(
    r"^\(kvtier-service pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) (?P<time>\d\d-\d\d \d\d:\d\d:\d\d) "
    r"\[(?P<file>[\w.]+):(?P<line>\d+)\] (?P<msg>.*)$"
)
CREATED = 1_746_534_896.789  # 2025-05-06T12:34:56.789Z


def _record(msg: str = "serving", level: int = logging.INFO, **fields: object) -> logging.LogRecord:
    record = logging.LogRecord("kvtier.server", level, "/x/app/server.py", 42, msg, None, None)
    record.created = CREATED
    record.__dict__.update(fields)
    return record


def test_json_line_has_an_iso8601_utc_time_and_the_records_fields() -> None:
    line = JsonFormatter().format(_record(url="unix:///run/k.sock", arena_bytes=4096))
    entry = json.loads(line)
    assert list(entry) == ["time", "level", "logger", "msg", "url", "arena_bytes"]
    assert entry["time"] == "2025-05-06T12:34:56.789Z"
    assert datetime.fromisoformat(entry["time"]) == datetime.fromtimestamp(CREATED, UTC).replace(
        microsecond=789000
    )
    assert (entry["level"], entry["logger"], entry["msg"]) == ("INFO", "kvtier.server", "serving")
    assert (entry["url"], entry["arena_bytes"]) == ("unix:///run/k.sock", 4096)


def test_iso_time_is_utc_with_milliseconds() -> None:
    assert iso_time(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso_time(CREATED) == "2025-05-06T12:34:56.789Z"


def test_json_line_carries_a_traceback_in_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed", logging.ERROR, exc_info=sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert json.loads(line)["exc"].endswith("ValueError: boom")


def test_text_line_looks_like_vllms_with_fields_as_key_value() -> None:
    line = TextFormatter().format(_record(url="unix:///run/k.sock", admin="", reason="no answer"))
    match = TEXT_LINE.match(line)
    assert match, line
    assert match["level"] == "INFO" and (match["file"], match["line"]) == ("server.py", "42")
    assert match["time"] == datetime.fromtimestamp(CREATED).strftime("%m-%d %H:%M:%S")  # local, as vLLM's
    assert match["msg"] == 'serving url=unix:///run/k.sock admin="" reason="no answer"'


def test_text_line_without_fields_is_the_message_and_a_traceback_follows() -> None:
    assert TEXT_LINE.match(TextFormatter().format(_record("stopped")))["msg"] == "stopped"  # type: ignore[index]
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed", logging.ERROR, exc_info=sys.exc_info())
    first, *rest = TextFormatter().format(record).splitlines()
    assert TEXT_LINE.match(first)["level"] == "ERROR"  # type: ignore[index]
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom"


@pytest.mark.parametrize(
    ("setting", "embedded", "expected"),
    [
        ("auto", True, "text"),
        ("auto", False, "json"),
        ("json", True, "json"),
        ("text", False, "text"),
    ],
)
def test_auto_means_text_embedded_and_json_standalone(setting: str, embedded: bool, expected: str) -> None:
    assert resolve_format(setting, embedded) == expected


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_setup_logging_writes_the_format_and_scrubs_secrets(fmt: str) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    try:
        setup_logging("INFO", ["hunter2-secret"], stream=stream, fmt=fmt)  # type: ignore[arg-type]
        logging.getLogger("kvtier.test").info("token %s", "hunter2-secret", extra={"url": "x hunter2-secret"})
        logging.getLogger("kvtier.test").debug("below the level")
    finally:
        for handler in [h for h in root.handlers if getattr(h, "_kvtier", False)]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "hunter2" not in lines[0]
    if fmt == "json":
        assert (json.loads(lines[0])["msg"], json.loads(lines[0])["url"]) == ("token ***", "x ***")
    else:
        assert TEXT_LINE.match(lines[0])["msg"] == 'token *** url="x ***"'  # type: ignore[index]


def _serve(tmp_path: Path, args: list[str], **env: str) -> tuple[str, str]:
    """Run a service process until it serves, stop it with SIGTERM; its stdout and stderr."""
    sock = tmp_path / "svc.sock"
    proc = subprocess.Popen(
        [*args, "--url", f"unix://{sock}"],
        env=python_env(KVTIER_SHM_DIR=str(tmp_path), KVTIER_CPU_SIZE="4MiB", **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_until(sock.exists, 30), "the service did not start"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return out, err


def test_kvtier_serve_writes_json_lines_and_names_ignored_service_links(tmp_path: Path) -> None:
    out, err = _serve(
        tmp_path, kvtier_cmd("serve"), KVTIER_SERVICE_HOST="10.0.0.1", KVTIER_PORT="tcp://10.0.0.1:7711"
    )
    assert out == ""
    entries = [json.loads(line) for line in err.splitlines()]
    assert [e["msg"] for e in entries if e["logger"] == "kvtier.server"] == ["serving", "stopped"]
    for entry in entries:
        assert datetime.fromisoformat(entry["time"]).tzinfo == UTC
    ignored = [e for e in entries if e["logger"] == "kvtier.settings"]
    assert [(e["level"], e["msg"]) for e in ignored] == [
        (
            "INFO",
            "kvtier ignores 2 Kubernetes service-link variable(s), which are not settings: "
            "KVTIER_PORT, KVTIER_SERVICE_HOST",
        )
    ]


def test_kvtier_serve_writes_text_when_asked(tmp_path: Path) -> None:
    _out, err = _serve(tmp_path, kvtier_cmd("serve"), KVTIER_LOG_FORMAT="text")
    lines = err.splitlines()
    assert lines and all(TEXT_LINE.match(line) for line in lines), err
    assert [m["msg"].split()[0] for m in map(TEXT_LINE.match, lines) if m and m["file"] == "server.py"] == [
        "serving",
        "stopped",
    ]


def test_the_embedded_service_writes_text_to_the_stream_it_is_given(tmp_path: Path) -> None:
    """As the embedded spawner starts it: a parent to watch, and vLLM's stream (stdout by default)."""
    server = [sys.executable, "-m", "kvtier.app.server", "--parent-pid", str(os.getpid())]
    out, err = _serve(tmp_path, [*server, "--log-stream", "stdout"])
    assert err == ""
    matches = [TEXT_LINE.match(line) for line in out.splitlines()]
    assert all(matches), out
    assert [m["msg"].split()[0] for m in matches if m and m["file"] == "server.py"] == ["serving", "stopped"]


class _Keep(logging.Handler):
    """Keeps the messages it is handed."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def vllm_handler() -> Iterator[_Keep]:
    """A handler on vLLM's logger at INFO, as vLLM configures it, and no other (importing vLLM earlier in
    this process adds its stdout handler); kvtier's loggers restored after."""
    loggers = [logging.getLogger(name) for name in ("vllm", "vllm.kvtier", "kvtier")]
    saved = [(lg, lg.level, list(lg.handlers)) for lg in loggers]
    handler = _Keep(logging.INFO)
    loggers[0].handlers[:] = [handler]
    try:
        yield handler
    finally:
        for lg, level, handlers in saved:
            lg.setLevel(level)
            lg.handlers[:] = handlers


def test_kvtier_lines_in_vllms_processes_reach_vllms_handlers_at_kvtiers_level(vllm_handler: _Keep) -> None:
    connector, client = logging.getLogger("vllm.kvtier.connector"), logging.getLogger("kvtier.client")
    route_to_vllm("WARNING")
    connector.info("connector info, below kvtier's level")
    connector.warning("connector warning")
    client.info("client info, below kvtier's level")
    client.warning("client warning")
    route_to_vllm("DEBUG")  # again: still one hand-over to vLLM's handlers
    client.info("client info")
    client.debug("client debug, below the level of vLLM's handler")
    assert vllm_handler.messages == ["connector warning", "client warning", "client info"]
    assert sum(isinstance(h, ToVllmHandlers) for h in logging.getLogger("kvtier").handlers) == 1


def test_the_embedded_service_logs_to_the_stream_vllm_logs_to(vllm_handler: _Keep) -> None:
    assert vllm_log_stream() == "stderr"  # no stream handler on vLLM's logger: stderr
    vllm = logging.getLogger("vllm")
    for stream, expected in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        handler = logging.StreamHandler(stream)
        vllm.addHandler(handler)
        try:
            assert vllm_log_stream() == expected
        finally:
            vllm.removeHandler(handler)
