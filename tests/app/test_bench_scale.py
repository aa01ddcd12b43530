"""`kvtier bench scale --quick` runs end to end through the CLI: every tier at each small size, the
service at each connection count and each tier's hit at each short context, with the report's shape
and counts as documented; its events part alone, with the KV events' exact sizes."""

from __future__ import annotations

import json
import shutil

import pytest

from kvtier.app import cli
from kvtier.app.chunk_description import decode_description
from kvtier.bench import scale_context, scale_events, scale_service, scale_tiers
from kvtier.storage.codec import description_of
from tests.support.skips import missing

IN_MEMORY = ("dict_floor", "cpu", "disk", "object_index")
COSTS = ("lookup_us", "lookup_spread_us", "commit_us", "commit_evict_us", "evict_us")


@pytest.mark.e2e  # its context part runs vLLM engines
@pytest.mark.redis
def test_quick_scale_benchmark_reports_every_tier_size_connection_count_and_context(
    tmp_path, monkeypatch
) -> None:
    if shutil.which("redis-server") is None:
        missing("redis-server")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "scale", "--quick", "--out", "scale.json"]) == 0
    fig = json.loads((tmp_path / "scale.json").read_text())
    assert fig["quick"] is True

    tiers = fig["tiers"]
    sizes = [str(n) for n in scale_tiers.QUICK_SIZES]
    assert tiers["sizes"] == list(scale_tiers.QUICK_SIZES) and tiers["repeats"] == 1
    assert sorted(tiers["tiers"]) == sorted(scale_tiers.TIERS)
    for name, tier in tiers["tiers"].items():
        assert list(tier["by_chunks"]) == sizes, name
        assert sorted(tier["largest_over_smallest"]) == sorted(COSTS[:4]), name
        for n, f in tier["by_chunks"].items():
            assert f["chunks"] == int(n)
            for cost in COSTS:
                assert len(f[cost]["runs"]) == 1 and f[cost]["median"] == f[cost]["runs"][0], (name, cost)
            for cost in COSTS[:4]:
                assert f[cost]["median"] > 0, (name, n, cost)
            if name in IN_MEMORY:
                assert f["index_bytes"] > 0, (name, n)
    redis = tiers["tiers"]["redis"]["by_chunks"]
    for f in redis.values():
        assert f["server_bytes_per_key"] > f["server_index_bytes"] > 0
        assert f["redis_evicted_keys"] > 0  # its commit_evict phase ran against maxmemory
    assert tiers["tiers"]["cpu"]["by_chunks"][sizes[-1]]["capacity_bytes"] == (
        (scale_tiers.QUICK_SIZES[-1] + scale_tiers.BATCH) * scale_tiers.CPU_SLOT
    )

    service = fig["service"]
    counts = [str(c) for c in scale_service.QUICK_CONNECTIONS]
    assert service["connections"] == list(scale_service.QUICK_CONNECTIONS)
    for load in ("saturated", "paced"):
        assert list(service[load]) == counts
        for count, f in service[load].items():
            assert f["connections"] == int(count)
            requests = f["requests"]["median"]
            assert requests > 0 and f["ops"]["median"] == requests * scale_service.OPS_PER_REQUEST
            assert 0 < f["lookup_p50_us"]["median"] <= f["lookup_p99_us"]["median"]
    assert list(service["paced_lookup_p99_over_one_connection"]) == counts
    assert service["paced_lookup_p99_over_one_connection"]["1"] == 1.0

    context = fig["context"]
    contexts = [str(n) for n in scale_context.QUICK_CONTEXTS]
    assert context["contexts"] == list(scale_context.QUICK_CONTEXTS)
    assert context["repeats"] == 1 and context["rounds"] == 1
    assert context["kv_bytes_per_token"] == 2 * 2 * 8 * 128 * 2  # two layers of 8 KV heads x 128, bf16
    assert list(context["miss_ttft_ms"]) == contexts == list(context["cpu_hit_by_phase"])
    # Each tier's hits were checked, run by run, to be exactly its own and every stored token.
    assert sorted(context["tiers"]) == ["cpu", "disk", "redis"]
    for name, by_tokens in context["tiers"].items():
        assert list(by_tokens) == contexts, name
        for n, f in by_tokens.items():
            assert f["ratio"]["runs"] == [f["ratio"]["median"]] and f["ratio"]["median"] > 0, (name, n)
            assert f["floor_ms"]["median"] >= f["ceiling_ms"], (name, n)
        assert context["hit_floor_ratio"][name] == {n: f["ratio"]["median"] for n, f in by_tokens.items()}
    assert sorted(context["longest_over_first"]) == sorted(context["slopes"]) == sorted(context["tiers"])
    for n, f in context["cpu_hit_by_phase"].items():
        assert f["kvtier_ms_by_hook"]["start_load_kv"] > 0, n  # the hit's load ran in the worker


