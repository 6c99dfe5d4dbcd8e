"""The class vLLM loads (``kv_connector_module_path: connector.vllm``): a facade that hands each of
vLLM's ``KVConnectorBase_V1`` calls to the side of its role, the scheduler's
(:class:`~connector.vllm.scheduler.SchedulerSide`) or a worker's
(:class:`~connector.vllm.worker.WorkerSide`). What the connector does is described in
:mod:`connector.vllm`."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from connector.vllm.config import EngineKV, Settings, apply_load_failure_policy, cannot_load_mla
from connector.vllm.scheduler import KVStoreConnectorMetadata, SchedulerSide
from connector.vllm.worker import WorkerSide
from kvstore.client import SyncClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        if kv_cache_config is None:
            raise ValueError("kvstore connector: needs kv_cache_config (vLLM >= 0.32)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = Settings.from_extra(tc.kv_connector_extra_config)
        kv = EngineKV.of(vllm_config, kv_cache_config, self.settings, worker=role != KVConnectorRole.SCHEDULER)
        self.spec, self.ns = kv.spec, kv.ns
        load, save = tc.is_kv_consumer, tc.is_kv_producer  # kv_both: both
        if load and kv.rank_free() and not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(cannot_load_mla(str(tc.kv_role)))
        self.client = SyncClient(self.settings.url, token=self.settings.token or os.environ.get("KVSTORE_TOKEN", ""))
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            apply_load_failure_policy(tc, self.settings)
            self._sched = SchedulerSide(self.client, self.settings, kv, load, save)
        else:
            self._worker = WorkerSide(self.client, self.settings, kv, str(tc.kv_role))
        log.info("kvstore connector (%s, %s): %s at %s", role.name, tc.kv_role, self.ns.label, self.settings.url)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing waits for a consumer

    def kvstore_stats(self) -> dict[str, Any]:
        """This role's counters (loads, saves, failures by reason)."""
        if self._sched is not None:
            return self._sched.stats()
        assert self._worker is not None  # one of the two is set by __init__, by role
        return self._worker.stats()

    def _scheduler(self) -> SchedulerSide:
        assert self._sched is not None, "a scheduler-side call on a worker's connector"
        return self._sched

    def _workers(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # --- scheduler side ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request, self._kv_cache_manager)  # bound by vLLM after it is built

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator's form of :meth:`request_finished` (``SupportsHMA``)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # --- worker side ------------------------------------------------------------------------

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._workers().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._workers().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._workers().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv returns with every block in place

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole blocks (all layers) are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self._workers().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._workers().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._workers().load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        elif self._sched is not None:
            self._sched.close()
        log.info("kvstore connector (%s) stats: %s", self._role.name, self.kvstore_stats())
        self.client.close()
