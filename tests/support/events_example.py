"""The documented KV-events subscriber (docs/examples/kv_events_subscriber.py), loaded as the tests use it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "kv_events_subscriber.py"


def load_subscriber_example() -> ModuleType:
    """The example subscriber as a module (its structs decode kvtier's and vLLM's batches)."""
    spec = importlib.util.spec_from_file_location("kv_events_subscriber", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its structs' annotations are resolved in its namespace
    spec.loader.exec_module(module)
    return module
