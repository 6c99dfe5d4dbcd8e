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
import gc
import json
import logging
import os
import signal
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2

from kvstore.config import Config
from kvstore.dram.slab import Slab, unlink_stale
from kvstore.errors import FailedPrecondition
from kvstore.server.local_server import LocalServer
from kvstore.server.service import SERVICE_NAME, KVStoreServicer, start_grpc
from kvstore.server.watchdog import ShutdownWatchdog
from kvstore.store.below import NoMovers
from kvstore.store.block_store import BlockStore
from kvstore.store.counters import Stats
from kvstore.tiers.movers import Tiering
from kvstore.util.tasks import cancel_and_wait
from kvstore.wire.framing import socket_path

if TYPE_CHECKING:
    from aiohttp import web
    from grpc_health.v1 import health

    from kvstore.cluster.node import ClusterNode

log = logging.getLogger("kvstore.server.sidecar")


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
        self._http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self.cluster: ClusterNode | None = None
        self.phase = ""  # the step stop() is in: what a stuck shutdown's watchdog names
        self._watchdog: ShutdownWatchdog | None = None

    # --- start / stop -----------------------------------------------------------------------

    async def start(self) -> Sidecar:
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
            await self._start_tiering()
            if cfg.cluster.enabled:
                from kvstore.cluster.node import ClusterNode

                self.cluster = await ClusterNode.start(self.store, cfg)
            servicer = KVStoreServicer(self.store)
            self._grpc, self.grpc_port, self._health = await start_grpc(servicer, cfg)
            path = socket_path(cfg.server.local_socket, self.data_dir, self.slab.name)
            if path is not None:
                self._local = LocalServer(servicer, path, cfg.server, self.store.stats)
                await self._local.start()
                servicer.local_socket = str(path)
            from kvstore.server.http import HttpSource, start_http

            source = HttpSource(cfg.server.auth_token, lambda: self.ready, self.store.snapshot, servicer.route_json)
            self._http, self.http_port = await start_http(source, cfg.server.http_address)
            self._tasks.append(asyncio.create_task(self._background(), name="kvstore-background"))
            # The index holds millions of long-lived objects; default GC thresholds rescan them
            # every few requests. Collect young objects rarely (request lists are freed by
            # refcount anyway).
            gc.set_threshold(50_000, 50, 100)
            gc.freeze()
            self.ready = True
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kvstore ready",
            extra={"grpc_port": self.grpc_port, "http_port": self.http_port, "segment": self.slab.name},
        )
        return self

    async def _start_tiering(self) -> None:
        self.store.tiering = await Tiering.start(self.store.space, self.config, self.store.tenants)

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
        self.ready = False
        if self._health is not None:
            await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._local is not None:
            self._step("closing the local socket's connections")
            await self._local.close()
            self._local = None
        if self._grpc is not None:
            self._step(f"draining gRPC calls (grace {self.config.server.shutdown_grace_s} s)")
            await self._grpc.stop(self.config.server.shutdown_grace_s)
            self._grpc = None
        self._step("stopping background tasks")
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._http is not None:
            self._step("stopping the HTTP server")
            await self._http.cleanup()
            self._http = None
        if self.cluster is not None:
            self._step("leaving the cluster")
            await self.cluster.close()
            self.cluster = None
        if self.store is not None:
            for lease_id in list(self.store.index.leases):
                self.store.index.release_lease(lease_id)
            for alloc_id in list(self.store.index.allocations):
                self.store.abort(alloc_id)
            self._step("finishing tier moves and closing the tiers")
            await self.store.tiering.close()
            self.store.tiering = NoMovers()
        if self.slab is not None:
            self._step("unlinking the slab")
            self.slab.close(unlink=True)
            self.slab = None
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / "segment").unlink()
        self._step("stopped")
        self.lock.release()
        self._stopped.set()

    async def __aenter__(self) -> Sidecar:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- background ---------------------------------------------------------------------------

    async def _background(self) -> None:
        interval = self.config.index.reaper_interval_ms / 1000.0
        ticks_per_sample = max(1, int(2.0 / interval))
        tick = 0
        while True:
            await asyncio.sleep(interval)
            try:
                self.store.drain_touches()
                self.store.reap()
                await self.store.seal()
                if tick % ticks_per_sample == 0:
                    self.store.stats.sample()
                tick += 1
            except Exception:
                log.exception("background pass failed")

    # --- serve until signalled ---------------------------------------------------------------

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with self:
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
            await stop.wait()
            log.info("signal received; draining")
            self._step("signalled")
            slab = self.slab
            limit = self.config.server.shutdown_grace_s + self.config.server.shutdown_watchdog_s
            self._watchdog = ShutdownWatchdog(loop, limit, lambda: self.phase, lambda: slab.name if slab else "")
            self._watchdog.start()
        self._step("ending the event loop (asyncio.run cancels leftover tasks, joins the default executor)")

    def finished(self) -> None:
        """The process is about to exit (``asyncio.run`` has returned): the watchdog stands down."""
        if self._watchdog is not None:
            self._watchdog.finished()
            self._watchdog = None
