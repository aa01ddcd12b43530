"""Structured logging for the service: one JSON object per line on stderr, secrets scrubbed."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO
from urllib.parse import urlsplit

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as a JSON line: ts, level, logger, msg, then the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        """One JSON object, without newlines."""
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """ISO-like UTC time (unused by format, kept for handlers that ask)."""
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))


class SecretFilter(logging.Filter):
    """Replaces known secret strings with '***' in every record's message and fields.

    A second line of defence: the code never logs secrets on purpose.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        """Scrub and keep the record."""
        if not self._secrets:
            return True
        record.msg = self._scrub(record.getMessage())
        record.args = None
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD and isinstance(value, str):
                setattr(record, key, self._scrub(value))
        return True


def secrets_of(auth_token: str, redis_url: str) -> list[str]:
    """The strings that must never reach a log: the token and any Redis password."""
    out = [auth_token]
    if redis_url:
        try:
            out.append(urlsplit(redis_url).password or "")
        except ValueError:
            pass
    return [s for s in out if s]


def setup_logging(level: str, secrets: Iterable[str] = (), stream: TextIO | None = None) -> None:
    """Route every logger of this process to JSON lines on stderr at level (idempotent).

    Only the service process calls this: it owns its root logger, so storage's loggers follow too.
    """
    logger = logging.getLogger()
    for handler in list(logger.handlers):
        if getattr(handler, "_kvtier", False):
            logger.removeHandler(handler)
            handler.close()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._kvtier = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter())
    handler.addFilter(SecretFilter(secrets))
    logger.addHandler(handler)
    logger.setLevel(level)
