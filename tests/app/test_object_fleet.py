"""A fleet of two services that share only an object store bucket: one stores a chunk, the other
finds it through its object index and stages it, bytes identical; and the settings of the tier."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvtier.app import protocol as p
from kvtier.app.settings import SettingsError, describe, load_settings_with_sources, storage_config
from kvtier.storage.base import Tier
from kvtier.storage.tiers.object import ObjectTier
from tests.app import SPEC, RawConn, hashes, thread_service
from tests.support.leak_check import kvtier_leak_session, leak_check, no_kvtier_leaks  # noqa: F401
from tests.support.object_store import SeaweedServer


def object_tier(svc: Any) -> ObjectTier:
    """The object tier of a running ThreadService's store."""
    tiers = [t for t in svc.service.store.lower if isinstance(t, ObjectTier)]
    assert len(tiers) == 1
    return tiers[0]


def store_chunks(svc: Any, keys: list[bytes], fill: list[bytes]) -> str:
    """Reserve, fill (through the arena file, as a worker's mapping would) and commit chunks; then
    wait until the object tier has uploaded them. Returns the namespace."""
    arena = svc.call(lambda: svc.service.store.arena_info()).path
    with RawConn(svc.url) as conn:
        ns = conn.hello(spec=SPEC).namespace
        got = conn.call(p.Reserve(id=2, namespace=ns, hashes=keys))
        fd = os.open(arena, os.O_RDWR)
        try:
            for slot, data in zip(got.slots, fill, strict=True):
                assert os.pwrite(fd, data, slot.offset) == len(data)
        finally:
            os.close(fd)
        assert conn.call(p.Commit(id=3, namespace=ns, hashes=keys, slots=got.slots)) == p.OkReply(id=3)
    assert svc.call(lambda: svc.service.store.flush(10.0))
    svc.call(lambda: object_tier(svc).settle(), timeout=30.0)
    return str(ns)


def staged_bytes(svc: Any, ns: str, keys: list[bytes]) -> list[bytes]:
    """Look keys up and stage them on svc; the bytes of each staged slot, read from its arena."""
    arena = svc.call(lambda: svc.service.store.arena_info()).path
    with RawConn(svc.url) as conn:
        conn.hello(spec=SPEC)
        found = conn.call(p.Lookup(id=2, namespace=ns, hashes=keys, lease_id="fleet"))
        assert found.num_hit == len(keys)
        tiers = found.tiers if isinstance(found.tiers, list) else [found.tiers] * found.num_hit
        assert [Tier(t) for t in tiers] == [Tier.OBJECT] * len(keys)
        staged = conn.call(p.Stage(id=3, lease_id="fleet"))
        assert staged.failed == []
        with open(arena, "rb") as f:
            out = []
            for slot in staged.slots:
                f.seek(slot.offset)
                out.append(f.read(slot.length))
        conn.call(p.Release(id=4, lease_id="fleet"))
    return out


def test_two_services_share_chunks_through_the_bucket_alone(
    tmp_path: Path, s3_server: SeaweedServer, aws_env: dict[str, str]
) -> None:
    env = {
        "object_url": f"s3://kvtier-test/fleet-{uuid.uuid4().hex[:8]}",
        "object_endpoint": s3_server.endpoint,
        "object_refresh": "3600",
        "object_timeout": "30",
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    keys = hashes(2, salt="fleet")
    fill = [os.urandom(SPEC.chunk_bytes) for _ in keys]
    with thread_service(tmp_path / "a", **env) as a:
        ns = store_chunks(a, keys[:1], fill[:1])
        with thread_service(tmp_path / "b", **env) as b:
            b.call(lambda: object_tier(b).wait_listed(), timeout=30.0)
            assert staged_bytes(b, ns, keys[:1]) == fill[:1]  # found by the LIST at start
            store_chunks(a, keys[1:], fill[1:])
            assert b.call(lambda: object_tier(b).refresh(), timeout=30.0)  # one refresh period on
            assert staged_bytes(b, ns, keys[1:]) == fill[1:]
            stats = b.call(lambda: svc_stats(b))
            assert stats["tiers"]["object"]["hits"] == 2 and stats["tiers"]["object"]["stores"] == 0


def svc_stats(svc: Any) -> dict[str, Any]:
    """The service's `kvtier stats --json` object."""
    return dict(svc.service.stats())


def test_object_settings_build_the_tier_config_and_redact_the_endpoint() -> None:
    env = {
        "KVTIER_OBJECT_URL": "s3://kvtier-test/a/b",
        "KVTIER_OBJECT_ENDPOINT": "http://user:secret@127.0.0.1:8333",
        "KVTIER_OBJECT_SIZE": "2GiB",
    }
    settings, sources = load_settings_with_sources(env=env)
    cfg = storage_config(settings).object
    assert cfg is not None
    assert (cfg.url, cfg.capacity) == ("s3://kvtier-test/a/b", 2 << 30)
    shown = describe(settings, sources)
    assert shown["object_endpoint"]["value"] == "http://user:***@127.0.0.1:8333"
    assert storage_config(load_settings_with_sources(env={})[0]).object is None


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("KVTIER_OBJECT_URL", "http://bucket/x", "s3://bucket/prefix"),
        ("KVTIER_OBJECT_URL", "s3://Bad_Bucket/x", "not a valid bucket name"),
        ("KVTIER_OBJECT_ENDPOINT", "ftp://host", "http(s)://host"),
    ],
)
def test_bad_object_settings_name_the_variable(name: str, value: str, says: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings_with_sources(env={name: value})
    assert f"environment variable {name}" in str(err.value) and says in str(err.value)
