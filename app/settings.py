"""kvtier's settings: one pydantic-settings model and the loader that layers its sources.

Sources, lowest first: defaults, a YAML file named by ``KVTIER_CONFIG_FILE``, ``KVTIER_*`` environment
variables, then ``kv_connector_extra_config`` keys (same names, lower case, no prefix). Unknown keys are
errors everywhere, with one exception: the variables Kubernetes injects for a Service named ``kvtier``
(``KVTIER_SERVICE_HOST``, ``KVTIER_PORT_7711_TCP``, ...; see ``ignored_env``) are not settings and are
ignored. Every error names where the bad value came from, the value, and what is allowed.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import ByteSize, Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvtier.storage.config import (
    DiskConfig,
    ObjectConfig,
    RedisConfig,
    StorageConfig,
    StoreConfig,
    redact_url,
)
from kvtier.storage.signing import parse_secrets, read_secret_file

ENV_PREFIX = "KVTIER_"
CONFIG_FILE_ENV = "KVTIER_CONFIG_FILE"
SECRET_FIELDS = frozenset({"auth_token", "redis_url", "object_endpoint", "tier_key"})

Source = Literal["default", "yaml", "env", "extra_config"]

# The service-link variables Kubernetes puts into every pod for a Service named "kvtier" (names upper
# case, a port's name with '-' as '_'), unless the pod sets enableServiceLinks: false.
_LINK_SUFFIX = (
    r"(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    r"|PORT(?:_[0-9]+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)"
)
SERVICE_LINK = re.compile(ENV_PREFIX + _LINK_SUFFIX)
# The same variables of a Service named "kvtier-<something>": not ignored, but the error says why.
_OTHER_SERVICE_LINK = re.compile(ENV_PREFIX + r"[A-Z0-9_]+_" + _LINK_SUFFIX)

log = logging.getLogger("kvtier.settings")

SERVICE_SCHEMES = ("unix", "tcp")
EVENTS_SCHEMES = ("tcp", "ipc")
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
# S3's bucket naming rules (3-63 characters: lower-case letters, digits, dots and hyphens).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


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
    disk_direct_reads: bool = Field(
        True,
        description="Engines on the service's host read disk hits from the chunk files themselves, "
        "opened by the service and passed over its unix socket (CPU KV caches; off = the service reads).",
    )
    redis_url: str = Field(
        "",
        description="redis://, rediss://, unix:// or redis+cluster://host:port; empty = Redis off.",
    )
    redis_cluster: bool = Field(False, description="Treat redis_url as a Redis Cluster seed node.")
    redis_ttl: int = Field(86400, ge=0, description="Seconds a chunk lives in Redis; 0 = no expiry.")
    redis_timeout: float = Field(1.0, gt=0, description="Seconds allowed for one Redis call.")
    redis_pool_size: int = Field(8, ge=1, le=256, description="Parallel Redis connections.")
    object_url: str = Field(
        "",
        description=(
            "Object storage tier (S3 API) as s3://bucket/prefix, below Redis; empty = off. Credentials "
            "and region come from the standard AWS variables and files, never from kvtier's settings."
        ),
    )
    object_endpoint: str = Field(
        "",
        description="S3-compatible endpoint, http(s)://host:port (SeaweedFS, MinIO, Ceph RGW); empty = AWS.",
    )
    object_size: ByteSize = Field(
        ByteSize(100 << 30),
        description=(
            "Bytes kvtier keeps in the object tier (objects unused the longest deleted beyond it); "
            "0 = no eviction by kvtier (a bucket lifecycle rule expires objects instead)."
        ),
    )
    object_timeout: float = Field(
        10.0, gt=0, description="Seconds allowed for one object-store call, its retries included."
    )
    object_refresh: float = Field(
        30.0,
        gt=0,
        description="Seconds between two LISTs of the object tier's prefix (other nodes' chunks are "
        "found within about this long).",
    )
    object_write_bytes: ByteSize = Field(
        ByteSize(256 << 20),
        description="Bytes of uploads to the object tier in flight; beyond it writes are dropped, counted.",
    )
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
    prestage_bytes: ByteSize = Field(
        ByteSize(256 << 20),
        description=(
            "Bytes of disk, Redis and object-storage hits the service reads into the CPU tier ahead, "
            "while their requests wait in vLLM's queue (reads in flight at once; at most half of cpu_size); "
            "0 = off: lower-tier hits are read when vLLM schedules their requests."
        ),
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
    events_url: str = Field(
        "", description="ZMQ PUB endpoint of KV events in vLLM's format (tcp://, ipc://); empty = none."
    )
    events_replay_url: str = Field(
        "", description="ZMQ ROUTER endpoint for replays of missed event batches; needs events_url."
    )
    events_connect: bool = Field(
        False, description="Connect the PUB socket to events_url instead of binding it (llm-d binds)."
    )
    events_topic: str = Field(
        "", description="Topic frame of every event message (llm-d: kv@<pod>@<model>); empty = none."
    )
    events_hash_format: Literal["int", "bytes"] = Field(
        "int", description="Block hashes in events: 'int' (low 64 bits, vLLM's default) or 'bytes' (whole)."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level of the service, and of kvtier's lines in vLLM's log."
    )
    log_format: Literal["auto", "json", "text"] = Field(
        "auto",
        description=(
            "Service log lines: 'json' (one object per line, ISO-8601 times) or 'text' (lines like "
            "vLLM's); 'auto' = text for the embedded service (in vLLM's log), json for kvtier serve."
        ),
    )
    tier_key: str = Field(
        "",
        description=(
            "Secret(s) that sign and verify every chunk in Redis and the object tier, each at least "
            "256 bits as hex or base64 (e.g. `openssl rand -hex 32`); a comma-separated list rotates "
            "(the first signs, any verifies); empty = shared tiers unsigned. Never shown."
        ),
    )
    tier_key_file: str = Field(
        "",
        description="A file holding tier_key's value (a mounted secret); not with tier_key.",
    )
    config_file: str = Field("", description="YAML file read before the environment (read-only).")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("log_format", mode="before")
    @classmethod
    def _lower_format(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

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

    @field_validator("events_url", "events_replay_url")
    @classmethod
    def _check_events_url(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in EVENTS_SCHEMES:
            raise ValueError(
                f"a ZMQ endpoint must start with one of {', '.join(s + '://' for s in EVENTS_SCHEMES)}"
            )
        if parts.scheme == "ipc" and not (parts.netloc + parts.path):
            raise ValueError("ipc:// needs a path, e.g. ipc:///run/kvtier/events")
        if parts.scheme == "tcp":
            try:
                port = parts.port
            except ValueError:
                port = None
            if not parts.hostname or port is None:
                raise ValueError("tcp:// needs host and port, e.g. tcp://127.0.0.1:5557 or tcp://*:5557")
        if info.field_name == "events_replay_url":
            events_url = info.data.get("events_url")
            if not events_url:
                raise ValueError("a replay endpoint needs events_url (KVTIER_EVENTS_URL) as well")
            if events_url == value:
                raise ValueError("must differ from events_url: the two sockets cannot share an endpoint")
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

    @field_validator("object_url")
    @classmethod
    def _check_object_url(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme != "s3":
            raise ValueError("expected s3://bucket/prefix")
        if not _BUCKET.fullmatch(parts.netloc or "") or ".." in parts.netloc:
            raise ValueError(
                f"bucket {parts.netloc!r} is not a valid bucket name (3-63 lower-case letters, digits, "
                "dots and hyphens)"
            )
        return value

    @field_validator("object_endpoint")
    @classmethod
    def _check_object_endpoint(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected http(s)://host[:port]")
        return value

    @field_validator("tier_key")
    @classmethod
    def _check_tier_key(cls, value: str) -> str:
        if value.strip():
            parse_secrets(value)
        return value

    @field_validator("tier_key_file")
    @classmethod
    def _check_tier_key_file(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            return value
        if info.data.get("tier_key"):
            raise ValueError("give the keys once: tier_key (KVTIER_TIER_KEY) is set too")
        parse_secrets(read_secret_file(value))
        return value

    @field_validator("cpu_size")
    @classmethod
    def _check_cpu_size(cls, value: ByteSize) -> ByteSize:
        if value < (1 << 20):
            raise ValueError("must be at least 1MiB")
        return value

    @property
    def prestage_limit(self) -> int:
        """The service's read-ahead budget in bytes: prestage_bytes, at most half of cpu_size, so
        that reads ahead for queued requests never take the arena from saves and cached chunks."""
        return min(int(self.prestage_bytes), int(self.cpu_size) // 2)

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


def _env_key(var: str) -> str | None:
    """The setting name a KVTIER_* variable would set; None for a variable without the prefix."""
    if not var.upper().startswith(ENV_PREFIX):
        return None
    return var[len(ENV_PREFIX) :].lower()


def ignored_env(environ: Mapping[str, str]) -> list[str]:
    """The KVTIER_* variables that are Kubernetes service links of a Service named kvtier, sorted.

    Exactly the names Kubernetes injects (KVTIER_SERVICE_HOST, KVTIER_SERVICE_PORT[_<NAME>],
    KVTIER_PORT, KVTIER_PORT_<N>_<PROTO>[_PROTO|_PORT|_ADDR]); a name that is also a setting is
    never ignored.
    """
    return sorted(
        var
        for var in environ
        if (key := _env_key(var)) is not None
        and key not in FIELD_NAMES
        and SERVICE_LINK.fullmatch(var.upper())
    )


def log_ignored_env(environ: Mapping[str, str]) -> list[str]:
    """Log one INFO line naming the ignored variables (if any) and return them."""
    names = ignored_env(environ)
    if names:
        log.info(
            "kvtier ignores %d Kubernetes service-link variable(s), which are not settings: %s",
            len(names),
            ", ".join(names),
        )
    return names


def _unknown_env(var: str, key: str) -> str:
    """How an unknown KVTIER_* variable is named in the error, with the likely fixes."""
    hints = [
        f"did you mean {ENV_PREFIX}{c.upper()}?"
        for c in difflib.get_close_matches(key, sorted(FIELD_NAMES), n=1)
    ]
    if _OTHER_SERVICE_LINK.fullmatch(var.upper()):
        hints.append(
            "If it is a Kubernetes service link of a Service named 'kvtier-...', set "
            "enableServiceLinks: false in the pod spec or rename the Service: only the links of a "
            "Service named 'kvtier' are ignored"
        )
    return f"environment variable {var}" + (f" ({' '.join(hints)})" if hints else "")


def _unknown_key(name: str, where: str) -> str:
    """How an unknown YAML or extra-config key is named in the error, with a likely spelling."""
    if name == "config_file":
        return f"{where} (config_file can only be given as {CONFIG_FILE_ENV})"
    close = difflib.get_close_matches(name.lower(), sorted(FIELD_NAMES), n=1)
    return f"{where} (did you mean '{close[0]}'?)" if close else where


def tier_keys(settings: KVTierSettings) -> tuple[bytes, ...]:
    """The shared tiers' secrets (first signs), from tier_key or tier_key_file; () when unsigned."""
    if settings.tier_key.strip():
        return parse_secrets(settings.tier_key)
    if settings.tier_key_file:
        try:
            return parse_secrets(read_secret_file(settings.tier_key_file))
        except ValueError as exc:  # the file changed since the settings were loaded
            raise SettingsError(f"{ENV_PREFIX}TIER_KEY_FILE={settings.tier_key_file}: {exc}") from None
    return ()


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
    objects = ObjectConfig(
        url=settings.object_url,
        endpoint=settings.object_endpoint,
        capacity=int(settings.object_size),
        timeout=settings.object_timeout,
        refresh_period=settings.object_refresh,
        write_bytes=int(settings.object_write_bytes),
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
        object=objects if settings.object_url else None,
        tier_keys=tier_keys(settings),
    )


