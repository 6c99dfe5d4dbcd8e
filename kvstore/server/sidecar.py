"""The sidecar's life cycle: data-directory lock, slab, store, gRPC, HTTP and background work.

    async with Sidecar(config) as sc:      # start; sc.grpc_port / sc.http_port are bound ports
        ...
                                           # stop: drain, release leases, close tiers, unlink slab

`kvstore serve` runs exactly this until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2

from kvstore.config import Config
from kvstore.dram.slab import Slab, unlink_stale
from kvstore.errors import FailedPrecondition
from kvstore.movers.tiering import Tiering
from kvstore.server.local_server import LocalServer
from kvstore.server.service import SERVICE_NAME, KVStoreServicer, start_grpc
from kvstore.server.watchdog import ShutdownWatchdog
from kvstore.stats.counters import Stats
from kvstore.store.block_store import BlockStore
from kvstore.store.books.below import NoMovers
from kvstore.store.remote import NoRemote
from kvstore.util.logs import throttle_loop_errors
from kvstore.util.tasks import TaskHealth, cancel_and_wait, every
from kvstore.util.tuning import quiet_gc, restore_gc
from kvstore.wire.framing import socket_path

if TYPE_CHECKING:
    from grpc_health.v1 import health

    from kvstore.cluster.node import ClusterNode
    from kvstore.server.http import HttpServer

log = logging.getLogger(__name__)
BACKGROUND_TASK = "kvstore-background"
SAMPLE_EVERY_S = 2.0  # the hit-rate history's step


class DataDirLock:
    """One sidecar per data directory: an flock held for the process's life."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "kvstore.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self.path.read_text().strip() or "another process"
            raise FailedPrecondition(
                f"data_dir: {self.path.parent} is in use by {holder}; stop it or choose another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Sidecar:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.lock = DataDirLock(self.data_dir)
        self.slab: Slab | None = None
        self.store: BlockStore = None  # type: ignore[assignment]  # None until start(); stop() checks
        self.grpc_port = 0
        self.http_port = 0
        self.ready = False
        self._grpc: grpc.aio.Server | None = None
        self._local: LocalServer | None = None
        self._health: health.aio.HealthServicer | None = None
        self._http: HttpServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._quiet = False  # whether this sidecar's start tuned the collector (restore_gc at stop)
        self.health = TaskHealth()  # the background loops' errors (/readyz, /stats "errors"); start() wires its counter
        self._stopped = asyncio.Event()
        self._sampled = -SAMPLE_EVERY_S
        self.cluster: ClusterNode | None = None
        self.phase = ""  # the step stop() is in: what a stuck shutdown's watchdog names
        self._watchdog: ShutdownWatchdog | None = None

    # --- start / stop -----------------------------------------------------------------------

    async def start(self, recovered: bool = True) -> Sidecar:
        """Serve. ``recovered`` False: return as soon as it serves, the lower tiers' blocks still
        loading into the index in the background (``kvstore serve``: /stats ``recovery``); True
        (in-process callers): once they are all in."""
        cfg = self.config
        self.lock.acquire()
        try:
            self._cleanup_stale_segment()
            d = cfg.dram
            self.slab = Slab(
                d.capacity_bytes, d.page_bytes, d.min_slot_bytes, prefault=d.prefault, name_prefix=d.segment_prefix,
            )
            (self.data_dir / "segment").write_text(self.slab.name)
            self.store = BlockStore(cfg, self.slab, Stats())
            self.health = TaskHealth(self.store.stats.errors)
            await self._start_tiering()
            if cfg.cluster.enabled:
                await self._start_cluster()
            servicer = KVStoreServicer(self.store)
            self._grpc, self.grpc_port, self._health = await start_grpc(servicer, cfg)
            path = socket_path(cfg.server.local_socket, self.data_dir, self.slab.name)
            if path is not None:
                self._local = LocalServer(servicer, path, cfg.server, self.store.stats)
                await self._local.start()
                servicer.local_socket = str(path)
            from kvstore.server.http import HttpServer, HttpSource

            source = HttpSource(
                cfg.server.auth_token, lambda: self.ready, self.store.snapshot, servicer.route_json,
                failing=lambda: dict(self.health.failing), body_timeout_s=cfg.server.http_idle_timeout_s,
            )
            self._http = HttpServer(source, cfg.server)
            self.http_port = await self._http.start()
            interval = cfg.index.reaper_interval_ms / 1000.0
            task = asyncio.create_task(every(BACKGROUND_TASK, interval, self._background, self.health),
                                       name=BACKGROUND_TASK)
            task.add_done_callback(self.health.ended)
            self._tasks.append(task)
            quiet_gc()  # (kvstore.util.tuning: undone when the last sidecar of the process stops)
            self._quiet = True
            self.ready = True  # serving: the lower tiers' blocks load from now on (/stats recovery)
            if isinstance(self.store.tiering, Tiering):
                self.store.tiering.recovery.start()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kvstore ready",
            extra={"grpc_port": self.grpc_port, "http_port": self.http_port, "segment": self.slab.name},
        )
        if recovered:
            await self.recovered()
        return self

    async def _start_tiering(self) -> None:
        self.store.tiering = await Tiering.start(
            self.store.space, self.config, self.store.tenants, self.health, recover=False
        )

    async def recovered(self) -> Mapping[str, object]:
        """The restart's recovery's end (at once when there is none): what it entered."""
        tiering = self.store.tiering
        if isinstance(tiering, Tiering):
            await tiering.recovery.done.wait()
        return tiering.recovery_stats

    def _cleanup_stale_segment(self) -> None:
        marker = self.data_dir / "segment"
        if marker.exists():
            name = marker.read_text().strip()
            if name and unlink_stale(name):
                log.warning("removed shared memory %s left by a sidecar that did not shut down cleanly", name)
            marker.unlink()

    def _step(self, phase: str) -> None:
        log.debug("shutdown: %s", phase)
        self.phase = phase

    async def stop(self) -> None:
        """Stop serving, then release everything; each step runs whatever became of the one before
        (a step that fails is logged and the stop goes on: the cluster is left, leases released,
        tiers closed and the slab unlinked however a background task or another step ended)."""
        self.ready = False
        grace = self.config.server.shutdown_grace_s
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("marking the health check NOT_SERVING", self._not_serving),
            ("closing the local socket's connections", self._close_local),
            (f"draining gRPC calls (grace {grace} s)", self._close_grpc),
            ("stopping background tasks", self._close_tasks),
            ("stopping the HTTP server", self._close_http),
            ("leaving the cluster", self._close_cluster),
            ("releasing leases and allocations", self._release),
            (f"writing blocks only DRAM holds to the SSD (drain_s {self.config.server.drain_s} s)", self._drain),
            ("finishing tier moves and closing the tiers", self._close_tiers),
            ("unlinking the slab", self._unlink_slab),
        ]
        for phase, step in steps:
            self._step(phase)
            try:
                await step()
            except Exception:
                log.exception("shutdown: %s failed; the stop goes on", phase)
        if self._quiet:
            self._quiet = False
            restore_gc()
        self._step("stopped")
        self.lock.release()
        self._stopped.set()

    async def _not_serving(self) -> None:
        if self._health is not None:
            await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _close_local(self) -> None:
        local, self._local = self._local, None
        if local is not None:
            await local.close()

    async def _close_grpc(self) -> None:
        server, self._grpc = self._grpc, None
        if server is not None:
            await server.stop(self.config.server.shutdown_grace_s)

    async def _close_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    async def _close_http(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    async def _start_cluster(self) -> None:
        """Join the cluster: the node reads the store (its change feed, its blocks) and is then
        wired in as the store's :class:`~kvstore.store.remote.Remote` (lookups continue through it)."""
        from kvstore.cluster.node import ClusterNode

        assert self.store is not None
        self.cluster = await ClusterNode.start(self.store.exchange, self.config, self.health)
        self.store.remote = self.cluster

    async def _close_cluster(self) -> None:
        """Leave the cluster: the store stops asking it first, then the node stops offering and
        serving this node's blocks."""
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            if self.store is not None:
                self.store.remote = NoRemote()
            await cluster.close()

    async def _release(self) -> None:
        if self.store is not None:
            for lease_id in list(self.store.index.leases):
                self.store.index.release_lease(lease_id)
            for alloc_id in list(self.store.index.allocations):
                self.store.abort(alloc_id)

    async def _drain(self) -> None:
        """A planned stop keeps the hot set: what only DRAM holds, written to the SSD (a restart
        finds it there), for at most ``server.drain_s``; the counts logged."""
        tiering = self.store.tiering if self.store is not None else None
        seconds = self.config.server.drain_s
        if not isinstance(tiering, Tiering) or seconds <= 0:
            return
        done = await tiering.drain(seconds)
        if done is None:
            log.warning("drain: no SSD tier up; the blocks only DRAM holds are not kept")
            return
        log.info("drain: %d of %d blocks only DRAM held written to the SSD in %.1f s, %d left",
                 done.written, done.blocks, done.seconds, done.left,
                 extra={"drain_blocks": done.blocks, "drain_written": done.written, "drain_left": done.left,
                        "drain_s": round(done.seconds, 3)})

    async def _close_tiers(self) -> None:
        if self.store is not None:
            try:
                await self.store.tiering.close()
            finally:
                self.store.tiering = NoMovers()

    async def _unlink_slab(self) -> None:
        slab, self.slab = self.slab, None
        if slab is not None:
            slab.close(unlink=True)
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / "segment").unlink()

    async def __aenter__(self) -> Sidecar:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- background ---------------------------------------------------------------------------

    async def _background(self) -> None:
        """One pass of the store's upkeep (every ``index.reaper_interval_ms``)."""
        self.store.drain_touches()
        self.store.reap()
        await self.store.seal()
        if time.monotonic() - self._sampled >= SAMPLE_EVERY_S:
            self._sampled = time.monotonic()
            self.store.stats.sample()

    # --- serve until signalled ---------------------------------------------------------------

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        throttle_loop_errors(loop)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start(recovered=False)  # (ready = serving: the recovery goes on behind it)
        try:
            host = self.config.server.grpc_address.rpartition(":")[0]
            grpc_address = self.config.server.grpc_address if host.startswith("unix") else f"{host}:{self.grpc_port}"
            http_host = self.config.server.http_address.rpartition(":")[0]
            print(
                json.dumps(
                    {
                        "event": "ready",
                        "grpc": grpc_address,
                        "http": f"{http_host}:{self.http_port}",
                        "segment": self.slab.name if self.slab else "",
                        "data_dir": str(self.data_dir),
                        **({"peer": self.cluster.address, "node": self.cluster.node} if self.cluster else {}),
                    }
                ),
                flush=True,
            )
            said = asyncio.create_task(self._say_recovered(), name="kvstore-recovered-line")
            await stop.wait()
            said.cancel()
            log.info("signal received; draining")
            self._step("signalled")
            slab = self.slab
            limit = self.config.server.stop_bound_s()
            self._watchdog = ShutdownWatchdog(loop, limit, lambda: self.phase, lambda: slab.name if slab else "")
            self._watchdog.start()
        finally:
            await self.stop()
        self._step("ending the event loop (asyncio.run cancels leftover tasks, joins the default executor)")

    async def _say_recovered(self) -> None:
        """Ready serves while the lower tiers' blocks load; a second line says when they are all in."""
        doc = await self.recovered()
        print(json.dumps({"event": "recovered", "blocks": doc["blocks"], "batches": doc["batches"]}), flush=True)

    def finished(self) -> None:
        """The process is about to exit (``asyncio.run`` has returned): the watchdog stands down."""
        if self._watchdog is not None:
            self._watchdog.finished()
            self._watchdog = None
