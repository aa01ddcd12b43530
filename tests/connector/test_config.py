"""The engine shapes the connector serves: full attention, MLA and sliding windows, in one KV cache
group or several (vLLM's hybrid memory allocator); the rest is refused at start (the connector then
stays idle) with an error that names what was found. And the model's identity in the namespace: what
changes it (weights, config, revision, dtype) and what not."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
)

from kvtier.connector import config
from kvtier.connector.config import UnsupportedEngine, build_config, check_kv_spec, model_identity
from kvtier.storage import keys
from kvtier.storage.keys import model_files_digest

DENSE = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _engine(spec: Any, *more: Any) -> tuple[Any, KVCacheConfig]:
    """A vLLM config reduced to what build_config reads, and a KV cache config of one group of two
    layers per spec."""
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_size": 32}, engine_id="e1", kv_load_failure_policy="recompute"
        ),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="tiny", revision=None),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=None,
    )
    groups = [
        KVCacheGroupSpec(layer_names=[f"layer{2 * g}", f"layer{2 * g + 1}"], kv_cache_spec=s)
        for g, s in enumerate((spec, *more))
    ]
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    return vllm_config, kv_cache_config


@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(**DENSE),
        MLAAttentionSpec(**{**DENSE, "num_kv_heads": 1, "head_size": 576}),
        SlidingWindowSpec(**DENSE, sliding_window=128),
    ],
    ids=["full", "mla", "sliding-window"],
)
def test_full_attention_mla_and_sliding_windows_are_served(spec: Any) -> None:
    check_kv_spec(spec)
    cfg = build_config(*_engine(spec), role_is_worker=False)
    assert cfg.layer_names == ("layer0", "layer1") and cfg.spec.page_bytes == spec.page_size_bytes
    assert not cfg.hybrid and cfg.spec.kv_layout.endswith("/" + type(spec).__name__)


MAMBA = MambaSpec(block_size=16, shapes=((3, 384), (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32))


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (ChunkedLocalAttentionSpec(**DENSE, attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
        (RSWASpec(**DENSE, rswa_window=64), "RSWASpec"),
        (MAMBA, "MambaSpec"),
    ],
    ids=["chunked-local", "r-swa", "state-space"],
)
def test_specs_whose_state_a_chunk_of_blocks_cannot_hold_are_refused(spec: Any, named: str) -> None:
    message = f"MLA and sliding-window attention .*; this engine has a KV cache group of {named}$"
    with pytest.raises(UnsupportedEngine, match=message):
        check_kv_spec(spec)
    # A hybrid engine with one such group among served ones is refused as a whole.
    with pytest.raises(UnsupportedEngine, match=message):
        build_config(*_engine(FullAttentionSpec(**DENSE), spec), role_is_worker=False)


def test_a_sliding_window_hybrid_gets_one_chunk_over_every_group() -> None:
    """Gemma-3-shaped: sliding-window groups around a full-attention one, as vLLM's hybrid memory
    allocator groups them; the chunk holds every group's layers in group order."""
    window = SlidingWindowSpec(**DENSE, sliding_window=128)
    retained = SlidingWindowSpec(**DENSE, sliding_window=64, extra_retained_tokens=3)
    cfg = build_config(*_engine(window, FullAttentionSpec(**DENSE), retained), role_is_worker=False)
    assert cfg.hybrid and cfg.group_sizes == (2, 2, 2)
    assert cfg.group_reach == (127, None, 66)
    assert cfg.layer_names == tuple(f"layer{i}" for i in range(6))
    assert cfg.spec.num_layers == 6 and cfg.spec.page_bytes == window.page_size_bytes
    assert cfg.spec.kv_layout.endswith(
        "/groups:SlidingWindowSpec(127)x2,FullAttentionSpec x2,SlidingWindowSpec(66)x2".replace(" ", "")
    )
    single = build_config(*_engine(FullAttentionSpec(**DENSE)), role_is_worker=False)
    assert single.namespace != cfg.namespace


def test_kv_caches_vllm_zeroes_each_step_are_refused_under_the_v2_runner_only() -> None:
    """Mixed precisions (a bf16 group beside an fp8 one, pages alike): vLLM's V2 runner zeroes their
    new blocks before handle_preemptions, where a deferred save may still read one; V1 calls it first."""
    fp8 = FullAttentionSpec(**{**DENSE, "head_size": 128, "dtype": torch.uint8})
    vllm_config, kv_cache_config = _engine(FullAttentionSpec(**DENSE), fp8)
    assert kv_cache_config.needs_kv_cache_zeroing
    with pytest.raises(UnsupportedEngine, match=r"needs_kv_cache_zeroing.*VLLM_USE_V2_MODEL_RUNNER=0"):
        build_config(vllm_config, kv_cache_config, role_is_worker=False)
    vllm_config.use_v2_model_runner = False
    assert build_config(vllm_config, kv_cache_config, role_is_worker=False).group_sizes == (2, 2)


