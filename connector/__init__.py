"""The vLLM KV connector of kvtier: ``{"kv_connector": "KVTierConnector", "kv_connector_module_path":
"kvtier.connector"}``. Only this package imports vLLM and torch; they load when the connector class is first
used, so the pure planning modules import without them."""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.connector.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(name)
