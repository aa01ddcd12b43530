"""vLLM's configuration converted once, at the edge, into kvtier's frozen connector config."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier.app.settings import KVTierSettings, SettingsError, load_settings
from kvtier.connector.planning import Geometry
from kvtier.storage.base import NamespaceSpec
from kvtier.storage.keys import model_files_digest, namespace_id

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level


class UnsupportedEngine(ValueError):
    """The engine's KV cache is of a shape kvtier does not serve (the connector then stays idle)."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector needs, derived from vLLM's config and kvtier's settings."""

    settings: KVTierSettings
    geometry: Geometry
    spec: NamespaceSpec
    namespace: str
    engine_id: str
    num_blocks: int
    layer_names: tuple[str, ...]
    failure_policy: str
    async_scheduling: bool
    # Most tokens one step adds to a request that has computed all it knows: the sampled one and
    # the speculative drafts (the scheduler side skips looking at a request until a save can be due).
    step_tokens: int = 1
    # This side's index among the engine's ranks (pp_rank * tp_size + tp_rank; the scheduler's is 0)
    # and every rank's namespace in that order: the scheduler looks a request up in each.
    rank: int = 0
    rank_namespaces: tuple[str, ...] = ()
    # What kv_role lets this side do; saves is also False on a rank whose KV another rank stores.
    loads: bool = True
    saves: bool = True
    replicated: bool = False  # every tensor-parallel rank holds the same KV (MLA): stored once
    # KV cache groups (vLLM's hybrid memory allocator): layers of each, in the order of layer_names,
    # and each one's sliding-window reach (None: full attention; see planning.window_first_block).
    group_sizes: tuple[int, ...] = ()
    group_reach: tuple[int | None, ...] = ()
    # Set by reset_cache (vLLM reset its caches, e.g. after new weights): the model identity in
    # every namespace carries it, so nothing stored before is found or saved into again.
    generation: str = ""

    @property
    def hybrid(self) -> bool:
        """Whether the engine has several KV cache groups (every load is then asynchronous)."""
        return len(self.group_sizes) > 1

    @property
    def lookup_namespaces(self) -> tuple[str, ...]:
        """The namespace of every rank, in rank order (this side's alone when none were given)."""
        return self.rank_namespaces or (self.namespace,)


def _kv_dtype(cache_config: Any, kv_spec: Any) -> str:
    """The KV element format: vLLM's cache_dtype setting (where not "auto") and the tensors' dtype.

    vLLM keeps fp8_e4m3, fp8_e5m2 and its other quantized formats alike in uint8 tensors."""
    stored = str(getattr(kv_spec, "dtype", cache_config.cache_dtype))
    setting = str(cache_config.cache_dtype)
    if setting == "auto":
        return stored
    skipped = ",".join(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or [])
    return f"{setting}/{stored}" + (f"/skip:{skipped}" if skipped else "")


def _kv_layout(vllm_config: Any, kv_cache_config: Any) -> str:
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    if layout:
        return str(layout)
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

        return str(get_kv_connector_cache_layout(vllm_config))
    except Exception:
        return "unknown"


def _platform() -> str:
    # The inner arrangement of a page depends on the backend and even the CPU instruction set.
    import torch
    from vllm.platforms import current_platform

    name = str(getattr(current_platform, "device_type", "unknown"))
    if name == "cpu":
        name += ":" + str(torch.backends.cpu.get_cpu_capability())
    return name


def _tp_pp_rank(role_is_worker: bool) -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel rank; (0, 0) for the scheduler."""
    if not role_is_worker:
        return 0, 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:
        return 0, 0


# kv_role -> (loads, saves): a prefill engine (producer) only saves, a decode engine (consumer) only loads.
KV_ROLES = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}
# The tp_rank of a namespace whose KV every tensor-parallel rank holds alike (MLA's latent KV).
EVERY_TP_RANK = -1


def role_actions(kv_role: Any) -> tuple[bool, bool]:
    """(loads, saves) for vLLM's kv_role; SettingsError names the roles kvtier serves."""
    actions = KV_ROLES.get(str(kv_role))
    if actions is None:
        raise SettingsError(
            f"kv_transfer_config.kv_role is {kv_role!r}; kvtier serves kv_both (load and save), "
            "kv_producer (save only) and kv_consumer (load only)"
        )
    return actions


def tp_replicated(kv_spec: Any) -> bool:
    """Whether every tensor-parallel rank holds the same KV (MLA's latent cache is not split by head)."""
    return type(kv_spec).__name__ == "MLAAttentionSpec"


