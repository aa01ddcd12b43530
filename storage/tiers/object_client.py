"""The object tier's client: obstore (Rust's object_store) over one bucket and prefix, and what its
errors mean.

Why obstore: it measured closest to the store's raw speed on the same bytes and server
(docs/performance.md, "Object storage clients"), its calls are native coroutines (signing and HTTP
run in Rust, off the GIL and off the event loop, so the tier needs no thread per call), it uploads
large blobs as multipart on its own, deletes in bulk, and retries 5xx, SlowDown and dropped
connections with exponential backoff bounded by a total timeout.

Credentials and region come from the standard AWS sources, never from kvtier's settings: the
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, web identity, container and instance credentials, which object_store reads
itself) and, where no key is set in the environment, the shared files (``AWS_SHARED_CREDENTIALS_FILE``
or ~/.aws/credentials, ``AWS_CONFIG_FILE`` or ~/.aws/config, profile ``AWS_PROFILE`` or default),
read here. Nothing here logs a credential, and ``ObjectClient`` keeps none of them in its repr.

Who owns what: the client belongs to the tier that built it; obstore's own runtime owns its
connections and threads, which end with the process.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store

from kvtier.storage.config import ObjectConfig

Buffer = bytes | bytearray | memoryview
LIST_PAGE = 1000  # keys per LIST page (the S3 maximum)
MIN_PART = 5 << 20  # S3's smallest part of a multipart upload (but the last)
_DENIED = ("403 Forbidden", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId")


class ObjectConfigError(ValueError):
    """The object tier's URL or endpoint cannot be used (names the setting)."""


@dataclass(frozen=True, slots=True)
class Listed:
    """One object a LIST returned: its path below the prefix, size and modification time."""

    path: str
    size: int
    mtime: float


