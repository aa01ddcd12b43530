"""The storage layer's own frozen configuration, built once at the edge from the service settings
(``kvtier.app.settings.storage_config``): nothing in ``kvtier.storage`` reads the settings model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The tiered store's knobs."""

    lease_ttl: float = 60.0
    write_policy: Literal["through", "on_reuse"] = "through"
    write_queue_size: int = 256
    write_workers: int = 2


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """The disk tier: its directory, capacity in bytes, and whether each file is fsynced."""

    path: str
    capacity: int = 16 << 30
    fsync: bool = False


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """The Redis tier: server URL, cluster client or not, TTL and timeout in seconds, connections."""

    url: str
    cluster: bool = False
    ttl: int = 86400
    timeout: float = 1.0
    pool_size: int = 8
    breaker_period: float = 5.0


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Everything ``build_store`` needs: the arena's tmpfs directory and size, and each tier's config."""

    shm_dir: str
    cpu_size: int
    store: StoreConfig = StoreConfig()
    disk: DiskConfig | None = None
    redis: RedisConfig | None = None


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***'."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