def rank_specs(spec: NamespaceSpec, replicated: bool) -> list[NamespaceSpec]:
    """The namespace spec of every rank in rank order (pipeline stage major), from any rank's spec.

    Each rank stores its own shard under its own namespace; KV that every tensor-parallel rank holds
    alike is stored once per stage, in one namespace with no tensor-parallel rank in it.
    """
    return [
        replace(spec, tp_rank=EVERY_TP_RANK if replicated else tp, pp_rank=pp)
        for pp in range(spec.pp_size)
        for tp in range(spec.tp_size)
    ]


def check_parallel(parallel_config: Any) -> None:
    """Raise UnsupportedEngine for pipeline parallelism: no engine of it could be tested here (vLLM's
    CPU build fails its first step with pipeline_parallel_size 2), and each stage's layer count,
    part of its namespace, is not known to the scheduler."""
    stages = int(getattr(parallel_config, "pipeline_parallel_size", 1))
    if stages != 1:
        raise UnsupportedEngine(
            f"kvtier serves pipeline_parallel_size 1 (any tensor_parallel_size); this engine has {stages}"
        )


def saves_on_rank(tp_rank: int, replicated: bool) -> bool:
    """Whether a rank stores its KV: every rank its own shard, or tensor rank 0 alone for replicated KV."""
    return not replicated or tp_rank == 0


def _model_files(vllm_config: Any) -> Path | None:
    """Where the model's files are: its local path, or the snapshot of its revision in the Hugging Face
    cache (vLLM has downloaded it by the time a connector starts); None when neither is found."""
    model = vllm_config.model_config
    name = str(model.model)
    if os.path.exists(name):
        return Path(name)
    try:
        from huggingface_hub import snapshot_download
        from vllm import envs

        if envs.VLLM_USE_MODELSCOPE:  # downloaded from ModelScope: the Hugging Face cache has no say
            return None

        download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
        snapshot = snapshot_download(
            name,
            revision=getattr(model, "revision", None),
            cache_dir=download_dir,
            local_files_only=True,
            ignore_patterns="*",
        )
    except Exception:  # not a Hugging Face model in the cache: an object store URL, another hub
        return None
    return Path(snapshot) if os.path.isdir(snapshot) else None


def model_identity(vllm_config: Any) -> str:
    """The model's part of the namespace: name, revision, and a digest of what else decides its KV
    (the content of its files, dtype, quantization, code revision, config overrides)."""
    model = vllm_config.model_config
    files = _model_files(vllm_config)
    try:
        files_digest = model_files_digest(files) if files is not None else None
    except OSError as exc:
        raise UnsupportedEngine(f"kvtier cannot read the model's files at {files}: {exc}") from None
    if files_digest is None:
        log.warning(
            "kvtier found no local files of model %s; its chunks are told apart by name and revision "
            "only, so weights replaced under the same name and revision would reuse older chunks",
            model.model,
        )
    overrides = getattr(model, "hf_overrides", None)
    if callable(overrides):
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    facts = {
        "files": files_digest,
        "dtype": str(getattr(model, "dtype", "")),
        "quantization": str(getattr(model, "quantization", None)),
        "code_revision": str(getattr(model, "code_revision", None)),
        "hf_overrides": overrides,
    }
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return f"{model.model}@{getattr(model, 'revision', None) or ''}#{digest}"


def _step_tokens(vllm_config: Any) -> int:
    speculative = getattr(vllm_config, "speculative_config", None)
    drafts = getattr(speculative, "num_speculative_tokens", None) if speculative is not None else 0
    return 1 + max(0, int(drafts or 0))


# KV cache specs kvtier serves: full attention and MLA (blocks stay with a request until it finishes
# or is preempted) and sliding windows (vLLM frees the blocks behind the window; a chunk holds those
# inside it, see planning.stored_first_block). Others (chunked local attention, R-SWA, state spaces)
# keep state a chunk of blocks cannot hold.
SERVED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")


def check_kv_spec(kv_spec: Any) -> None:
    """Raise UnsupportedEngine unless the KV cache spec is one kvtier serves (SERVED_SPECS)."""
    name = type(kv_spec).__name__
    if name not in SERVED_SPECS:
        raise UnsupportedEngine(
            f"kvtier serves KV caches of full attention, MLA and sliding-window attention "
            f"({', '.join(SERVED_SPECS)}); this engine has a KV cache group of {name}"
        )


