"""The service's logs: JSON lines for `kvtier serve`, vLLM-like text lines in vLLM's log for the
embedded service; secrets scrubbed in both.

A log collector reading a standalone service wants one JSON object per line with an ISO-8601 time; an
operator reading vLLM's log wants the embedded service's lines to look like the lines around them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal, TextIO
from urllib.parse import urlsplit

LogFormat = Literal["json", "text"]
LogStream = Literal["stdout", "stderr"]  # where a service writes its lines

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field. vLLM's
# record factory adds vllm_process_name to every record of a process that imported vLLM.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "vllm_process_name",
    "fileinfo",
}
TEXT_NAME = "kvtier-service"  # the process name text lines show, where vLLM shows EngineCore etc.
TEXT_DATE_FORMAT = "%m-%d %H:%M:%S"  # vLLM's


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record got through `extra=`."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


def iso_time(created: float) -> str:
    """A record's time as ISO-8601 in UTC with milliseconds, e.g. 2025-05-06T12:34:56.789Z."""
    return datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class JsonFormatter(logging.Formatter):
    """Formats a record as a JSON line: time, level, logger, msg, then the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        """One JSON object, without newlines."""
        out: dict[str, Any] = {
            "time": iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """ISO-8601 UTC time (for handlers that ask)."""
        return iso_time(record.created)


class TextFormatter(logging.Formatter):
    """Formats a record as vLLM formats its own lines, then its extra fields as key=value:

    ``(kvtier-service pid=123) INFO 05-06 12:34:56 [server.py:201] serving url=unix:///... pid=123``
    """

    def __init__(self) -> None:
        super().__init__(datefmt=TEXT_DATE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        """One line; a traceback follows on the lines after it."""
        fields = " ".join(f"{k}={_text_value(v)}" for k, v in _fields(record).items())
        message = record.getMessage() + (f" {fields}" if fields else "")
        line = (
            f"({TEXT_NAME} pid={record.process}) {record.levelname} {self.formatTime(record, self.datefmt)} "
            f"[{record.filename}:{record.lineno}] {message}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """Local time, as vLLM's lines have it."""
        return time.strftime(datefmt or TEXT_DATE_FORMAT, time.localtime(record.created))


def _text_value(value: Any) -> str:
    """A field's value on a text line: quoted only when it has spaces or is empty."""
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() for c in text) else text


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


def resolve_format(setting: str, embedded: bool) -> LogFormat:
    """The log format of a service: the log_format setting, where 'auto' means text for the
    embedded service (its lines land in vLLM's log) and json for `kvtier serve`."""
    if setting == "json":
        return "json"
    if setting == "text":
        return "text"
    return "text" if embedded else "json"


def setup_logging(
    level: str, secrets: Iterable[str] = (), stream: TextIO | None = None, fmt: LogFormat = "json"
) -> None:
    """Route every logger of this process to lines of fmt on stream (stderr) at level (idempotent).

    Only the service process calls this: it owns its root logger, so storage's loggers follow too.
    """
    logger = logging.getLogger()
    for handler in list(logger.handlers):
        if getattr(handler, "_kvtier", False):
            logger.removeHandler(handler)
            handler.close()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._kvtier = True  # type: ignore[attr-defined]
    handler.setFormatter(TextFormatter() if fmt == "text" else JsonFormatter())
    handler.addFilter(SecretFilter(secrets))
    logger.addHandler(handler)
    logger.setLevel(level)
