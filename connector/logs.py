"""kvtier's lines inside vLLM's processes: in vLLM's log, in vLLM's format, at kvtier's log_level.

The connector logs under ``vllm.kvtier``; the app modules in vLLM's processes log under ``kvtier``,
whose records ``ToVllmHandlers`` hands to vLLM's handlers.
Design: docs/internals.md#logs-in-vllms-processes-logspy
"""

from __future__ import annotations

import logging
import os
import sys

from kvtier.app.logs import LogStream
from kvtier.app.settings import KVTierSettings, log_ignored_env

VLLM_LOGGER = "vllm"
CONNECTOR_LOGGER = "vllm.kvtier"  # the connector's modules log under it
APP_LOGGER = "kvtier"  # kvtier.app's modules (client, embedded spawner, settings) log under it


class ToVllmHandlers(logging.Handler):
    """Hands a record to each handler of vLLM's logger, as if the record had been logged there."""

    def emit(self, record: logging.LogRecord) -> None:
        """Pass the record to vLLM's handlers (each applies its own level and filters)."""
        for handler in logging.getLogger(VLLM_LOGGER).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def route_to_vllm(level: str) -> None:
    """Send kvtier's lines in this process through vLLM's logging at level (idempotent)."""
    logging.getLogger(CONNECTOR_LOGGER).setLevel(level)
    app = logging.getLogger(APP_LOGGER)
    app.setLevel(level)
    if not any(isinstance(handler, ToVllmHandlers) for handler in app.handlers):
        app.addHandler(ToVllmHandlers())


def configure(settings: KVTierSettings, side: str) -> None:
    """Route kvtier's lines through vLLM's logging; the scheduler (one per engine) also says which
    KVTIER_* variables it ignored (Kubernetes service links)."""
    route_to_vllm(settings.log_level)
    if side == "scheduler":
        log_ignored_env(os.environ)


def vllm_log_stream() -> LogStream:
    """The stream vLLM's handler writes to: where the embedded service writes its lines too."""
    for handler in logging.getLogger(VLLM_LOGGER).handlers:
        stream = getattr(handler, "stream", None)
        if stream is not None and (stream is sys.stdout or stream is sys.__stdout__):
            return "stdout"
    return "stderr"