def window_reach(kv_spec: Any) -> int | None:
    """A sliding-window spec's tokens behind the next one that vLLM keeps; None for full attention."""
    if type(kv_spec).__name__ != "SlidingWindowSpec":
        return None
    return int(kv_spec.sliding_window) - 1 + int(getattr(kv_spec, "extra_retained_tokens", 0) or 0)


def real_page_bytes(kv_spec: Any) -> int:
    """Bytes of one block of one layer as vLLM's views hold them: the page without the padding vLLM
    may leave after it (``page_size_bytes`` includes it, e.g. MLA's alignment); kvtier copies and
    stores exactly these bytes."""
    return int(getattr(kv_spec, "real_page_size_bytes", kv_spec.page_size_bytes))


def check_groups(groups: Any, block_size: int) -> None:
    """Raise UnsupportedEngine unless every KV cache group is served and pages alike (one chunk holds
    every group's blocks of the same tokens)."""
    if not groups:
        raise UnsupportedEngine("kvtier found no KV cache group in this engine")
    for group in groups:
        check_kv_spec(group.kv_cache_spec)
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    pages = {real_page_bytes(g.kv_cache_spec) for g in groups}
    if sizes != {block_size} or len(pages) != 1:
        raise UnsupportedEngine(
            f"kvtier serves KV cache groups of one block size and page size; this engine's groups "
            f"have block sizes {sorted(sizes)} (cache block size {block_size}) and pages {sorted(pages)}"
        )


def check_prefix_reuse(vllm_config: Any, kv_spec: Any) -> None:
    """Raise UnsupportedEngine for MLA on vLLM's CPU platform with vLLM's prefix cache off.

    vLLM turns its own prefix cache off there because its reference CPU MLA backend does not compute
    over a cached prefix as a full prefill does; KV loaded by kvtier would change the outputs.
    """
    if type(kv_spec).__name__ != "MLAAttentionSpec":
        return
    if getattr(vllm_config.cache_config, "enable_prefix_caching", True) is not False:
        return
    from vllm.platforms import current_platform

    if str(getattr(current_platform, "device_type", "")) != "cpu":
        return
    raise UnsupportedEngine(
        "kvtier does not serve MLA (MLAAttentionSpec) on vLLM's CPU platform with vLLM's prefix "
        "cache off: vLLM turns it off there because its CPU MLA backend does not compute over a "
        "cached prefix as a full prefill does, so KV that kvtier loads would change the outputs"
    )


def _v2_model_runner(vllm_config: Any) -> bool:
    """Whether vLLM runs its V2 model runner (its GPU default); True where the config cannot say."""
    try:
        return bool(getattr(vllm_config, "use_v2_model_runner", True))
    except Exception:  # the property may raise on a config it finds inconsistent
        return True


