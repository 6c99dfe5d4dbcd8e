"""What the connector takes from vLLM's configuration: its ``kv_connector_extra_config`` keys
(:class:`Settings`), where this engine's KV lies among the shards of a block (tensor and pipeline
parallel, KV-cache groups), and the one setting it writes back (``kv_load_failure_policy``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from connector.roles.guard import GUARDS
from connector.transfer.layout import KVSpec
from connector.vllm.cache_groups import Group, engine_groups, refuse_draft_layers
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32.0",)  # the KV-connector API is experimental and changes between releases
RANK_FREE_LAYOUTS = frozenset({"vllm_mla"})  # the same bytes on every tensor-parallel rank: stored once


@dataclass(slots=True, frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (all optional)."""

    url: str = "grpc://127.0.0.1:50051"  # the sidecar's gRPC address
    token: str = ""  # the sidecar's server.auth_token; empty: $KVSTORE_TOKEN, if set
    model_id: str = ""  # namespace model name; default: vLLM's model path/name
    revision: str = ""  # namespace revision; default: vLLM's model revision
    save_decode: bool = True  # also store blocks filled by generated tokens
    verify_checksums: bool = True  # never load a corrupted block, under load_guard
    load_guard: str = "read_only"  # "read_only": trust a slab mapped read-only here, hash others; "hash": hash all
    lease_ttl_ms: int = 30_000  # the lookup's lease on the blocks it found, until they are loaded
    lookup_reuse_ms: int = 1_000  # a waiting request's lookup answer is reused this long
    load_failure_policy: Literal["recompute", "fail"] = "recompute"  # applied to vLLM's kv_load_failure_policy
    transfer: str = ""  # "numpy" | "cupy"; default by device
    threads: int = 1  # transfer threads in the worker
    directory: bool = True  # remember where this engine's blocks lie: lookups without a round trip
    wait_published: bool | None = None  # a save is done once the cluster directory lists it; None: kv_producer only
    wait_write_through: bool = False  # a save is done once the write-through tiers (Redis, S3) hold it
    handoff_wait_ms: int = 1_000  # how long a request whose kv_transfer_params announce blocks waits for them

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        if extra.get("load_failure_policy", "recompute") not in ("recompute", "fail"):
            raise ValueError("kv_connector_extra_config.load_failure_policy: 'recompute' or 'fail'")
        if extra.get("load_guard", "read_only") not in GUARDS:
            raise ValueError(f"kv_connector_extra_config.load_guard: one of {list(GUARDS)}")
        wait = extra.get("handoff_wait_ms", 0)
        if not isinstance(wait, int) or isinstance(wait, bool) or wait < 0:
            raise ValueError("kv_connector_extra_config.handoff_wait_ms: milliseconds, an integer >= 0")
        return cls(**extra)


def apply_load_failure_policy(tc: KVTransferConfig, settings: Settings) -> None:
    """Write the settings' ``load_failure_policy`` into vLLM's ``kv_load_failure_policy`` (read by
    its scheduler after the connector is built)."""
    if tc.kv_load_failure_policy != settings.load_failure_policy:
        log.info("kvstore connector: kv_load_failure_policy %r -> %r", tc.kv_load_failure_policy,
                 settings.load_failure_policy)
        tc.kv_load_failure_policy = settings.load_failure_policy


def cannot_load_mla(role: str) -> str:
    """Why an MLA engine without prefix caching cannot load. vLLM turns prefix caching (and chunked
    prefill) off for MLA where its CPU backend cannot attend to a cached prefix (the reference CPU
    MLA backend, chosen without AMX: its prefill is plain SDPA over the new tokens): loaded blocks
    would give wrong output, so such an engine only saves."""
    return (f"kvstore connector: kv_role {role!r}: this MLA engine cannot compute behind a cached prefix (vLLM "
            "turned prefix caching off for its MLA backend, the reference CPU one without AMX), so loading "
            "blocks would give wrong output; run it as kv_producer (it stores blocks that engines with prefix "
            "caching load)")


def tensor_shards(vllm_config: VllmConfig, ns: Namespace) -> int:
    """Tensor-parallel shards of the engine's KV: 1 for a rank-free layout (MLA's latent cache)."""
    return 1 if ns.kv_layout in RANK_FREE_LAYOUTS else vllm_config.parallel_config.tensor_parallel_size


