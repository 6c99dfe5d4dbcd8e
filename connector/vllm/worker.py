"""The connector's worker side in vLLM's terms: one core :class:`~connector.roles.WorkerConnector`
per KV-cache group (:class:`~connector.vllm.cache_groups.GroupWorkers`), driven by vLLM's
worker-side hooks.

* **Loads are synchronous**: ``start_load_kv`` returns when the step's blocks are in place; the
  requests whose loads failed have their saves of that step dropped (their KV was computed over
  the bad blocks).
* **Saves run after the forward** (``wait_for_save``), on the worker's transfer thread. A request
  with saves is reported finished (``get_finished``) only once they are done; a preemption, and a
  windowed group before each forward pass, waits for in-flight saves before freed blocks are reused.
* Under tensor or pipeline parallel each rank moves its own shard under its own lease; a rank that
  reads a shard it does not write (MLA's, TP rank > 0) reads under the writer's lease and leaves
  its end to the writer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from connector.roles import WorkerConnector
from connector.roles.block_directory import directory_for
from connector.roles.metadata import LoadSpec
from connector.roles.pipeline import PipelineSlot
from connector.transfer.engines import make_transfer
from connector.transfer.layout import KVSpec
from connector.vllm.cache_groups import GroupWorkers
from connector.vllm.config import EngineKV, Settings
from kvstore.client import SyncClient
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from connector.vllm.scheduler import KVStoreConnectorMetadata


def group_worker(client: SyncClient, settings: Settings, ns: Namespace, spec: KVSpec, cpu: bool,
                 kv_role: str) -> WorkerConnector:
    """The worker-side core of one KV-cache group (its namespace and spec)."""
    transfer = settings.transfer or ("numpy" if cpu else "cupy")
    directory = directory_for(settings.url) if settings.directory else None
    wait_published = settings.wait_published
    if wait_published is None:
        wait_published = kv_role == "kv_producer"  # a prefill instance: decode hosts find its blocks
    return WorkerConnector(client, ns, spec, transfer=make_transfer(transfer),
                           verify_checksums=settings.verify_checksums,
                           load_guard=settings.load_guard, threads=settings.threads,
                           directory=directory, pipeline=PipelineSlot(client),
                           wait_published=wait_published, wait_write_through=settings.wait_write_through)


class WorkerSide:
    """vLLM's worker-side hooks over this rank's group workers."""

    def __init__(self, client: SyncClient, settings: Settings, kv: EngineKV, kv_role: str) -> None:
        from vllm.platforms import current_platform

        self.workers = GroupWorkers([  # one per KV-cache group: its layers, its namespace (this rank's shard)
            group_worker(client, settings, kv.shards[kv.first + i], g.spec, current_platform.is_cpu(), kv_role)
            for i, g in enumerate(kv.groups)], kv.groups, kv.first)
        self.counts_bypasses = kv.first == 0  # every rank sees the step's bypasses: one counts them
        self.writer = kv.writer
        self._failed_reqs: set[str] = set()  # loads that failed in this step
        self._had_saves: set[str] = set()  # requests handed saves (the scheduler delays their free)
        self._pending: set[str] = set()  # requests with saves possibly in flight
        self._finished: set[str] = set()  # finished requests waiting for their saves

    def register(self, kv_caches: dict[str, Any]) -> None:
        self.workers.register(kv_caches)

    def handle_preemptions(self, meta: Any) -> None:
        if getattr(meta, "preempted", None) and self._pending:
            self.workers.wait_for_saves()  # freed blocks are reused in this step
            self._pending.clear()

    def start_load_kv(self, meta: KVStoreConnectorMetadata) -> None:
        if self.counts_bypasses:
            self.workers.workers[0].bypassed(meta.bypassed)
        if self.workers.before_forward():  # a windowed group's blocks may be reused from this step on
            self._pending.clear()
        if meta.core.loads:  # synchronous: the forward pass that follows reads these blocks
            self._failed_reqs = self.workers.load_now(meta.core.loads, self._own)

    def _own(self, load: LoadSpec) -> LoadSpec:
        """This rank's load: under its own lease, which it ends; a rank that reads a shard it does
        not write (MLA's, the writer's lease) reads under that lease and leaves it to the writer
        (the sidecar hears of the hit by a Lookup instead)."""
        lease = load.lease
        if self.writer or lease is None or not lease.id:
            return load
        return replace(load, lease=replace(lease, id=""))

    def wait_for_save(self, meta: KVStoreConnectorMetadata) -> None:
        saves = meta.core.saves
        self._had_saves.update(s.req_id for s in saves)
        failed, self._failed_reqs = self._failed_reqs, set()
        self._pending |= self.workers.save(saves, lambda s: s.req_id not in failed and self.writer)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._pending -= self.workers.get_finished(finished_req_ids)
        self._finished |= finished_req_ids & self._had_saves
        done = {r for r in self._finished if r not in self._pending}
        self._finished -= done
        self._had_saves -= done
        return done or None, None

    def load_errors(self) -> set[int]:
        return self.workers.load_errors()

    def stats(self) -> dict[str, Any]:
        return self.workers.stats()

    def close(self) -> None:
        self.workers.close()
