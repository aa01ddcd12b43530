"""kvtier's settings: one pydantic-settings model and the loader that layers its sources.

Sources, lowest first: defaults, a YAML file named by ``KVTIER_CONFIG_FILE``, ``KVTIER_*`` environment
variables, then ``kv_connector_extra_config`` keys (same names, lower case, no prefix). Unknown keys are
errors everywhere. Every error names where the bad value came from, the value, and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import ByteSize, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvtier.storage.config import DiskConfig, RedisConfig, StorageConfig, StoreConfig, redact_url

ENV_PREFIX = "KVTIER_"
CONFIG_FILE_ENV = "KVTIER_CONFIG_FILE"
SECRET_FIELDS = frozenset({"auth_token", "redis_url"})

Source = Literal["default", "yaml", "env", "extra_config"]

SERVICE_SCHEMES = ("unix", "tcp")
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


class SettingsError(ValueError):
    """Invalid kvtier configuration; the message names the key, the value and what is allowed."""


class KVTierSettings(BaseSettings):
    """Every knob of kvtier, validated once at the edge and then passed around frozen."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, case_sensitive=False
    )

    service_url: str = Field(
        "",
        description="Service address: unix:///path or tcp://host:port; empty = embedded service.",
    )
    auth_token: str = Field(
        "", description="Shared token a TCP client must present; required for a non-loopback bind."
    )
    chunk_size: int = Field(
        256, gt=0, description="Tokens per stored chunk; a multiple of vLLM's block size."
    )
    cpu_size: ByteSize = Field(
        ByteSize(2 << 30), description="CPU tier (shared-memory arena) size, e.g. 2GiB."
    )
    disk_path: str = Field("", description="Directory of the disk tier; empty = disk tier off.")
    disk_size: ByteSize = Field(ByteSize(16 << 30), description="Disk tier capacity, e.g. 100GiB.")
    disk_fsync: bool = Field(False, description="fsync every chunk file before it is renamed in.")
    redis_url: str = Field(
        "",
        description="redis://, rediss://, unix:// or redis+cluster://host:port; empty = Redis off.",
    )
    redis_cluster: bool = Field(False, description="Treat redis_url as a Redis Cluster seed node.")
    redis_ttl: int = Field(86400, ge=0, description="Seconds a chunk lives in Redis; 0 = no expiry.")
    redis_timeout: float = Field(1.0, gt=0, description="Seconds allowed for one Redis call.")
    redis_pool_size: int = Field(8, ge=1, le=256, description="Parallel Redis connections.")
    breaker_period: float = Field(
        5.0, gt=0, description="Seconds a failing tier is skipped before it is tried again."
    )
    write_policy: Literal["through", "on_reuse"] = Field(
        "through",
        description="When chunks go to disk/Redis: 'through' on every commit, 'on_reuse' on first hit.",
    )
    write_queue_size: int = Field(
        256, ge=1, description="Chunks waiting for disk/Redis writes; beyond it writes are dropped."
    )
    save_decode: bool = Field(True, description="Also store chunks filled by generated tokens.")
    shm_dir: str = Field("/dev/shm", description="tmpfs directory that holds the arena file.")
    lease_ttl: float = Field(
        60.0, gt=0, description="Seconds a lookup keeps its chunks from eviction if never used."
    )
    lookup_budget_ms: float = Field(
        5.0, gt=0, description="Milliseconds the scheduler waits for a lookup before asking again."
    )
    fail_when_idle: bool = Field(
        False,
        description=(
            "Stop vLLM at startup with an error instead of running it without kvtier when the "
            "connector cannot serve (engine shape not served, service unreachable, KV layout refused)."
        ),
    )
    admin_port: int = Field(
        0, ge=0, le=65535, description="Port of the admin HTTP server (/health /metrics /stats)."
    )
    admin_host: str = Field("127.0.0.1", description="Address the admin HTTP server binds.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Service log level.")
    config_file: str = Field("", description="YAML file read before the environment (read-only).")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("service_url")
    @classmethod
    def _check_service_url(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in SERVICE_SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SERVICE_SCHEMES)}")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("unix:// needs a socket path, e.g. unix:///run/kvtier/kvtier.sock")
        if parts.scheme == "tcp" and (not parts.hostname or parts.port is None):
            raise ValueError("tcp:// needs host and port, e.g. tcp://127.0.0.1:7711")
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in REDIS_SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(REDIS_SCHEMES)}")
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError("unix:// needs a socket path")
        elif not parts.hostname:
            raise ValueError("needs a host, e.g. redis://127.0.0.1:6379/0")
        return value

    @field_validator("cpu_size")
    @classmethod
    def _check_cpu_size(cls, value: ByteSize) -> ByteSize:
        if value < (1 << 20):
            raise ValueError("must be at least 1MiB")
        return value

    @property
    def redis_is_cluster(self) -> bool:
        """True when the Redis tier should use the cluster client."""
        return self.redis_cluster or "+cluster" in urlsplit(self.redis_url).scheme

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_settings() merges every layer itself so it can name the source of each value.
        return (init_settings,)


FIELD_NAMES: frozenset[str] = frozenset(KVTierSettings.model_fields)