def test_groups_of_other_block_sizes_are_refused() -> None:
    other = SlidingWindowSpec(**{**DENSE, "block_size": 32}, sliding_window=128)
    with pytest.raises(UnsupportedEngine, match=r"one block size and page size; .* block sizes \[16, 32\]"):
        build_config(*_engine(FullAttentionSpec(**DENSE), other), role_is_worker=False)


# ------------------------------------------------------------------------ the model's identity
def _namespace(model: str, download_dir: str | None = None, **model_fields: Any) -> str:
    """The namespace build_config derives for the dense engine with this model (and these fields)."""
    vllm_config, kv_cache_config = _engine(FullAttentionSpec(**DENSE))
    vllm_config.model_config = SimpleNamespace(**{"model": model, "revision": None, **model_fields})
    vllm_config.load_config = SimpleNamespace(download_dir=download_dir)
    return build_config(vllm_config, kv_cache_config, role_is_worker=False).namespace


def _write_model(path: Path, seed: int, tensors: int = 4) -> Path:
    """A model directory: config, tokenizer files, and more than WHOLE_FILE_BYTES of safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weights = {f"layer{i}.weight": torch.randn(256, 256, generator=generator) for i in range(tensors)}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text('{"hidden_size": 256}')
    (path / "tokenizer.json").write_text('{"vocab": 1}')
    (path / "generation_config.json").write_text('{"temperature": 1.0}')
    return path


def test_weights_replaced_in_place_change_the_namespace(tmp_path: Path) -> None:
    model = _write_model(tmp_path / "m", seed=1)
    weights = model / "model.safetensors"
    before, stat = _namespace(str(model)), weights.stat()
    _write_model(model, seed=2)  # same path, size, header: only the values differ
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert _namespace(str(model)) != before


def test_the_same_files_copied_with_other_mtimes_keep_their_digest(tmp_path: Path) -> None:
    model = _write_model(tmp_path / "m", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    os.utime(copy / "model.safetensors", ns=(1, 1))
    assert model_files_digest(copy) == model_files_digest(model)
    assert _namespace(str(copy)) != _namespace(str(model)), "the path is still part of the identity"


def test_tokenizer_and_generation_files_leave_the_namespace_but_config_does_not(tmp_path: Path) -> None:
    model = _write_model(tmp_path / "m", seed=1)
    before = _namespace(str(model))
    (model / "tokenizer.json").write_text('{"vocab": 2}')
    (model / "generation_config.json").write_text('{"temperature": 0.5}')
    (model / "README.md").write_text("new model card")
    assert _namespace(str(model)) == before
    (model / "config.json").write_text('{"hidden_size": 256, "rope_theta": 1e6}')
    assert _namespace(str(model)) != before


def test_a_changed_tensor_among_more_than_the_sampled_ones_changes_the_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keys, "TENSORS_PER_FILE", 2)  # samples tensors 0 and 2 of 4
    model = _write_model(tmp_path / "m", seed=1)
    before = model_files_digest(model)
    weights = load_file(str(model / "model.safetensors"))
    weights["layer2.weight"] = weights["layer2.weight"] + 1
    save_file(weights, str(model / "model.safetensors"))
    assert model_files_digest(model) != before


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_other_large_weight_files_are_sampled_from_start_to_end(tmp_path: Path, name: str) -> None:
    weights = tmp_path / "m" / name  # a .safetensors name on bytes with no header: sampled alike
    weights.parent.mkdir()
    data = bytearray(os.urandom(3 << 20))
    weights.write_bytes(data)
    before = model_files_digest(weights.parent)
    data[-1] ^= 0xFF
    weights.write_bytes(data)
    assert model_files_digest(weights.parent) != before
    assert model_files_digest(weights) == model_files_digest(weights.parent), "a file names itself"


@pytest.mark.parametrize(
    "field", [{"dtype": "float16"}, {"quantization": "fp8"}, {"hf_overrides": {"rope_theta": 1e6}}]
)
def test_dtype_quantization_and_config_overrides_change_the_namespace(
    tmp_path: Path, field: dict[str, Any]
) -> None:
    model = str(_write_model(tmp_path / "m", seed=1))
    assert _namespace(model, **field) != _namespace(model)


def _hub_cache(root: Path) -> Path:
    """A Hugging Face cache holding kvtier/tiny at two commits: branch main, and branch v2."""
    repo = root / "models--kvtier--tiny"
    for seed, branch in ((1, "main"), (2, "v2")):
        commit = f"{seed:040x}"
        _write_model(repo / "snapshots" / commit, seed=seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return root


def test_revisions_of_a_hub_model_are_told_apart_by_their_files(tmp_path: Path) -> None:
    cache = str(_hub_cache(tmp_path / "hub"))
    main = _namespace("kvtier/tiny", cache, revision="main")
    assert _namespace("kvtier/tiny", cache, revision="v2") != main
    assert _namespace("kvtier/tiny", cache, revision="main") == main
    # The files of main, named by their commit: the same digest, another revision string.
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="kvtier/tiny", revision=f"{1:040x}"),
        load_config=SimpleNamespace(download_dir=cache),
    )
    by_commit = model_identity(vllm_config)
    vllm_config.model_config.revision = "main"
    assert by_commit.split("#")[1] == model_identity(vllm_config).split("#")[1]


def test_a_model_without_local_files_is_named_by_name_and_revision(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    empty_cache = str(tmp_path / "hub")
    with caplog.at_level(logging.WARNING, logger="vllm.kvtier"):
        first = _namespace("s3://bucket/model", empty_cache)
    assert "found no local files of model s3://bucket/model" in caplog.text
    assert _namespace("s3://bucket/model", empty_cache, revision="v2") != first
    assert _namespace("s3://bucket/model", empty_cache) == first


def test_unreadable_model_files_leave_the_engine_unserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(path: Path) -> str:
        raise PermissionError(13, "Permission denied", str(path / "model.safetensors"))

    monkeypatch.setattr(config, "model_files_digest", unreadable)
    with pytest.raises(UnsupportedEngine, match=r"cannot read the model's files at .*Permission denied"):
        _namespace(str(_write_model(tmp_path / "m", seed=1)))


# ------------------------------------------------------------------------ engine variants
MLA = MLAAttentionSpec(**{**DENSE, "num_kv_heads": 1, "head_size": 576})


def test_mla_with_vllms_prefix_cache_off_on_the_cpu_platform_is_refused() -> None:
    """vLLM's CPU platform turns its prefix cache off for MLA: a loaded prefix would change outputs."""
    vllm_config, kv_cache_config = _engine(MLA)
    vllm_config.cache_config.enable_prefix_caching = False
    with pytest.raises(UnsupportedEngine, match=r"does not serve MLA \(MLAAttentionSpec\) on vLLM's CPU"):
        build_config(vllm_config, kv_cache_config, role_is_worker=False)
    vllm_config.cache_config.enable_prefix_caching = True
    assert build_config(vllm_config, kv_cache_config, role_is_worker=False).spec.page_bytes == 16 * 576 * 2