def _msgpack_uint_bytes(value: int) -> int:
    """Bytes msgpack takes for a non-negative int."""
    return 1 if value < 128 else 2 if value < 256 else 3 if value < 65536 else 5 if value < 1 << 32 else 9


def test_quick_events_part_reports_exact_bytes_per_chunk_and_a_lossless_stream(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "scale", "events", "--quick", "--out", "scale.json"]) == 0
    fig = json.loads((tmp_path / "scale.json").read_text())
    assert sorted(fig) == ["events", "quick", "started"]
    events = fig["events"]

    # Exact sizes: 64-bit int hashes take 9 bytes each, 32-byte ones 34; BlockStored's fields
    # other than the token ids are fixed, and each token id takes msgpack's size for its value.
    without_tokens = {("16", "int"): 312, ("16", "bytes"): 737, ("256", "int"): 160, ("256", "bytes"): 210}
    removed = {("16", "int"): 214, ("16", "bytes"): 614, ("256", "int"): 77, ("256", "bytes"): 102}
    for (block_size, fmt), size in removed.items():
        f = events["bytes"][block_size][fmt]
        assert f["blocks_per_chunk"] == 256 // int(block_size)
        assert f["removed_bytes"] == size, (block_size, fmt)
        assert f["stored_bytes_without_tokens"] == without_tokens[block_size, fmt], (block_size, fmt)
        chunk = scale_events.described_chunks(2, int(block_size))[1]  # the measured chunk: it has a parent
        desc = decode_description(description_of(chunk))
        assert desc is not None and desc.parent == scale_events.described_chunks(1, int(block_size))[0][-1]
        tokens = desc.token_ids()
        assert len(tokens) == 256
        assert f["token_ids_bytes"] == 3 + sum(map(_msgpack_uint_bytes, tokens)), (block_size, fmt)
        assert f["stored_bytes"] == f["stored_bytes_without_tokens"] + f["token_ids_bytes"]
        assert f["batch_overhead_bytes"] == 12  # [ts, events, rank]: array, float64, array, nil
        assert f["frame_bytes"] == len(scale_events.TOPIC) + 8

    for block_size in ("16", "256"):
        cpu = events["cpu"][block_size]
        assert cpu["chunks"] == scale_events.QUICK_CPU_CHUNKS and cpu["repeats"] == 1
        for phase in ("stored", "stored_copy", "removed_copy", "removed", "encode_stored", "encode_removed"):
            assert len(cpu[f"{phase}_us"]["runs"]) == 1 and cpu[f"{phase}_us"]["median"] > 0, phase

    # Below the high-water mark nothing is lost: every chunk sent arrives, decoded, in sequence.
    assert list(events["stream"]) == [str(n) for n in scale_events.QUICK_PER_BATCH]
    for per_batch, f in events["stream"].items():
        sent = f["chunks_sent"][0]
        assert 0 < sent <= scale_events.QUICK_MAX_CHUNKS and sent % int(per_batch) == 0
        assert f["chunks_received"] == [sent] and f["batches_lost"] == [0] and f["missing_seqs"] == [0]
        assert f["delivered_chunks_per_s"]["median"] > 0
        assert (
            f["received_bytes_per_chunk"]["median"]
            > events["bytes"]["16"]["int"]["stored_bytes_without_tokens"]
        )

    stalled = events["stalled"]
    assert stalled["hwm"] == scale_events.STALL_HWM
    assert stalled["batches_sent"] == stalled["chunks_sent"] == scale_events.QUICK_STALL_BATCHES
    assert stalled["batches_received"] + stalled["batches_lost"] == stalled["batches_sent"]
    assert stalled["counted_dropped"] == 0  # a PUB socket never refuses a send: it drops unseen