def display_value(name: str, value: Any) -> Any:
    """A value as it may be shown to a person: secrets masked."""
    if name in ("auth_token", "tier_key"):
        return "***" if value else ""
    if name in ("redis_url", "object_endpoint"):
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
                unknown.append(_unknown_key(key, f"key '{key}' in {config_file}"))
                continue
            values[key], sources[key] = value, "yaml"
    ignored = set(ignored_env(env))
    for var, value in env.items():
        name = _env_key(var)
        if name is None or var in ignored:
            continue
        if name not in FIELD_NAMES:
            unknown.append(_unknown_env(var, name))
            continue
        if name == "config_file":
            continue
        values[name], sources[name] = value, "env"
    for key, value in (extra or {}).items():
        name = str(key).lower()
        if name not in FIELD_NAMES or name == "config_file":
            unknown.append(_unknown_key(name, f"kv_connector_extra_config key '{key}'"))
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
    table = {
        name: {"value": display_value(name, getattr(settings, name)), "source": sources[name]}
        for name in KVTierSettings.model_fields
    }
    table["tier_key"]["value"] = _signing_state(settings)
    return table


def _signing_state(settings: KVTierSettings) -> str:
    """tier_key as `kvtier config` shows it: masked, and whether the shared tiers are signed."""
    if not settings.tier_key.strip() and not settings.tier_key_file:
        return "unset: Redis and object tiers unsigned"
    count = len(tier_keys(settings))
    shown = "***" if settings.tier_key.strip() else "from tier_key_file"
    return f"{shown} (Redis and object tiers signed; {count} key{'s' if count > 1 else ''})"
