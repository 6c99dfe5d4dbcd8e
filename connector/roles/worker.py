"""Worker side: executes each step's :class:`ConnectorMetadata` against the engine's KV cache.

Loads and saves run on thread pools (copies release the GIL); loads have their own thread, so a
load (on a request's time-to-first-token path) never queues behind earlier saves. The engine either
waits (:meth:`WorkerConnector.wait_for_loads`) or polls (:meth:`WorkerConnector.get_finished`) --
vLLM's synchronous and asynchronous load modes. Blocks
that could not be loaded come back from :meth:`WorkerConnector.get_block_ids_with_load_errors`;
the engine recomputes exactly those.

What the sidecar is told after a load (the lease's release, or the hit of an unleased read) waits
for the end of the *next* step (:meth:`WorkerConnector.get_finished`), or of the step in which
the request finished: a round trip during the loading step's forward pass would compete with it
for the GIL and the host's cores, on the request's time to its first token. Then a background
thread sends all of that step's calls at once on a :class:`~kvstore.client.Pipeline`
and reads their answers (or, where the sidecar's socket cannot be opened, makes one blocking
call each).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from connector.cost import CostModel
from connector.roles.block_directory import BlockDirectory
from connector.roles.client import ConnectorClient
from connector.roles.guard import checked, in_force
from connector.roles.metadata import (
    ConnectorMetadata,
    LoadResult,
    LoadSpec,
    Role,
    SaveResult,
    SaveSpec,
)
from connector.roles.ops import classify, load_blocks, save_blocks
from connector.roles.pipeline import PipelineSlot
from connector.roles.report import DecisionReporter, bypass_record, decision_record
from connector.roles.stats import ConnectorStats
from connector.transfer.engines import NumpyTransfer, PagedKV, Transfer, bind_caches, register_slab
from connector.transfer.layout import KVSpec
from kvstore.errors import FailedPrecondition
from kvstore.keys import Namespace

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0  # decision records go to the sidecar's /stats at most this often


# (request, "release" or "touch", lease id or (namespace, keys)): for the sidecar after a load
_Tell = tuple[str, str, Any]


class WorkerConnector:
    role = Role.WORKER

    def __init__(
        self,
        client: ConnectorClient,
        ns: Namespace,
        spec: KVSpec,
        *,
        transfer: Transfer | None = None,
        cost: CostModel | None = None,
        verify_checksums: bool = True,
        load_guard: str = "read_only",
        threads: int = 1,
        directory: BlockDirectory | None = None,
        pipeline: PipelineSlot | None = None,
        wait_published: bool = False,
        wait_write_through: bool = False,
    ) -> None:
        """``directory``: remember where saved blocks lie (:mod:`connector.roles.block_directory`), and
        tell the sidecar about loads that read from it without a lease. ``pipeline``: what the
        sidecar is told after loads goes over it, unanswered until a later step.
        ``wait_published`` / ``wait_write_through``: a save is done (:meth:`get_finished`) only
        once the cluster directory lists its blocks / the write-through tiers hold them
        (:func:`~connector.roles.ops.save_blocks`). ``verify_checksums``: no corrupted block is
        loaded, under ``load_guard`` (:mod:`connector.roles.guard`: ``"read_only"``, a slab this
        process maps read-only is trusted and loads from any other hash; ``"hash"``, every load
        hashes)."""
        self.client, self.ns, self.spec = client, ns, spec
        self.directory = directory
        self.pipeline = pipeline
        self.transfer = transfer or NumpyTransfer()
        self.cost = cost
        self.verify = verify_checksums
        self.guard = checked(load_guard)
        self.wait_published, self.wait_write_through = wait_published, wait_write_through
        self.stats = ConnectorStats()
        self._kv: PagedKV | None = None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstore-connector")
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-connector-load")
        self._lock = threading.Lock()
        self._loads: dict[str, Future[LoadResult]] = {}
        self._saves: dict[str, list[Future[SaveResult]]] = {}
        self._load_errors: set[int] = set()
        self._tell: list[_Tell] = []  # after this step's loads
        self._tell_due: list[_Tell] = []  # after the last step's: sent at this step's end
        self.reporter = DecisionReporter(client)
        self._last_flush = time.monotonic()

    def register_kv_caches(self, caches: Sequence[Any]) -> None:
        """Bind the engine's per-layer caches (zero-copy views) once, at start-up, and register the
        sidecar's slab with the transfer engine (pinned for DMA on a GPU)."""
        self._kv = bind_caches(self.spec, caches)
        segment = register_slab(self.transfer, self.client)
        if self.verify and segment is not None:
            log.info("loads verified under the %r guard (load_guard %r)", in_force(self.guard, segment), self.guard)

    @property
    def kv(self) -> PagedKV:
        if self._kv is None:
            raise FailedPrecondition("register_kv_caches() must be called before transfers")
        return self._kv

    # --- per step -------------------------------------------------------------------------

    def start(self, meta: ConnectorMetadata) -> None:
        """Submit the step's loads, then its saves."""
        kv = self.kv
        with self._lock:
            for load in meta.loads:
                self._loads[load.req_id] = self._load_pool.submit(self._load, kv, load)
            for save in meta.saves:
                self._saves.setdefault(save.req_id, []).append(self._pool.submit(self._save, kv, save))
            if meta.loads:
                self._flush_due()

    def _flush_due(self) -> None:
        """Send the buffered decision records on the transfer thread (after the transfers submitted
        so far, off their path), at most every :data:`REPORT_INTERVAL_S`. Called under the lock."""
        if time.monotonic() - self._last_flush > REPORT_INTERVAL_S:
            self._last_flush = time.monotonic()
            self._pool.submit(self.reporter.flush)

    def bypassed(self, reasons: Sequence[tuple[str, int]]) -> None:
        """Requests the engine served without the cache: ``(reason, prompt blocks)`` each (a reason
        of :data:`kvstore.stats.counters.BYPASS_REASONS`), counted here (``bypassed_<reason>``) and
        reported to the sidecar, whose ``/stats`` and ``/metrics`` count them by reason."""
        for reason, blocks in reasons:
            self.stats.add(**{f"bypassed_{reason}": 1})
            self.reporter.add(bypass_record(self.ns.label, reason, blocks))
        if reasons:
            with self._lock:
                self._flush_due()

    def _load(self, kv: PagedKV, spec: LoadSpec) -> LoadResult:
        try:
            r = load_blocks(self.client, spec.ns or self.ns, kv, self.transfer, spec, verify=self.verify,
                            guard=self.guard)
        finally:
            if spec.lease is not None:
                lease = spec.lease
                tell = ((spec.req_id, "release", lease.id) if lease.id
                        else (spec.req_id, "touch", (spec.ns or self.ns, list(spec.keys))))
                with self._lock:  # the scheduler's lease is ended, an unleased read reported, a step later
                    self._tell.append(tell)
        self.stats.record_load(r)
        if self.cost is not None and r.loaded and spec.tiers:
            per_tier: dict[str, int] = {}
            for t in spec.tiers[: r.loaded]:
                per_tier[t] = per_tier.get(t, 0) + kv.spec.block_bytes
            self.cost.observe_transfer(per_tier, r.seconds)
        decision = self.cost.decision(spec.decision_id) if self.cost and spec.decision_id is not None else None
        self.reporter.add(
            decision_record(
                (spec.ns or self.ns).label, decision,
                prompt_blocks=(decision.prompt_tokens // spec.block_size if decision
                               else spec.first_block + len(spec.keys)),
                cached_blocks=decision.available if decision else spec.first_block + len(spec.keys),
                tiers=spec.tiers, load=r,
            )
        )
        with self._lock:
            self._load_errors.update(r.failed_block_ids)
        return r

    def _release(self, lease_id: str) -> None:
        release = getattr(self.client, "release", None)
        if release is None:
            return
        try:
            release(lease_id)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            self._released(lease_id, exc)

    def _released(self, lease_id: str, answer: Any) -> None:
        if isinstance(answer, Exception):  # the lease expires on its own
            self.stats.failure("release", classify(answer).value)
            log.info("release lease %s: %s", lease_id, answer)

    def _touch(self, ns: Namespace, keys: list[bytes]) -> None:
        """A Lookup of blocks read without a lease: the sidecar's policy counts the use; blocks
        it no longer has leave the directory."""
        try:
            answer: Any = self.client.lookup(ns, keys)
        except Exception as exc:  # noqa: BLE001 - recency only
            answer = exc
        self._touched(keys, answer)

    def _touched(self, keys: list[bytes], answer: Any) -> None:
        """``answer``: the Lookup's result (``matched``), or the error it ended with."""
        if isinstance(answer, Exception):  # recency only
            self.stats.failure("touch", classify(answer).value)
            return
        if answer.matched < len(keys) and self.directory is not None:
            self.directory.forget(keys[answer.matched :])

    def _save(self, kv: PagedKV, spec: SaveSpec) -> SaveResult:
        r = save_blocks(self.client, spec.ns or self.ns, kv, self.transfer, spec, self.directory,
                        wait_published=self.wait_published, wait_write_through=self.wait_write_through)
        self.stats.record_save(r)
        return r

    def load_now(self, loads: Sequence[LoadSpec]) -> list[LoadResult]:
        """Run ``loads`` in the calling thread (an engine that waits for them anyway saves the
        thread hand-offs); results are not reported again by :meth:`get_finished`."""
        kv = self.kv
        return [self._load(kv, spec) for spec in loads]

    def wait_for_loads(self) -> list[LoadResult]:
        """Block until every submitted load is done and hand over their results (synchronous
        load mode; these requests are then not reported again by :meth:`get_finished`)."""
        with self._lock:
            futs, self._loads = list(self._loads.values()), {}
        return [f.result() for f in futs]

    def wait_for_saves(self) -> list[SaveResult]:
        """Block until every submitted save is done and hand over their results."""
        with self._lock:
            futs = [f for fs in self._saves.values() for f in fs]
            self._saves = {}
        return [f.result() for f in futs]

    def get_finished(self, finished: Collection[str] = ()) -> tuple[set[str], set[str]]:
        """Requests whose saves (first) and loads (second) completed since the last call.
        ``finished``: requests the engine finished this step (their leases end now)."""
        with self._lock:
            saved = {r for r, fs in self._saves.items() if all(f.done() for f in fs)}
            loaded = {r for r, f in self._loads.items() if f.done()}
            for r in saved:
                del self._saves[r]
            for r in loaded:
                del self._loads[r]
            due = self._tell_due + [t for t in self._tell if t[0] in finished]
            self._tell_due, self._tell = [t for t in self._tell if t[0] not in finished], []
        self._send(due)
        return saved, loaded

    def _send(self, tell: list[_Tell]) -> None:
        if tell:
            self._pool.submit(self._tell_sidecar, tell)

    def _tell_sidecar(self, tell: list[_Tell]) -> None:
        """On the background thread: all of a step's calls at once on the pipeline, then their
        answers (one round trip, one wake-up of the sidecar); without one, a blocking call each."""
        pipe = self.pipeline.get() if self.pipeline is not None else None
        for _, kind, arg in tell:
            if kind == "release":
                if pipe is None:
                    self._release(arg)
                else:
                    pipe.release(arg, functools.partial(self._released, arg))
            elif pipe is None:
                self._touch(*arg)
            else:
                ns, keys = arg
                pipe.lookup(ns, keys, functools.partial(self._touched, keys))
        if pipe is not None:
            pipe.drain()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine blocks whose loads failed since the last call; recompute their tokens."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        self._load_pool.shutdown(wait=True)
        with self._lock:
            tell, self._tell_due, self._tell = self._tell_due + self._tell, [], []
        self._send(tell)
        self._pool.shutdown(wait=True)
        if self.pipeline is not None:
            self.pipeline.close()  # after its answers came
        self.reporter.flush()