def test_full_attention_with_the_prefix_cache_off_is_served() -> None:
    vllm_config, kv_cache_config = _engine(FullAttentionSpec(**DENSE))
    vllm_config.cache_config.enable_prefix_caching = False
    assert build_config(vllm_config, kv_cache_config, role_is_worker=False).geometry.blocks_per_chunk == 2


def test_a_chunk_size_that_is_not_a_multiple_of_the_block_size_stops_the_engine() -> None:
    from kvtier.app.settings import SettingsError

    vllm_config, kv_cache_config = _engine(FullAttentionSpec(**DENSE))
    vllm_config.kv_transfer_config.kv_connector_extra_config = {"chunk_size": 40}
    with pytest.raises(SettingsError, match=r"chunk_size \(KVTIER_CHUNK_SIZE\): .*; for example 256"):
        build_config(vllm_config, kv_cache_config, role_is_worker=False)


def test_fp8_formats_stored_alike_in_uint8_get_namespaces_of_their_own() -> None:
    """vLLM keeps fp8_e4m3 and fp8_e5m2 KV in uint8 tensors alike: the namespace must tell them apart."""
    spec = FullAttentionSpec(**{**DENSE, "dtype": torch.uint8})
    names = {}
    for cache_dtype in ("fp8_e4m3", "fp8_e5m2"):
        vllm_config, kv_cache_config = _engine(spec)
        vllm_config.cache_config.cache_dtype = cache_dtype
        cfg = build_config(vllm_config, kv_cache_config, role_is_worker=False)
        assert cfg.spec.kv_dtype == f"{cache_dtype}/torch.uint8"
        names[cache_dtype] = cfg.namespace
    assert names["fp8_e4m3"] != names["fp8_e5m2"]
    # "auto" keeps the tensors' dtype alone, so the namespaces of chunks already stored stay as they were.
    auto = build_config(*_engine(FullAttentionSpec(**DENSE)), role_is_worker=False)
    assert auto.spec.kv_dtype == "torch.bfloat16"
