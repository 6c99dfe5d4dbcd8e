"""This sidecar as a node of a cluster: the block store's :class:`~kvstore.store.remote.Remote`,
and the holder's side of a peer fetch.

A facade over three parts, all on the event loop:

- :mod:`kvstore.cluster.membership` -- the heartbeat, the members read from the directory, and
  which records count (a live lease, the current incarnation); the sweep of void records.
- :mod:`kvstore.cluster.publisher` -- the index's change feed written to the directory in
  passes (``flush``), re-published whole when the directory comes back or a new incarnation
  begins; the cluster's ghosts of use counts ride along.
- :mod:`kvstore.cluster.fetcher` -- a lookup continued through the directory: shared-tier blocks
  adopted, other nodes' blocks fetched over the peer data path into slots reserved for them.

The holder's side of a fetch is :meth:`ClusterNode.lend`, served by
:class:`~kvstore.cluster.peer_server.PeerServer`. The node and its parts work on the block store only through
:class:`~kvstore.store.door.StoreDoor` (the store's exchange, :mod:`kvstore.store.exchange`: its
steps and read-only lookups), never the ``BlockStore``; the sidecar wires it in
(``BlockStore.remote``, :mod:`kvstore.server.sidecar`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence

from kvstore.cluster.directory import Directory, Member
from kvstore.cluster.fetcher import Fetcher
from kvstore.cluster.membership import Membership
from kvstore.cluster.peer_server import NOTHING_LENT, Lent, PeerServer
from kvstore.cluster.publisher import PUBLISH_BATCH, Publisher
from kvstore.config import Config
from kvstore.errors import Unavailable
from kvstore.store.books.index import Block, NsEntry
from kvstore.store.door import StoreDoor
from kvstore.store.remote import PeerBlock
from kvstore.util.tasks import TaskHealth, cancel_and_wait, every

log = logging.getLogger(__name__)
HEARTBEAT_TASK, PUBLISH_TASK = "kvstore-cluster-heartbeat", "kvstore-cluster-publish"
SWEEP_TASK = "kvstore-cluster-sweep"
COUNTERS = (  # /stats "cluster": every one shown from the start, 0 until it happens
    "heartbeats",
    "directory_errors",
    "directory_lookups",
    "records_published",
    "records_removed",
    "records_paced",
    "peer_blocks_found",
    "blocks_adopted",
    "blocks_fetched",
    "bytes_fetched",
    "fetch_failures",
    "fetch_misses",
    "checksum_failures",
    "blocks_lent",
    "ghosts_written",
    "ghosts_resumed",
    "bad_addresses",
    "unheld_dropped",
    "records_rejected",
    "members_rejected",
    "members_unreadable",
    "members_forgotten",
    "directory_key_errors",
    "sweep_keys",
    "sweep_forgotten",
    "sweep_walks",
    "sweep_forged_forgotten",
    "directory_keys_oversized",
)
SHORT_TOKEN = 16  # characters: a token shorter than this is warned of at start (a hello lets it be guessed offline)


class ClusterNode:
    def __init__(
        self, store: StoreDoor, config: Config, directory: Directory, node: str, health: TaskHealth | None = None
    ) -> None:
        self.store = store
        self.health = health or TaskHealth(store.stats.errors)  # the background loops' errors
        self.cfg = config.cluster
        self.directory = directory
        self.node = node
        self.stats = store.stats.cluster
        for name in COUNTERS:
            self.stats[name] += 0
        self.membership = Membership(directory, self.cfg, node, store.stats, self._republish_all)
        self.publisher = Publisher(store, self.membership)
        self.fetcher = Fetcher(store, self.membership, self.publisher)
        self.server = PeerServer(
            self,
            directory.sealer,
            node,
            lambda: self.membership.incarnation,
            lambda: self.membership.address,
            send_timeout_s=2 * self.cfg.fetch_timeout_s,
            send_stall_s=self.cfg.send_stall_s,
            request_timeout_s=self.cfg.fetch_timeout_s,
            latency=store.stats.latency,
            encrypt=self.cfg.peer_encryption,
        )
        self.max_blocks = config.server.max_batch_blocks
        self._tasks: list[asyncio.Task[None]] = []

    # --- life cycle -------------------------------------------------------------------------

    @classmethod
    async def start(cls, store: StoreDoor, config: Config, health: TaskHealth | None = None) -> ClusterNode:
        """Join the cluster: serve peers, publish what ``store`` (the store's door) holds, beat. The caller wires the
        node into the store (``BlockStore.remote``) once this returns."""
        node_id = config.cluster.node_id or socket.gethostname()
        if len(config.cluster.token) < SHORT_TOKEN:
            log.warning(
                "cluster.token is %d characters: anyone who reaches a node's peer port can test guesses "
                "of it offline from one hello; use %d or more random characters",
                len(config.cluster.token),
                SHORT_TOKEN,
            )
        self = cls(store, config, Directory.from_config(config.cluster, node_id), node_id, health)
        port = await self.server.start(config.cluster.peer_address)
        self.membership.address = config.cluster.advertise_address or _advertised(config.cluster.peer_address, port)
        self.publisher.start()
        try:
            await self.membership.heartbeat()
        except Exception as exc:  # noqa: BLE001  (logged there; the loop below tries again, with back-off)
            self.health.failed(HEARTBEAT_TASK, exc)
        beat_s, publish_s = self.cfg.heartbeat_ms / 1000.0, self.cfg.publish_interval_ms / 1000.0
        loops = [(HEARTBEAT_TASK, beat_s, self.membership.heartbeat), (PUBLISH_TASK, publish_s, self.flush)]
        if self.cfg.sweep_keys_per_s:
            loops.append((SWEEP_TASK, beat_s, self.membership.sweep))
        for name, interval, step in loops:
            task = asyncio.create_task(every(name, interval, step, self.health, stop=self._stopping), name=name)
            task.add_done_callback(self.health.ended)
            self._tasks.append(task)
        log.info(
            "cluster node %s (incarnation %d) serving peers at %s; directory %s",
            node_id,
            self.incarnation,
            self.address,
            "up" if self.active else "DOWN",
        )
        return self

    async def close(self) -> None:
        """Leave the cluster: stop offering this node's blocks, then stop serving them. (The
        caller has unwired it from the store first.)"""
        # Cancelled, and told to end: a cancellation can be lost. On Python 3.11 asyncio.wait_for,
        # which redis-py's asyncio client runs every socket write under, returns the write's result
        # instead of raising CancelledError when the cancel lands in the loop pass in which the
        # write finished (CPython gh-86296, fixed in 3.12); the heartbeat or publisher that lost
        # it went on to its next turn, and this await of it never returned (a sidecar's stop hung).
        self.membership.closing = True
        await cancel_and_wait(self._tasks)
        await self.fetcher.close()
        with contextlib.suppress(Unavailable, TimeoutError):
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                await self.directory.leave()
            # then its records, within a few deadlines (what is left is void: its member entry is gone)
            held = [(b.ns.root, b.key) for b in self.store.held()]
            async with asyncio.timeout(4 * self.cfg.directory_timeout_s):
                for i in range(0, len(held), PUBLISH_BATCH):
                    await self.directory.publish([], held[i : i + PUBLISH_BATCH])
        await self.server.close()
        self.fetcher.close_peers()
        self.publisher.stop("the node stopped")
        await self.directory.close()

    @property
    def active(self) -> bool:
        return self.membership.up

    @property
    def address(self) -> str:
        """Where peers reach this node's data path (its member entry's address)."""
        return self.membership.address

    @address.setter
    def address(self, address: str) -> None:
        self.membership.address = address

    @property
    def incarnation(self) -> int:
        return self.membership.incarnation

    def _stopping(self) -> bool:
        return self.membership.closing

    def _republish_all(self) -> None:
        self.publisher.republish_all()

    def live_members(self) -> list[Member]:
        return self.membership.live_members()

    # --- the store's Remote -----------------------------------------------------------------

    async def find(
        self, ns: NsEntry, keys: Sequence[bytes], parent: bytes = b"", depth: int = 1
    ) -> tuple[int, list[PeerBlock]]:
        return await self.fetcher.find(ns, keys, parent, depth)

    async def fetch(self, ns: NsEntry, keys: Sequence[bytes], parent: bytes, depth: int) -> int:
        return await self.fetcher.fetch(ns, keys, parent, depth)

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        return await self.fetcher.prefixes(ns, keys)

    def published(self, blocks: Sequence[Block]) -> asyncio.Future[None] | None:
        return self.publisher.published(blocks)

    async def flush(self) -> None:
        """A publisher's pass now (:meth:`Publisher.flush`)."""
        await self.publisher.flush()

    # --- the holder's side ------------------------------------------------------------------

    async def lend(self, root: bytes, keys: Sequence[bytes]) -> Lent:
        """The leading run of ``keys`` this node holds, brought into DRAM and leased while sent."""
        store = self.store
        ns = store.namespace(root)  # raw root bytes off the wire
        if ns is None:
            return NOTHING_LENT
        run = store.leading_run(ns, keys)
        if len(run) < len(keys):  # asked for what it does not hold: its record goes
            self.publisher.unheld(root, keys[len(run)])
        loan = await store.lend(run, self.cfg.fetch_timeout_s * 2)
        if loan is None:
            return NOTHING_LENT
        self.stats["blocks_lent"] += len(loan.blocks)
        return Lent(loan.blocks, loan.release, loan.left_s, loan.retained)


def _advertised(peer_address: str, port: int) -> str:
    host = peer_address.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
