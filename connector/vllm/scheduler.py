"""The connector's scheduler side in vLLM's terms: vLLM's requests and scheduler outputs turned
into the calls of the core's :class:`~connector.roles.SchedulerConnector` (one batched Acquire per
request, the loads it offers, the saves of blocks that became full in a step).

What it adds to the core is only what vLLM's call protocol asks for: a request's namespace (its
``cache_salt`` and LoRA adapter) and bypass reason, made once when the scheduler first shows it; a
lookup answer reused while vLLM asks again for a request waiting for free blocks
(``lookup_reuse_ms``); the wait for blocks a prefill announced (:mod:`connector.vllm.handoff`);
the block tables vLLM hands out step by step, from which the full blocks are offered for saving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connector.roles import ConnectorMetadata, SchedulerConnector
from connector.roles.block_directory import directory_for
from connector.roles.finders import DirectoryFinder, Finder, LeaseFinder
from connector.roles.hints import retain_ms_of_params
from connector.roles.pipeline import PipelineSlot
from connector.vllm.config import EngineKV, Settings
from connector.vllm.handoff import Handoffs
from connector.vllm.request_keys import AdapterHashes, media_extras
from kvstore.client import SyncClient
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    core: ConnectorMetadata = field(default_factory=ConnectorMetadata)
    preempted: frozenset[str] = frozenset()
    bypassed: tuple[tuple[str, int], ...] = ()  # requests new this step served without the cache: (reason, blocks)


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
    :data:`kvstore.stats.counters.BYPASS_REASONS`), or None."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    return None


class SchedulerSide:
    """vLLM's scheduler-side hooks over the core's scheduler (``load``: a kv_consumer or kv_both
    role; ``save``: a kv_producer or kv_both role)."""

    def __init__(self, client: SyncClient, settings: Settings, kv: EngineKV, load: bool, save: bool) -> None:
        self.pipeline = PipelineSlot(client)
        lease_finder = LeaseFinder(client, self.pipeline)
        finder: Finder = lease_finder
        if settings.directory:
            finder = DirectoryFinder(lease_finder, directory_for(settings.url))
        n_groups, shards = len(kv.groups), kv.shards
        self.core = SchedulerConnector(client, kv.ns, kv.spec, lease_ttl_ms=settings.lease_ttl_ms, finder=finder,
                                       shards=shards[1:],
                                       shard_groups=[i % n_groups for i in range(1, len(shards))]
                                       if n_groups > 1 else ())
        self.ns, self.spec = kv.ns, kv.spec
        self.settings = settings
        self.load, self.save = load, save
        self.handoffs = Handoffs(self.core.stats, kv.shape, settings.handoff_wait_ms)
        self._reqs: dict[str, _Req] = {}
        self._lookups: dict[str, tuple[int, int, int, float]] = {}  # req -> (computed, tokens, n, until)
        self._bypassed: list[tuple[str, int]] = []  # (reason, prompt blocks) until the next step's metadata
        self._adapters = AdapterHashes()  # LoRA adapter identities by path

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
            self.core.set_extras(request.request_id, media_extras(request.mm_features, self.spec.block_size))
        req = self._reqs[request.request_id] = _Req(request, ns, bypass, retain_ms=request_retain_ms(request))
        return req

    def on_new_request(self, request: Request, kv_cache_manager: Any) -> None:
        """Send the request's lookup now, unless vLLM holds its first block (then it has a local
        hit, and the lookup waits until the scheduler knows its length)."""
        req = self._req(request)
        if not self.load or req.bypass or _cached_locally(request, kv_cache_manager):
            return
        self.core.on_new_request(request.request_id, request.all_token_ids, req.ns)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req = self._req(request)
        if not self.load or req.bypass:
            return 0, False
        # vLLM asks again every step while a request waits for free blocks: reuse the answer for a
        # while (a block evicted meanwhile fails its load and is recomputed).
        now = time.monotonic()
        req_id = request.request_id
        cached = self._lookups.get(req_id)
        if (cached is not None and cached[0] == num_computed_tokens and cached[1] == request.num_tokens
                and now < cached[3]):
            return cached[2], False
        if self.handoffs.polling(req_id, now):
            return None, False  # waiting for a prefill's blocks: asked again shortly
        n = self.core.get_num_new_matched_tokens(req_id, request.all_token_ids, num_computed_tokens, req.ns)
        if self.handoffs.waits(request, req.ns, (num_computed_tokens + n) // self.spec.block_size, now):
            return None, False
        until = now + self.settings.lookup_reuse_ms / 1000
        self._lookups[req_id] = (num_computed_tokens, request.num_tokens, n, until)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            groups = blocks.get_block_ids()  # one block table per KV-cache group
            self.core.update_state_after_alloc(request.request_id, groups[0], num_external_tokens, groups)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
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
        return KVStoreConnectorMetadata(self.core.build_connector_meta(),
                                        frozenset(scheduler_output.preempted_req_ids or ()), bypassed)

    def _offer_save(self, req_id: str, req: _Req, computed: int) -> None:
        """Hand the blocks that this step fills to the worker. All full blocks from the first are
        offered (so the sidecar records the prefix chain); it copies only those it lacks."""
        if not self.save or req.bypass:
            return
        bs = self.spec.block_size
        limit = len(req.request.all_token_ids) if self.settings.save_decode else req.request.num_prompt_tokens
        full = min(computed, limit) // bs
        full = min(full, len(req.block_ids[0])) if req.block_ids else 0
        if full > req.offered:
            groups = [table[:full] for table in req.block_ids]
            self.core.schedule_save(req_id, req.request.all_token_ids[: full * bs], groups[0], req.retain_ms, req.ns,
                                    groups)
            req.offered = full

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.core.update_connector_output(finished_saving=connector_output.finished_sending or ())
        bad = connector_output.invalid_block_ids
        if bad:
            self.core.stats.add(recomputed_after_failed_load_blocks=len(bad))
            for req in self._reqs.values():
                if any(not bad.isdisjoint(table) for table in req.block_ids):
                    req.offered = 0  # the recomputed blocks are offered again when full

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """True while its saves are in flight (vLLM keeps its blocks until ``finished_sending``).
        The output vLLM emits now carries ``kv_transfer_params`` naming the prompt's full blocks
        this instance stores, for a decode instance to wait for (the saves may still be running)."""
        req = self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self.handoffs.forget(request.request_id)
        params = None
        if req is not None and self.save and not req.bypass:
            params = self.handoffs.announce(req.ns, min(req.offered, request.num_prompt_tokens // self.spec.block_size))
        return self.core.request_finished(request.request_id), params

    def stats(self) -> dict[str, Any]:
        return self.core.stats.as_dict()

    def close(self) -> None:
        self.pipeline.close()


def _cached_locally(request: Request, manager: Any) -> bool:
    """Whether vLLM's own prefix cache holds the request's first block (``manager``: the
    ``KVCacheManager`` vLLM bound to the connector, None before it does)."""
    hashes = getattr(request, "block_hashes", None)
    if manager is None or not hashes:
        return False
    return manager.block_pool.get_cached_block(hashes[0], [0]) is not None
