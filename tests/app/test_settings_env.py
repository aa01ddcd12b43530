"""Settings from the environment: Kubernetes service links are ignored, typos are still errors with a
likely spelling, and log_format is validated."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.app.settings import (
    FIELD_NAMES,
    SettingsError,
    ignored_env,
    load_settings,
    load_settings_with_sources,
    log_ignored_env,
)
from tests.app import ROOT, kvtier_cmd, python_env

# What Kubernetes injects into every pod of the namespace for `kind: Service, name: kvtier` with a
# port 7711 named "grpc" and a port 8080 named "admin-http".
SERVICE_LINKS = {
    "KVTIER_SERVICE_HOST": "10.0.0.1",
    "KVTIER_SERVICE_PORT": "7711",
    "KVTIER_SERVICE_PORT_GRPC": "7711",
    "KVTIER_SERVICE_PORT_ADMIN_HTTP": "8080",
    "KVTIER_PORT": "tcp://10.0.0.1:7711",
    "KVTIER_PORT_7711_TCP": "tcp://10.0.0.1:7711",
    "KVTIER_PORT_7711_TCP_PROTO": "tcp",
    "KVTIER_PORT_7711_TCP_PORT": "7711",
    "KVTIER_PORT_7711_TCP_ADDR": "10.0.0.1",
    "KVTIER_PORT_8080_UDP": "udp://10.0.0.1:8080",
    "KVTIER_PORT_8080_SCTP_ADDR": "10.0.0.1",
}


def test_kubernetes_service_links_are_ignored_and_named() -> None:
    env = {**SERVICE_LINKS, "KVTIER_CPU_SIZE": "8MiB", "PATH": "/bin"}
    settings, sources = load_settings_with_sources(env=env)
    assert int(settings.cpu_size) == 8 << 20 and sources["cpu_size"] == "env"
    assert settings.service_url == "" and settings.admin_port == 0  # nothing taken from the links
    assert ignored_env(env) == sorted(SERVICE_LINKS)


def test_the_brief_example_loads() -> None:
    env = {
        "KVTIER_SERVICE_HOST": "10.0.0.1",
        "KVTIER_SERVICE_PORT": "8080",
        "KVTIER_PORT": "tcp://10.0.0.1:8080",
        "KVTIER_PORT_8080_TCP": "tcp://10.0.0.1:8080",
    }
    assert load_settings(env=env).chunk_size == 256
    assert ignored_env(env) == [
        "KVTIER_PORT",
        "KVTIER_PORT_8080_TCP",
        "KVTIER_SERVICE_HOST",
        "KVTIER_SERVICE_PORT",
    ]


def test_a_real_setting_is_never_ignored() -> None:
    env = {f"KVTIER_{name.upper()}": "x" for name in FIELD_NAMES}
    assert ignored_env(env) == []
    # KVTIER_ADMIN_PORT has the shape of a link of a Service named kvtier-admin: it stays a setting.
    with pytest.raises(SettingsError, match=r"KVTIER_ADMIN_PORT='tcp://10.0.0.1:80' is invalid"):
        load_settings(env={"KVTIER_ADMIN_PORT": "tcp://10.0.0.1:80"})


@pytest.mark.parametrize(
    ("var", "suggestion"),
    [
        ("KVTIER_CPU_BYTE", "did you mean KVTIER_CPU_SIZE?"),
        ("KVTIER_SERVICE_URI", "did you mean KVTIER_SERVICE_URL?"),
        ("KVTIER_LOG_FORMT", "did you mean KVTIER_LOG_FORMAT?"),
    ],
)
def test_a_misspelt_setting_is_an_error_with_the_likely_name(var: str, suggestion: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={**SERVICE_LINKS, var: "1"})
    message = str(info.value)
    assert message.startswith(f"unknown kvtier setting(s): environment variable {var} ({suggestion})")
    assert not any(link in message.split("Known settings")[0] for link in SERVICE_LINKS)


@pytest.mark.parametrize(
    "var",
    [
        "KVTIER_SERVICE_HOSTS",  # not exactly a link's name
        "KVTIER_PORT_7711",  # a port number without its protocol
        "KVTIER_PORT_7711_HTTP",  # not a protocol Kubernetes has
        "KVTIER_PORT_7711_TCP_HOST",  # not one of PROTO, PORT, ADDR
        "KVTIER_PORT_GRPC_TCP",  # a port name where its number goes
    ],
)
def test_names_near_a_service_link_are_still_errors(var: str) -> None:
    assert ignored_env({var: "1"}) == []
    with pytest.raises(SettingsError, match=f"environment variable {var}"):
        load_settings(env={var: "1"})


def test_links_of_a_service_of_another_name_are_errors_that_say_what_to_do() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={"KVTIER_NODE_SERVICE_HOST": "10.0.0.2"})
    assert "environment variable KVTIER_NODE_SERVICE_HOST (If it is a Kubernetes service link" in str(
        info.value
    )
    assert "enableServiceLinks: false" in str(info.value)


def test_misspelt_keys_of_the_file_and_extra_config_get_the_likely_name() -> None:
    with pytest.raises(
        SettingsError, match=r"kv_connector_extra_config key 'chunk_sise' \(did you mean 'chunk_size'\?\)"
    ):
        load_settings(extra={"chunk_sise": 64}, env={})
    with pytest.raises(
        SettingsError, match=r"key 'config_file' \(config_file can only be given as KVTIER_CONFIG_FILE\)"
    ):
        load_settings(extra={"config_file": "a.yaml"}, env={})


@pytest.fixture
def kvtier_logging_as_at_start() -> Iterator[None]:
    """kvtier's and vLLM's loggers without the handlers earlier tests in this process added (routing
    kvtier's lines to vLLM's handlers, which would hand each record on a second time); restored after."""
    loggers = [logging.getLogger(name) for name in ("kvtier", "kvtier.settings", "vllm")]
    saved = [(lg, list(lg.handlers), lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers.clear()
        lg.propagate = True
    try:
        yield
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers[:] = handlers
            lg.propagate = propagate


@pytest.mark.usefixtures("kvtier_logging_as_at_start")
def test_ignored_variables_are_logged_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.settings"):
        assert log_ignored_env({"KVTIER_PORT": "tcp://10.0.0.1:7711", "KVTIER_SERVICE_HOST": "10.0.0.1"})
        assert log_ignored_env({"KVTIER_CPU_SIZE": "8MiB"}) == []
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvtier.settings"]
    assert lines == [
        (
            logging.INFO,
            "kvtier ignores 2 Kubernetes service-link variable(s), which are not settings: "
            "KVTIER_PORT, KVTIER_SERVICE_HOST",
        )
    ]


def test_kvtier_config_runs_in_a_pod_with_service_links() -> None:
    """The reproduction from the issue: `KVTIER_SERVICE_HOST=10.0.0.1 kvtier config` used to fail."""
    proc = subprocess.run(
        kvtier_cmd("config", "--json"),
        env=python_env(**SERVICE_LINKS),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cpu_size"]["source"] == "default"  # one object on stdout
    names = ", ".join(sorted(SERVICE_LINKS))
    assert f"ignored Kubernetes service-link variables (not settings): {names}" in proc.stderr


@pytest.mark.parametrize(("given", "expected"), [("json", "json"), ("TEXT", "text"), ("auto", "auto")])
def test_log_format_accepts_its_values(given: str, expected: str) -> None:
    assert load_settings(env={"KVTIER_LOG_FORMAT": given}).log_format == expected


def test_log_format_defaults_to_auto() -> None:
    assert load_settings(env={}).log_format == "auto"


@pytest.mark.parametrize("bad", ["xml", "", "jsonl"])
def test_a_bad_log_format_names_the_variable_and_the_allowed_values(bad: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={"KVTIER_LOG_FORMAT": bad})
    message = str(info.value)
    assert message.startswith(f"environment variable KVTIER_LOG_FORMAT={bad!r} is invalid")
    assert "Allowed: one of 'auto', 'json', 'text'" in message


# ---------------------------------------------------------------------------------------------- tier keys
TIER_HEX = "ab" * 32


def test_tier_keys_from_env_or_file_reach_the_storage_config_and_stay_hidden(tmp_path: Path) -> None:
    from kvtier.app.settings import describe, storage_config

    env = {"KVTIER_TIER_KEY": f"{'cd' * 32}, {TIER_HEX}", "KVTIER_REDIS_URL": "redis://127.0.0.1:6379"}
    settings, sources = load_settings_with_sources(env=env)
    config = storage_config(settings)
    assert config.tier_keys == (bytes.fromhex("cd" * 32), bytes.fromhex(TIER_HEX))
    assert TIER_HEX not in repr(config) and "cdcd" not in repr(config)
    shown = describe(settings, sources)["tier_key"]
    assert shown == {"value": "*** (Redis and object tiers signed; 2 keys)", "source": "env"}
    secret = tmp_path / "tier.key"
    secret.write_text(TIER_HEX + "\n")
    from_file = load_settings(env={"KVTIER_TIER_KEY_FILE": str(secret)})
    assert storage_config(from_file).tier_keys == (bytes.fromhex(TIER_HEX),)


def test_without_a_tier_key_the_config_says_the_shared_tiers_are_unsigned() -> None:
    from kvtier.app.settings import describe, storage_config

    settings, sources = load_settings_with_sources(env={})
    assert storage_config(settings).tier_keys == ()
    assert describe(settings, sources)["tier_key"]["value"] == "unset: Redis and object tiers unsigned"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"KVTIER_TIER_KEY": "cd" * 16},
            "KVTIER_TIER_KEY='***' is invalid: Value error, key 1 of 1 is too short",
        ),
        (
            {"KVTIER_TIER_KEY": f"{TIER_HEX},,"},
            "KVTIER_TIER_KEY='***' is invalid: Value error, key 2 of 3 is empty",
        ),
        (
            {"KVTIER_TIER_KEY_FILE": "/nonexistent/tier.key"},
            "KVTIER_TIER_KEY_FILE='/nonexistent/tier.key' is",
        ),
        (
            {"KVTIER_TIER_KEY": TIER_HEX, "KVTIER_TIER_KEY_FILE": "/x"},
            "give the keys once: tier_key (KVTIER_TIER_KEY) is set too",
        ),
    ],
)
def test_a_bad_tier_key_names_the_variable_and_never_shows_the_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(env=env)
    assert message in str(caught.value)
    assert "cd" * 16 not in str(caught.value) and TIER_HEX not in str(caught.value)