def parallel_shards(vllm_config: VllmConfig, ns: Namespace) -> tuple[Namespace, ...]:
    """The namespaces of every shard of the engine's KV, in shard order (pipeline stage, then
    tensor-parallel rank): each names its tensor-parallel ``rank`` and ``world_size`` and, under
    pipeline parallel, its stage's layer range (``+layers=START-END`` in the revision, vLLM's own
    split). Just ``ns`` without parallelism. A rank-free layout (MLA) has one shard per stage,
    without a rank, whatever the tensor-parallel size."""
    tp, pp = tensor_shards(vllm_config, ns), vllm_config.parallel_config.pipeline_parallel_size
    if tp == 1 and pp == 1:
        return (ns,)
    from vllm.distributed.utils import get_pp_indices

    layers = vllm_config.model_config.get_total_num_hidden_layers()
    shards: list[Namespace] = []
    for stage in range(pp):
        revision = ns.revision
        if pp > 1:
            start, end = get_pp_indices(layers, stage, pp)
            revision = f"{revision}+layers={start}-{end}"
        shards += [replace(ns, revision=revision, rank=rank, world_size=tp) for rank in range(tp)]
    return tuple(shards)


def engine_shards(vllm_config: VllmConfig, groups: tuple[Group, ...]) -> tuple[Namespace, ...]:
    """Every shard's namespace: :func:`parallel_shards` of each KV-cache group's namespace, in the
    order pipeline stage, tensor-parallel rank, group (group ``g`` of parallel shard ``p`` is shard
    ``p * len(groups) + g``)."""
    per_group = [parallel_shards(vllm_config, g.ns) for g in groups]
    return tuple(per_group[g][p] for p in range(len(per_group[0])) for g in range(len(groups)))


def own_shard(vllm_config: VllmConfig, ns: Namespace) -> tuple[int, bool]:
    """This worker's index in :func:`parallel_shards` (its pipeline stage and tensor-parallel
    rank), and whether it writes that shard: every rank its own; a rank-free shard (MLA) is
    written by tensor-parallel rank 0 only and read by every rank."""
    par = vllm_config.parallel_config
    if par.tensor_parallel_size == 1 and par.pipeline_parallel_size == 1:
        return 0, True
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, rank = tensor_shards(vllm_config, ns), get_tp_group().rank_in_group
    return get_pp_group().rank_in_group * tp + (rank if tp > 1 else 0), tp > 1 or rank == 0


@dataclass(slots=True, frozen=True)
class EngineKV:
    """Where this engine's (this rank's) KV lies: its KV-cache groups, every shard's namespace, the
    first shard this process reads and writes, and a handoff's shape (checked on arrival)."""

    groups: tuple[Group, ...]
    shards: tuple[Namespace, ...]  # every shard's namespace (:func:`engine_shards`)
    first: int  # this process's first group's shard; group g's is first + g (the scheduler: 0)
    writer: bool  # whether this process writes its shards (False: an MLA reader on TP rank > 0)
    shape: dict[str, int]  # the block size and parallel sizes a handoff names

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: Settings,
           worker: bool) -> EngineKV:
        """The engine's KV as vLLM configured it (refused at start: draft layers, Mamba state,
        unknown cache dtypes, naming what is refused)."""
        refuse_draft_layers(vllm_config)
        groups = engine_groups(vllm_config, kv_cache_config, settings.model_id, settings.revision)
        ns = groups[0].ns  # every group has this block size and layout
        part, writer = own_shard(vllm_config, ns) if worker else (0, True)
        # a rank-free cache loads whatever the TP size
        shape = {"block_size": groups[0].spec.block_size, "tensor_parallel_size": tensor_shards(vllm_config, ns),
                 "pipeline_parallel_size": vllm_config.parallel_config.pipeline_parallel_size}
        return cls(groups, engine_shards(vllm_config, groups), part * len(groups), writer, shape)

    @property
    def spec(self) -> KVSpec:
        return self.groups[0].spec

    @property
    def ns(self) -> Namespace:
        """This process's first shard's namespace (the scheduler's: shard 0's; the others' go with
        every load and save)."""
        return self.shards[self.first]

    def rank_free(self) -> bool:
        return self.groups[0].ns.kv_layout in RANK_FREE_LAYOUTS
