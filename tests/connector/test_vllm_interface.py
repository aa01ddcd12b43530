"""The connector still matches the installed vLLM's connector interface (read with inspect): every
abstract method is implemented, and every hook kvtier overrides still exists in vLLM's base classes,
of the same kind (method, class method, property) and with the same parameters. A vLLM upgrade that
renames a hook or changes its parameters fails here instead of being silently never called.

The sleep-mode hooks arrive with vLLM 0.33; on an older vLLM they are the only overrides allowed to
have no counterpart in the base class. kvtier's own public methods (``OWN_API``, for benchmarks and
tests) are no hooks: vLLM's base classes must not define them, or vLLM would call them.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import vllm
from packaging.version import Version
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvtier.connector.connector import KVTierConnector, KVTierStats

SLEEP_HOOKS = frozenset({"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"})
SLEEP_HOOKS_SINCE = Version("0.33")
OWN_API = frozenset({"snapshot", "wait_connected"})
VLLM = Version(Version(vllm.__version__).base_version)


def _overrides(cls: type) -> list[str]:
    """The hooks ``cls`` defines itself: public names and the constructor, kvtier's own API left out."""
    return sorted(n for n in vars(cls) if (not n.startswith("_") or n == "__init__") and n not in OWN_API)


def _base_attr(cls: type, name: str) -> Any:
    """The attribute as the first base class after ``cls`` defines it, or None."""
    for base in cls.__mro__[1:]:
        if name in vars(base):
            return vars(base)[name]
    return None


def _kind(attr: Any) -> str:
    return type(attr).__name__ if isinstance(attr, classmethod | staticmethod | property) else "method"


def _parameters(attr: Any) -> list[tuple[str, Any]]:
    """Names and kinds of the parameters (not their annotations or defaults)."""
    fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_kvtiers_own_api_is_no_vllm_hook() -> None:
    assert set(vars(KVTierConnector)) >= OWN_API
    assert [name for name in OWN_API if _base_attr(KVTierConnector, name) is not None] == []


def test_every_abstract_method_of_the_base_classes_is_implemented() -> None:
    assert KVConnectorBase_V1.__abstractmethods__ >= {
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
    }  # fmt: skip
    assert not inspect.isabstract(KVTierConnector) and not inspect.isabstract(KVTierStats)
    for name in KVConnectorBase_V1.__abstractmethods__:
        assert not getattr(getattr(KVTierConnector, name), "__isabstractmethod__", False), name


@pytest.mark.parametrize("cls", [KVTierConnector, KVTierStats], ids=lambda c: c.__name__)
def test_every_overridden_hook_exists_in_vllm_with_the_same_kind_and_parameters(cls: type) -> None:
    missing = []
    for name in _overrides(cls):
        ours, theirs = vars(cls)[name], _base_attr(cls, name)
        if theirs is None:
            missing.append(name)
            continue
        assert _kind(ours) == _kind(theirs), f"{name}: kvtier's is a {_kind(ours)}, vLLM's a {_kind(theirs)}"
        assert _parameters(ours) == _parameters(theirs), f"{name}: parameters differ from vLLM's"
    if cls is KVTierConnector and VLLM < SLEEP_HOOKS_SINCE:
        assert set(missing) == SLEEP_HOOKS, f"not in vLLM {VLLM}: {missing}"
    else:
        assert missing == [], f"not in vLLM {VLLM}'s base classes: {missing}"


def test_the_sleep_hooks_are_answered_and_called_as_vllm_0_33_declares_them() -> None:
    assert KVTierConnector.supports_sleep_mode() is True
    assert _parameters(vars(KVTierConnector)["unregister_kv_caches"]) == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    restore = inspect.signature(KVTierConnector.restore_kv_caches).parameters
    assert list(restore) == ["self", "kv_caches"] and restore["kv_caches"].default is None
