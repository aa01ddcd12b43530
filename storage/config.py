"""The storage layer's own frozen configuration, built once at the edge from the service settings
(``kvtier.app.settings.storage_config``): nothing in ``kvtier.storage`` reads the settings model."""

from __future__ import annotations

from dataclasses import dataclass, field
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
class ObjectConfig:
    """The object tier (S3 API): bucket URL, endpoint, budget and how calls are bounded.

    Credentials and region are not here: the client reads them from the standard AWS variables and
    files (never kvtier's settings). capacity 0 leaves eviction to the bucket's lifecycle rule.
    """

    url: str  # s3://bucket/prefix
    endpoint: str = ""  # an S3-compatible endpoint; empty = AWS
    capacity: int = 100 << 30
    timeout: float = 10.0  # seconds for one call, its retries included
    refresh_period: float = 30.0  # seconds between two LISTs that refresh the index
    write_bytes: int = 256 << 20  # bytes of uploads in flight; a put beyond it is dropped
    part_size: int = 16 << 20  # blobs larger upload as multipart in parts this size (5 MiB at least)
    retries: int = 2  # retries of a failed call (5xx, SlowDown, connection), with backoff
    backoff: float = 0.1  # seconds before the first retry, doubled each time
    breaker_period: float = 5.0


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Everything ``build_store`` needs: the arena's tmpfs directory and size, and each tier's config."""

    shm_dir: str
    cpu_size: int
    store: StoreConfig = StoreConfig()
    disk: DiskConfig | None = None
    redis: RedisConfig | None = None
    object: ObjectConfig | None = None
    # Secrets that sign and verify the shared tiers' blobs (the first signs); () = unsigned. Never shown.
    tier_keys: tuple[bytes, ...] = field(default=(), repr=False)


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
