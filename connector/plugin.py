"""vLLM plugin entry point: registers KVTierConnector by name so the module path may be left out."""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.kvtier.plugin")  # under vLLM's logger: its handler and level

CONNECTOR_NAME = "KVTierConnector"


def register() -> None:
    """Register the connector with vLLM's connector factory (idempotent, never raises)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as exc:  # vLLM absent or incompatible: kvtier stays usable without the plugin
        log.debug("kvtier plugin not registered: %s", exc)
        return
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvtier.connector", CONNECTOR_NAME)