def storage_config(settings: KVTierSettings) -> StorageConfig:
    """The storage layer's frozen config from the settings (storage never reads the settings model)."""
    disk = DiskConfig(settings.disk_path, int(settings.disk_size), settings.disk_fsync)
    redis = RedisConfig(
        url=settings.redis_url,
        cluster=settings.redis_is_cluster,
        ttl=settings.redis_ttl,
        timeout=settings.redis_timeout,
        pool_size=settings.redis_pool_size,
        breaker_period=settings.breaker_period,
    )
    return StorageConfig(
        shm_dir=settings.shm_dir,
        cpu_size=int(settings.cpu_size),
        store=StoreConfig(
            lease_ttl=settings.lease_ttl,
            write_policy=settings.write_policy,
            write_queue_size=settings.write_queue_size,
        ),
        disk=disk if settings.disk_path else None,
        redis=redis if settings.redis_url else None,
    )


def display_value(name: str, value: Any) -> Any:
    """A value as it may be shown to a person: secrets masked."""
    if name == "auth_token":
        return "***" if value else ""
    if name == "redis_url":
        return redact_url(value) if isinstance(value, str) else "***"
    return int(value) if isinstance(value, ByteSize) else value


def _where(name: str, source: Source, config_file: str) -> str:
    if source == "env":
        return f"environment variable {ENV_PREFIX}{name.upper()}"
    if source == "yaml":
        return f"key '{name}' in {config_file}"
    if source == "extra_config":
        return f"kv_connector_extra_config key '{name}'"
    return f"default of '{name}'"


def _allowed(name: str) -> str:
    field = KVTierSettings.model_fields[name]
    annotation = field.annotation
    if annotation is ByteSize:
        kind = "a size in bytes, with optional unit (e.g. 512MiB, 8GiB, 500MB)"
    elif annotation is bool:
        kind = "a boolean (true/false, 1/0, yes/no)"
    elif annotation is int:
        kind = "an integer"
    elif annotation is float:
        kind = "a number"
    elif getattr(annotation, "__origin__", None) is Literal:
        kind = "one of " + ", ".join(repr(a) for a in annotation.__args__)  # type: ignore[union-attr]
    else:
        kind = "a string"
    return f"{kind}: {field.description}"


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"{CONFIG_FILE_ENV}={path}: cannot read the file ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(f"{CONFIG_FILE_ENV}={path}: not valid YAML ({exc})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{CONFIG_FILE_ENV}={path}: expected a mapping of setting names to values")
    # Accept either `cpu_size:` or the env-style `KVTIER_CPU_SIZE:` spelling; a nested `kvtier:` block too.
    if set(data) == {"kvtier"} and isinstance(data["kvtier"], dict):
        data = data["kvtier"]
    return {str(k).lower().removeprefix(ENV_PREFIX.lower()): v for k, v in data.items()}


def _layers(
    env: Mapping[str, str], extra: Mapping[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Source], str]:
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    config_file = env.get(CONFIG_FILE_ENV, "")
    unknown: list[str] = []
    if config_file:
        for key, value in _read_yaml(config_file).items():
            if key not in FIELD_NAMES:
                unknown.append(f"key '{key}' in {config_file}")
                continue
            values[key], sources[key] = value, "yaml"
    for var, value in env.items():
        if not var.upper().startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key not in FIELD_NAMES:
            unknown.append(f"environment variable {var}")
            continue
        if key == "config_file":
            continue
        values[key], sources[key] = value, "env"
    for key, value in (extra or {}).items():
        name = str(key).lower()
        if name not in FIELD_NAMES or name == "config_file":
            unknown.append(f"kv_connector_extra_config key '{key}'")
            continue
        values[name], sources[name] = value, "extra_config"
    if unknown:
        known = ", ".join(sorted(FIELD_NAMES))
        raise SettingsError(f"unknown kvtier setting(s): {'; '.join(unknown)}. Known settings: {known}")
    if config_file:
        values["config_file"], sources["config_file"] = config_file, "env"
    return values, sources, config_file


def load_settings_with_sources(
    extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> tuple[KVTierSettings, dict[str, Source]]:
    """Build the settings from every source and say where each value came from."""
    environ = os.environ if env is None else env
    values, sources, config_file = _layers(environ, extra)
    try:
        settings = KVTierSettings(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            source = sources.get(name, "default")
            raw = values.get(name, "<default>")
            shown = display_value(name, raw) if name in SECRET_FIELDS else raw
            problems.append(
                f"{_where(name, source, config_file)}={shown!r} is invalid: {err['msg']}. "
                f"Allowed: {_allowed(name) if name in FIELD_NAMES else 'a known setting'}"
            )
        raise SettingsError("; ".join(problems)) from None
    full = {name: sources.get(name, "default") for name in KVTierSettings.model_fields}
    return settings, full


def load_settings(
    extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> KVTierSettings:
    """Build the settings from defaults, YAML, environment and connector extra config."""
    return load_settings_with_sources(extra, env)[0]


def describe(settings: KVTierSettings, sources: Mapping[str, Source]) -> dict[str, dict[str, Any]]:
    """Every setting with its displayable value and source, for `kvtier config`."""
    return {
        name: {"value": display_value(name, getattr(settings, name)), "source": sources[name]}
        for name in KVTierSettings.model_fields
    }