def check_block_writes(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise UnsupportedEngine where vLLM writes reused blocks before kvtier can fence its saves.

    vLLM's V2 model runner zeroes new blocks (engines whose ``needs_kv_cache_zeroing``: state spaces,
    KV caches of mixed precision) and queues copy-on-write copies before it calls
    ``handle_preemptions``, so a deferred save still reading a preempted request's block could
    commit what those writes left there. The V1 runner calls it first. Copy-on-write copies follow
    local prefix hits that end inside a block, which only state spaces and hash blocks smaller than
    a block make; kvtier refuses both (``check_kv_spec``, ``hash_block_size``).
    """
    if not bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False)):
        return
    if _v2_model_runner(vllm_config):
        raise UnsupportedEngine(
            "kvtier does not serve KV caches vLLM zeroes before each step (needs_kv_cache_zeroing: "
            "state spaces or mixed precisions) under vLLM's V2 model runner, which zeroes them "
            "before kvtier can fence its saves; VLLM_USE_V2_MODEL_RUNNER=0 runs the V1 runner"
        )


def build_config(vllm_config: Any, kv_cache_config: Any, role_is_worker: bool) -> ConnectorConfig:
    """Validate settings and derive geometry and namespace; raises SettingsError or UnsupportedEngine."""
    kv_transfer = vllm_config.kv_transfer_config
    settings = load_settings(extra=dict(kv_transfer.kv_connector_extra_config or {}))
    loads, saves = role_actions(getattr(kv_transfer, "kv_role", "kv_both"))
    block_size = int(vllm_config.cache_config.block_size)
    groups = [] if kv_cache_config is None else list(kv_cache_config.kv_cache_groups)
    check_groups(groups, block_size)  # before the chunk size: an engine not served is idle, not stopped
    try:
        geometry = Geometry(block_size, settings.chunk_size)
    except ValueError as exc:
        # The user's setting, not the engine, is wrong: refuse to start rather than run idle.
        raise SettingsError(
            f"kvtier setting chunk_size (KVTIER_CHUNK_SIZE): {exc}; for example "
            f"{block_size * max(1, 256 // block_size)}"
        ) from None
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block not in (None, block_size):
        raise UnsupportedEngine(
            f"kvtier needs block hashes per block; hash_block_size={hash_block} != {block_size}"
        )
    for group in groups:
        check_prefix_reuse(vllm_config, group.kv_cache_spec)
    check_block_writes(vllm_config, kv_cache_config)
    check_parallel(vllm_config.parallel_config)
    tp_rank, pp_rank = _tp_pp_rank(role_is_worker)
    replicated = all(tp_replicated(g.kv_cache_spec) for g in groups)
    spec_tp_rank = EVERY_TP_RANK if replicated else tp_rank
    spec = _namespace_spec(vllm_config, kv_cache_config, settings.chunk_size, spec_tp_rank, pp_rank)
    return ConnectorConfig(
        settings=settings,
        geometry=geometry,
        spec=spec,
        namespace=namespace_id(spec),
        engine_id=str(kv_transfer.engine_id),
        num_blocks=int(kv_cache_config.num_blocks),
        layer_names=tuple(name for g in groups for name in g.layer_names),
        failure_policy=str(getattr(kv_transfer, "kv_load_failure_policy", "fail")),
        async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
        step_tokens=_step_tokens(vllm_config),
        rank=pp_rank * spec.tp_size + tp_rank,
        rank_namespaces=tuple(namespace_id(s) for s in rank_specs(spec, replicated)),
        loads=loads,
        saves=saves and saves_on_rank(tp_rank, replicated),
        replicated=replicated,
        group_sizes=tuple(len(g.layer_names) for g in groups),
        group_reach=tuple(window_reach(g.kv_cache_spec) for g in groups),
    )


GENERATION_MARK = "~gen:"


def with_generation(cfg: ConnectorConfig, generation: str) -> ConnectorConfig:
    """cfg moved to a new generation of the model's KV: the model identity of its spec (and every
    rank's) ends in the generation, so its namespaces are new ones."""
    base = cfg.spec.model.split(GENERATION_MARK, 1)[0]
    spec = replace(cfg.spec, model=f"{base}{GENERATION_MARK}{generation}")
    return replace(
        cfg,
        spec=spec,
        namespace=namespace_id(spec),
        rank_namespaces=tuple(namespace_id(s) for s in rank_specs(spec, cfg.replicated)),
        generation=generation,
    )


def _namespace_spec(
    vllm_config: Any, kv_cache_config: Any, chunk_size: int, tp_rank: int, pp_rank: int
) -> NamespaceSpec:
    """This rank's namespace spec (``tp_rank`` EVERY_TP_RANK for KV every tensor-parallel rank
    holds alike)."""
    groups = kv_cache_config.kv_cache_groups
    kv_spec = groups[0].kv_cache_spec
    parallel = vllm_config.parallel_config
    return NamespaceSpec(
        model=model_identity(vllm_config),
        kv_dtype=_kv_dtype(vllm_config.cache_config, kv_spec),
        kv_layout=f"{_kv_layout(vllm_config, kv_cache_config)}/{_platform()}/{_groups_name(groups)}",
        block_size=int(vllm_config.cache_config.block_size),
        chunk_size=chunk_size,
        num_layers=sum(len(g.layer_names) for g in groups),
        page_bytes=real_page_bytes(kv_spec),
        tp_rank=tp_rank,
        tp_size=int(parallel.tensor_parallel_size),
        pp_rank=pp_rank,
        pp_size=int(parallel.pipeline_parallel_size),
        hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
    )


def _groups_name(groups: Any) -> str:
    """The KV cache groups as a chunk lays them out: one spec's name for one group (as before hybrid
    engines were served), else each group's spec, window and layer count in order."""
    if len(groups) == 1:
        return type(groups[0].kv_cache_spec).__name__
    parts = []
    for g in groups:
        reach = window_reach(g.kv_cache_spec)
        window = "" if reach is None else f"({reach})"
        parts.append(f"{type(g.kv_cache_spec).__name__}{window}x{len(g.layer_names)}")
    return "groups:" + ",".join(parts)