def parse_url(url: str) -> tuple[str, str]:
    """Bucket and prefix (no slashes at either end) of ``s3://bucket/prefix``; ObjectConfigError else."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ObjectConfigError(f"object_url (KVTIER_OBJECT_URL) {url!r}: expected s3://bucket/prefix")
    return parts.netloc, parts.path.strip("/")


def failure_kind(exc: BaseException) -> tuple[str, bool]:
    """Stats label of a failed call and whether it says the store is down (trips the breaker)."""
    if isinstance(exc, TimeoutError):
        return "timeout", True
    text = str(exc)
    if "NoSuchBucket" in text:
        return "no_bucket", True
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        return "denied", False
    if any(
        s in text for s in ("403 Forbidden", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId")
    ):
        return "denied", False
    if "status code: 5" in text or "SlowDown" in text:
        return "server_error", True
    if "status code: 4" in text:
        return "rejected", False  # the store answered and refused this one request
    if "timed out" in text.lower():  # not "timeout": every retried call's message names retry_timeout
        return "timeout", True
    return "connection", True


def is_missing(exc: BaseException) -> bool:
    """True when a GET failed because the object is not there (a miss, not a failure)."""
    return isinstance(exc, FileNotFoundError) and "NoSuchBucket" not in str(exc)


def shared_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """Keys and region of the AWS profile in the shared files, for what the environment lacks."""
    found: dict[str, str] = {}
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = os.path.expanduser("~")
    creds = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    conf = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
    for path, section in ((conf, "default" if profile == "default" else f"profile {profile}"),
                          (creds, profile)):  # fmt: skip
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        if parser.has_section(section):
            found.update({k: v for k, v in parser.items(section) if v})
    out = {}
    if not env.get("AWS_ACCESS_KEY_ID") and found.get("aws_access_key_id"):
        out["access_key_id"] = found["aws_access_key_id"]
        out["secret_access_key"] = found.get("aws_secret_access_key", "")
        if found.get("aws_session_token"):
            out["token"] = found["aws_session_token"]
    if not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")) and found.get("region"):
        out["region"] = found["region"]
    return out


def build_store(config: ObjectConfig, env: Mapping[str, str] | None = None) -> S3Store:
    """The obstore S3Store of the config: bucket and prefix, endpoint, timeouts and retries."""
    bucket, prefix = parse_url(config.url)
    environ = os.environ if env is None else env
    settings: Any = shared_credentials(environ)  # an S3Config: obstore checks the keys
    if config.endpoint:
        scheme = urlsplit(config.endpoint).scheme
        if scheme not in ("http", "https"):
            raise ObjectConfigError(
                f"object_endpoint (KVTIER_OBJECT_ENDPOINT) {config.endpoint!r}: expected http(s)://host:port"
            )
        settings["endpoint"] = config.endpoint
        settings.setdefault("virtual_hosted_style_request", False)
    if not (environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or "region" in settings):
        settings["region"] = "us-east-1"  # S3-compatible stores accept any; AWS redirects
    timeout = timedelta(seconds=config.timeout)
    return S3Store(
        bucket,
        prefix=prefix or None,
        config=settings,
        client_options={
            "allow_http": config.endpoint.startswith("http://"),
            "timeout": timeout,
            "connect_timeout": timedelta(seconds=min(config.timeout, 2.0)),
        },
        retry_config={
            "max_retries": config.retries,
            "retry_timeout": timeout,
            "backoff": {
                "init_backoff": timedelta(seconds=config.backoff),
                "max_backoff": timedelta(seconds=max(config.backoff, 2.0)),
                "base": 2.0,
            },
        },
    )


class ObjectClient:
    """The calls the tier makes, each one request (its retries aside); errors propagate to the tier."""

    def __init__(self, config: ObjectConfig, store: S3Store | None = None) -> None:
        self.bucket, self.prefix = parse_url(config.url)
        self.part_size = max(config.part_size, MIN_PART)
        self._store = store if store is not None else build_store(config)

    def __repr__(self) -> str:
        return f"ObjectClient(s3://{self.bucket}/{self.prefix})"

    async def get_stream(self, path: str, piece: int) -> tuple[int, AsyncIterator[Buffer]]:
        """The object's size and its bytes as they arrive, in pieces of at least piece bytes (the
        last may be shorter); the GET runs until the last piece is taken or the iterator dropped."""
        result = await obstore.get_async(self._store, path)
        pieces: AsyncIterator[Buffer] = result.stream(min_chunk_size=piece)
        return int(result.meta["size"]), pieces

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        """Bytes start to end (exclusive) of the object, in one ranged GET."""
        data: Buffer = await obstore.get_range_async(self._store, path, start=start, end=end)  # type: ignore[assignment]  # a Buffer
        return data

    async def put(self, path: str, blob: Buffer) -> None:
        """Upload one blob; multipart in part_size parts when it is larger than one part."""
        multipart = memoryview(blob).nbytes > self.part_size
        await obstore.put_async(
            self._store, path, blob, use_multipart=multipart, chunk_size=self.part_size, max_concurrency=4
        )

    async def delete(self, paths: list[str]) -> None:
        """Delete these objects (one bulk request per 1000; a missing one is no error)."""
        for at in range(0, len(paths), LIST_PAGE):
            await obstore.delete_async(self._store, paths[at : at + LIST_PAGE])

    async def probe(self) -> None:
        """One LIST of the prefix's top level: raises when the bucket, credentials or endpoint fail."""
        await obstore.list_with_delimiter_async(self._store, None)

    async def pages(self, namespace: str | None = None) -> AsyncIterator[list[Listed]]:
        """Every object under the prefix (or one namespace of it), a LIST page at a time."""
        stream = obstore.list(self._store, namespace, chunk_size=LIST_PAGE)
        async for page in stream:
            yield [Listed(m["path"], int(m["size"]), _stamp(m["last_modified"])) for m in page]


def _stamp(when: datetime | None) -> float:
    return when.timestamp() if when is not None else 0.0
