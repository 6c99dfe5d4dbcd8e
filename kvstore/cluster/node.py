"""This sidecar as a node of a cluster: the block store's :class:`~kvstore.store.remote.Remote`.

Three jobs, all on the event loop:

- **Publish.** The index marks every block whose visibility or placement changes
  (``Index.changed``); every ``publish_interval_ms`` the publisher writes those records to the
  directory in one pipeline (HSET for a block this node holds, HDEL for one it no longer does).
  A failed write keeps the changes for the next pass; when the directory comes back, the node
  re-publishes everything it holds. The same pipeline carries the cluster's ghosts (the ``g:``
  keys of :mod:`kvstore.cluster.directory`): a block this node lets go leaves behind the use count
  its policies have of it (``DramSpace.uses``), for about as long as this node's own ghost would
  keep it (:class:`~kvstore.policy.ghost.GhostSpan`), and a block new here (committed, or fetched
  from a peer) takes up the count another node left, in the policies of the spaces that hold it
  (``DramSpace.resume``).
- **Membership.** A heartbeat every ``heartbeat_ms`` renews this node's lease and reads every
  member's (:data:`kvstore.cluster.directory.HEARTBEAT`). A record counts only while its node's
  lease runs in the directory's clock (estimated here from the last heartbeat) and its incarnation
  is the node's current one. A heartbeat that renews a lease which had run out gives this node a
  new incarnation (others may have deleted the old one's records meanwhile): it re-publishes
  everything it holds under that one.
- **Find and fetch.** A lookup that ends short of the request asks the directory about the rest
  (one script call; one pipeline on a Redis Cluster). A block in a shared tier this node has
  (Redis, S3) joins the local index as placed there (the movers read and verify it as any
  promotion); a block only another node holds is fetched from it over the peer data path
  straight into a local slot, checked against the holder's checksum and the directory's, and
  kept as a replica (``Block.replica``: dropped, not demoted, when DRAM evicts it).

The holder's side of a fetch is :meth:`ClusterNode.lend`, served by
:class:`~kvstore.cluster.peer_server.PeerServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Sequence

from kvstore.cluster.directory import Directory, Ghosts, Member, Oversized, Published, Record
from kvstore.cluster.peer_client import PeerClient
from kvstore.cluster.peer_server import NOTHING_LENT, Lent, PeerServer
from kvstore.cluster.sweep import Sweeper
from kvstore.cluster.unreadable import UnreadableMembers
from kvstore.cluster.waiters import PublishWaiters, Where
from kvstore.config import Config
from kvstore.errors import KVStoreError, Unavailable, shown
from kvstore.keys import BlockKey, NamespaceRoot
from kvstore.policy.ghost import GhostSpan
from kvstore.store.block_store import BlockStore
from kvstore.store.checksum import checksums
from kvstore.store.index import DRAM, REDIS, S3, Block, NsEntry, State, top_label
from kvstore.store.remote import MAX_HOLDERS, PeerBlock
from kvstore.util.logs import Once, Throttled
from kvstore.util.tasks import TaskHealth, cancel_and_wait, every

log = logging.getLogger("kvstore.cluster.node")
SHARED = REDIS | S3
PUBLISH_BATCH = 4096  # directory records in one pipeline
ABSENT_TRACKED = 65536  # nodes missing from the members followed at once (records of forged names)
STALE_MAX = 65536  # void records met and not yet deleted (the publisher's next pass deletes them)
FORGET_MEMBERS_BATCH = 32768  # unreadable members entries deleted at most a heartbeat
HEARTBEAT_TASK, PUBLISH_TASK = "kvstore-cluster-heartbeat", "kvstore-cluster-publish"
SWEEP_TASK = "kvstore-cluster-sweep"
COUNTERS = (  # /stats "cluster": every one shown from the start, 0 until it happens
    "heartbeats", "directory_errors", "directory_lookups", "records_published", "records_removed",
    "peer_blocks_found", "blocks_adopted", "blocks_fetched", "bytes_fetched", "fetch_failures", "fetch_misses",
    "checksum_failures", "blocks_lent", "ghosts_written", "ghosts_resumed", "bad_addresses", "unheld_dropped",
    "records_rejected", "members_rejected", "members_unreadable", "members_forgotten", "directory_key_errors",
    "sweep_keys", "sweep_forgotten", "sweep_walks", "sweep_forged_forgotten", "directory_keys_oversized",
)
# Keys peers asked for that this node does not hold, remembered for the next publish to delete their
# records: at most this many (one pipeline's worth). While the directory is down nothing drains them;
# past this, a request's key is not remembered (another request, or the holder's own next look at
# it, finds the record again).
UNHELD_MAX = PUBLISH_BATCH
SHORT_TOKEN = 16  # characters: a token shorter than this is warned of at start (a hello lets it be guessed offline)


def _rank(tiers: int) -> int:
    """Which holder to read from: its copy in DRAM first, then anywhere else."""
    return 0 if tiers & DRAM else 1


class ClusterNode:
    def __init__(
        self, store: BlockStore, config: Config, directory: Directory, node: str, health: TaskHealth | None = None
    ) -> None:
        self.store = store
        self.health = health or TaskHealth(store.stats.errors)  # the background loops' errors
        self.config = config
        self.cfg = config.cluster
        self.directory = directory
        self.node = node
        self.incarnation = time.time_ns() // 1_000_000  # ms: each start of a node is a later life
        self.address = ""
        self.stats = store.stats.cluster
        self.latency = store.stats.latency  # directory round trips, peer fetches (kvstore/store/latency.py)
        for name in COUNTERS:
            self.stats[name] += 0
        self.key = directory.sealer  # (derived from cluster.token: the hello's proofs, as the records' MACs)
        self.server = PeerServer(
            self, self.key, node, send_timeout_s=2 * self.cfg.fetch_timeout_s, send_stall_s=self.cfg.send_stall_s,
            request_timeout_s=self.cfg.fetch_timeout_s, latency=self.latency,
        )
        self.max_blocks = config.server.max_batch_blocks
        self._members: dict[str, Member] = {}
        self._clock: tuple[int, float] = (0, 0.0)  # (directory ms, local monotonic) at the last heartbeat
        self._up = False
        self._peers: dict[str, PeerClient] = {}
        self._waiters = PublishWaiters()
        self._stale: list[tuple[bytes, bytes, str, Record]] = []
        self._unheld: set[tuple[bytes, bytes]] = set()  # keys peers asked for that this node does not hold
        self._tasks: list[asyncio.Task[None]] = []
        self._fetches: set[asyncio.Task[int]] = set()  # peer fetches in flight (shielded from their Acquire)
        self._closing = False  # the loops end at their next turn (a cancellation can be lost: close)
        self._warn = Throttled(log)
        self._key_errors = Once(log)  # a directory key of another type: told once per key
        self._unreadable = UnreadableMembers()
        self._absent: dict[str, int] = {}  # nodes of records met that the members lack -> since (directory ms)
        per_pass = round(self.cfg.sweep_keys_per_s * self.cfg.heartbeat_ms / 1000)
        self._sweeper = Sweeper(directory, self.sweepable, self.stats, max(1, per_pass))
        self._span = GhostSpan()  # how fast this node lets blocks go: how long its ghosts last

    # --- life cycle -------------------------------------------------------------------------

    @classmethod
    async def start(cls, store: BlockStore, config: Config, health: TaskHealth | None = None) -> ClusterNode:
        node_id = config.cluster.node_id or socket.gethostname()
        if len(config.cluster.token) < SHORT_TOKEN:
            log.warning("cluster.token is %d characters: anyone who reaches a node's peer port can test guesses "
                        "of it offline from one hello; use %d or more random characters",
                        len(config.cluster.token), SHORT_TOKEN)
        self = cls(store, config, Directory.from_config(config.cluster, node_id), node_id, health)
        port = await self.server.start(config.cluster.peer_address)
        self.address = config.cluster.advertise_address or _advertised(config.cluster.peer_address, port)
        store.index.changed = {}
        self._republish_all()
        try:
            await self._heartbeat()
        except Exception as exc:  # noqa: BLE001  (logged there; the loop below tries again, with back-off)
            self.health.failed(HEARTBEAT_TASK, exc)
        beat_s, publish_s = self.cfg.heartbeat_ms / 1000.0, self.cfg.publish_interval_ms / 1000.0
        loops = [(HEARTBEAT_TASK, beat_s, self._heartbeat), (PUBLISH_TASK, publish_s, self.flush)]
        if self.cfg.sweep_keys_per_s:
            loops.append((SWEEP_TASK, beat_s, self._sweep))
        for name, interval, step in loops:
            task = asyncio.create_task(every(name, interval, step, self.health, stop=self._stopping), name=name)
            task.add_done_callback(self.health.ended)
            self._tasks.append(task)
        store.remote = self
        log.info(
            "cluster node %s (incarnation %d) serving peers at %s; directory %s",
            node_id, self.incarnation, self.address, "up" if self._up else "DOWN",
        )
        return self

    async def close(self) -> None:
        """Leave the cluster: stop offering this node's blocks, then stop serving them."""
        from kvstore.store.remote import NoRemote

        self.store.remote = NoRemote()
        # Cancelled, and told to end: a cancellation can be lost. On Python 3.11 asyncio.wait_for,
        # which redis-py's asyncio client runs every socket write under, returns the write's result
        # instead of raising CancelledError when the cancel lands in the loop pass in which the
        # write finished (CPython gh-86296, fixed in 3.12); the heartbeat or publisher that lost
        # it went on to its next turn, and this await of it never returned (a sidecar's stop hung).
        self._closing = True
        await cancel_and_wait(self._tasks)
        # The fetches in flight run shielded from their Acquire (cancelled by now): ended here, or
        # an I/O thread would go on reading into the slots of a stopped store. Their deadline shuts
        # their sockets down and their blocks are freed before this returns.
        await cancel_and_wait(list(self._fetches))
        with contextlib.suppress(Unavailable, TimeoutError):
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                await self.directory.leave()
            # then its records, within a few deadlines (what is left is void: its member entry is gone)
            held = [(ns.root, b.key) for ns in self.store.index.namespaces.values() for b in ns.visible.values()]
            async with asyncio.timeout(4 * self.cfg.directory_timeout_s):
                for i in range(0, len(held), PUBLISH_BATCH):
                    await self.directory.publish([], held[i : i + PUBLISH_BATCH])
        await self.server.close()
        for p in self._peers.values():
            p.close()
        self._waiters.fail_all("the node stopped")
        self.store.index.changed = None
        await self.directory.close()

    @property
    def active(self) -> bool:
        return self._up

    def _stopping(self) -> bool:
        return self._closing

    # --- membership -------------------------------------------------------------------------

    def _now_ms(self) -> float:
        server_ms, local = self._clock
        return server_ms + (time.monotonic() - local) * 1000.0

    def _live(self, node: str, rec: Record, now_ms: float) -> Member | None:
        m = self._members.get(node)
        if m is None or m.incarnation != rec.incarnation or m.expiry_ms <= now_ms:
            return None
        return m

    def _void(self, node: str, rec: Record) -> bool:
        """Whether a record not offered (its node not live in it) can be deleted: its node lives a
        later life, or that life's lease had run out when this node last read the members (a fact
        in the directory's clock, not this node's estimate of it: a lease renewed in time, read
        late here, is not void; one renewed after it ran out is a new incarnation, see
        :data:`~kvstore.cluster.directory.HEARTBEAT`). A node missing from the members may have
        joined (or re-joined a directory that lost its data) since this node's last heartbeat: its
        records are void only once it has been missing for a lease of this node's heartbeats. A
        record of a later life than the members say is news this node has not heard: not void."""
        m = self._members.get(node)
        if m is None:
            # Joined (or re-joined) since this node's last heartbeat, or gone: left (a clean stop
            # deletes its records, but may not finish), forgotten, or an entry nobody can read.
            # Gone once it has been missing for a lease of this node's heartbeats.
            now = self._clock[0]
            if not now:
                return False  # (no members read yet)
            if node not in self._absent and len(self._absent) >= ABSENT_TRACKED:
                del self._absent[next(iter(self._absent))]
            return now - self._absent.setdefault(node, now) >= self.cfg.lease_ms
        if m.incarnation != rec.incarnation:
            return m.incarnation > rec.incarnation
        return m.expiry_ms < self._clock[0]

    def sweepable(self, node: str, rec: Record) -> bool:
        """Whether a record read from the directory can be deleted: not offered, and void."""
        return self._live(node, rec, self._now_ms()) is None and self._void(node, rec)

    async def _sweep(self) -> None:
        """A pass of the walk that deletes void records (:mod:`kvstore.cluster.sweep`)."""
        if not self._up or self._closing:
            return
        try:
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                await self._sweeper.step()
        except (Unavailable, TimeoutError) as exc:
            self.stats["directory_errors"] += 1
            self._warn.warning("cluster directory sweep failed (tried again next pass): %s", self._why(exc))

    async def _heartbeat(self) -> None:
        was_up = self._up
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                sent = time.monotonic()
                beat = await self.directory.heartbeat(self.address, self.incarnation, self.cfg.lease_ms)
            self._round_trip("heartbeat", start, "ok")
            self._clock = (beat.now_ms, (sent + time.monotonic()) / 2)
            self._members = beat.members
            if beat.wrong_type:
                self.stats["directory_key_errors"] += 1
                self._warn.warning("cluster directory: the members key %s was a %s, not a hash (a directory "
                                   "writer's): deleted, written anew by this heartbeat; every node joins it again "
                                   "at its next", self.directory.members_key, beat.wrong_type)
            self._count_rejected()
            for node in [n for n in self._absent if n in beat.members]:
                del self._absent[node]
            self._up = True
            self.stats["heartbeats"] += 1
            await self._unreadable_members(beat.unreadable, beat.now_ms)
            if beat.incarnation != self.incarnation:
                # the lease had run out (a pause, a cut, a late heartbeat, with or without a call
                # failing): a new life, whose records nobody has deleted as void
                log.warning("cluster lease of node %s had run out; incarnation %d now (was %d), re-publishing "
                            "what this node holds", self.node, beat.incarnation, self.incarnation)
                self.incarnation = beat.incarnation
                self._republish_all()
            elif self.stats["heartbeats"] > 1 and (not was_up or beat.created):
                # back after calls failed, or back without a word (restarted, failed over: our own
                # member entry was gone): either way what it held may be gone
                log.info("cluster directory is back%s; re-publishing what this node holds",
                         " and had lost this node's entry" if beat.created else "")
                self._republish_all()
        except (Unavailable, TimeoutError) as exc:
            self._round_trip("heartbeat", start, "error")
            self._up = False
            self.stats["directory_errors"] += 1
            self._warn.warning("cluster directory unreachable (serving local and shared tiers only): %s",
                               self._why(exc))

    def _count_rejected(self) -> None:
        """Show the directory's count of records and member entries that did not check out (written
        without the cluster token, moved, or of an older version: never read), and warn of new ones."""
        records, members = self.directory.rejected_records, self.directory.rejected_members
        if records > self.stats["records_rejected"] or members > self.stats["members_rejected"]:
            self._warn.warning(
                "cluster directory holds entries not sealed with this cluster's token (ignored: %d records, "
                "%d member entries so far): written by a process without the token, by a node with another "
                "token, or by an older version", records, members,
            )
        self.stats["records_rejected"], self.stats["members_rejected"] = records, members

    async def _unreadable_members(self, entries: dict[bytes, bytes], now_ms: int) -> None:
        """Count the members entries this node cannot read (skipped) and delete those that have
        outlasted a lease unchanged (:mod:`kvstore.cluster.unreadable`)."""
        new = self._unreadable.seen(entries, now_ms)
        if new:
            self.stats["members_unreadable"] += new
            self._warn.warning("cluster directory: %d members entries this node cannot read (not UTF-8 or not "
                               "address|incarnation|expiry_ms; skipped, deleted after %d ms), e.g. %r",
                               new, self.cfg.lease_ms, next(iter(entries))[:64])
        due = self._unreadable.due(now_ms, self.cfg.lease_ms, FORGET_MEMBERS_BATCH)
        if due:
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                self.stats["members_forgotten"] += await self.directory.forget_members(due)
            self._unreadable.gone(due)

    def _why(self, exc: BaseException) -> str:
        """What a directory call failed with, for a log line: a deadline (a TimeoutError says
        nothing) named as one."""
        if isinstance(exc, TimeoutError) and not str(exc):
            return f"no answer within cluster.directory_timeout_s ({self.cfg.directory_timeout_s:g} s)"
        return str(exc)

    def _round_trip(self, op: str, start: float, outcome: str) -> None:
        """A directory call begun at ``start`` (``time.perf_counter()``) has ended: its latency."""
        self.latency.histogram("directory", (op, outcome)).since(start)


    def live_members(self) -> list[Member]:
        now = self._now_ms()
        return [m for m in self._members.values() if m.expiry_ms > now]

    # --- publishing ---------------------------------------------------------------------------

    def _republish_all(self) -> None:
        changed = self.store.index.changed
        if changed is None:
            return
        for ns in self.store.index.namespaces.values():
            for b in ns.visible.values():
                changed.setdefault(b, False)

    def published(self, blocks: Sequence[Block]) -> asyncio.Future[None] | None:
        """Answered after the pass that writes ``blocks``' records (:mod:`kvstore.cluster.waiters`):
        an error at once while the directory is away."""
        fut = self._waiters.add(blocks)
        if not self._up:
            self._waiters.fail_all("unreachable since the last call to it")
        return fut

    async def flush(self) -> None:
        """Write the changes gathered since the last pass (and the void records met meanwhile)."""
        index = self.store.index
        changed = index.changed
        if changed is None:
            return
        if not self._up:  # nothing is written while the directory is away: whoever waits is told now
            self._waiters.fail_all("unreachable since the last call to it")
            return
        if not (changed or self._stale or self._waiters or self._unheld):
            return
        index.changed = {}
        waiters = self._waiters.take()
        stale, self._stale = self._stale, []
        puts: list[tuple[bytes, bytes, Record]] = []
        fresh: list[bool] = []  # per put: new on this node (its ghost is read), not a re-publish
        removes: list[tuple[bytes, bytes]] = []
        uses: list[int] = []  # per remove: the use count this node's policies have or remember of it
        unread: list[bool] = []  # per remove: stored and let go since the last pass (its ghost not read)
        count = self.store.space.uses
        seen: set[tuple[bytes, bytes]] = set()
        for b, new in changed.items():  # one record per key, as the index has it now (not per Block object:
            where: tuple[bytes, bytes] = (b.ns.root, b.key)  # a key deleted and written again: two Blocks)
            if where in seen:
                continue
            seen.add(where)
            live = index.namespaces.get(b.ns.root)
            now = live.visible.get(b.key) if live is not None else None
            if now is not None and now.tiers:
                puts.append((b.ns.root, b.key, Record(self.incarnation, now.tiers, now.size, now.checksum or 0,
                                                      *self._retention_of(now))))
                fresh.append(new if now is b else changed.get(now, False))
            else:
                removes.append(where)
                uses.append(count(b))
                unread.append(new)  # (the key's first change of the pass: it was not held before it)
        if removes:  # the blocks let go this pass: the rate the node's ghosts turn over at
            self._span.let_go(len(removes), time.monotonic())
        unheld, self._unheld = self._unheld, set()
        for where in unheld - seen:
            live = index.namespaces.get(NamespaceRoot(where[0]))
            if live is None or where[1] not in live.visible:
                removes.append(where)
                # A record left behind, not a block let go now: its count went to the ghost when
                # it left (rewriting it could replace a newer count another node left since).
                uses.append(0)
                unread.append(False)
        ttl_ms = round(1000 * self._span.ttl_s(self.store.space.ghost_size(), self.cfg.ghost_ttl_s))
        pending = changed
        error = ""
        refused: dict[Where, str] = {}
        op, start = "publish", time.perf_counter()
        try:
            # in pipelines of PUBLISH_BATCH records, each under the deadline: a node re-publishing
            # millions of blocks after an outage gets there in steps instead of timing out whole
            for i in range(0, max(len(puts), len(removes)), PUBLISH_BATCH):
                batch = slice(i, i + PUBLISH_BATCH)
                start = time.perf_counter()
                async with asyncio.timeout(self.cfg.directory_timeout_s):
                    published = await self.directory.publish(
                        puts[batch], removes[batch], fresh=fresh[batch], uses=uses[batch], unread=unread[batch],
                        ttl_ms=ttl_ms,
                    )
                self._round_trip(op, start, "ok")
                refused.update(self._refused(puts[batch], removes[batch], published))
                self.stats["records_published"] += len(puts[batch]) - len(published.refused_puts)
                self.stats["records_removed"] += len(removes[batch]) - len(published.refused_removes)
                self._resume(puts[batch], published.ghosts)
            pending = {}
            if stale:
                op, start = "forget", time.perf_counter()
                async with asyncio.timeout(self.cfg.directory_timeout_s):
                    await self.directory.forget(stale)
                self._round_trip(op, start, "ok")
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            merged = dict(pending)  # re-writing a batch that did land is harmless
            for b, new in (index.changed or {}).items():
                merged[b] = merged.get(b, False) or new
            index.changed = merged
            if not isinstance(exc, (Unavailable, TimeoutError)):
                raise  # (not the directory's: its loop counts and logs it; the changes wait for the next pass)
            self._round_trip(op, start, "error")
            self._up = False
            self.stats["directory_errors"] += 1
            self._warn.warning("cluster directory write failed (kept for the next pass): %s",
                               self._why(exc))
        finally:
            self._waiters.answer(waiters, error, refused)

    def _refused(
        self, puts: Sequence[tuple[bytes, bytes, Record]], removes: Sequence[Where], published: Published
    ) -> dict[Where, str]:
        """The records of a batch the directory refused (their keys of another type): counted,
        told once per key, left unlisted (a block of this node that no other node finds) and not
        written again until everything is (a new incarnation, the directory back)."""
        out = {puts[j][:2]: why for j, why in published.refused_puts.items()}
        out.update({removes[j]: why for j, why in published.refused_removes.items()})
        for (root, key), why in out.items():
            self.stats["directory_key_errors"] += 1
            self._key_errors.warning(key, "cluster directory refused the record of block %s (its key %s): %s; the "
                                     "block stays on this node, unlisted", key.hex()[:16],
                                     self.directory.key(root, key)[:48], why)
        return out

    def _resume(self, puts: Sequence[tuple[bytes, bytes, Record]], ghosts: Ghosts) -> None:
        """Take up the use counts other nodes left of the blocks new here (``ghosts.found``, by
        index into ``puts``): the policies of the spaces that still hold each one resume them."""
        self.stats["ghosts_written"] += ghosts.written
        if ghosts.error:
            self._warn.warning("cluster directory refused a ghost command (the records landed; a Redis "
                               "Cluster's GETDEL needs Redis 6.2 or later): %s", ghosts.error)
        namespaces, space = self.store.index.namespaces, self.store.space
        for i, n in ghosts.found.items():
            root, key, _ = puts[i]
            ns = namespaces.get(NamespaceRoot(root))
            b = ns.visible.get(key) if ns is not None else None
            if b is not None and b.tiers:  # (let go meanwhile: the count goes with it)
                space.resume(b, n)
                self.stats["ghosts_resumed"] += 1

    # --- find ---------------------------------------------------------------------------------

    async def _records(self, root: bytes, keys: Sequence[bytes]) -> list[dict[str, Record]] | None:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                found = await self.directory.find(root, keys)
        except (Unavailable, TimeoutError) as exc:
            self._round_trip("find", start, "error")
            self._up = False
            self.stats["directory_errors"] += 1
            self._warn.warning("cluster directory lookup failed (a miss): %s", self._why(exc))
            return None
        self._round_trip("find", start, "ok")
        self.stats["directory_lookups"] += 1
        self._count_rejected()
        out: list[dict[str, Record]] = []
        for key, holders in zip(keys, found):
            if holders is None:  # that key's error, not the directory's: a miss from that key on
                self.stats["directory_key_errors"] += 1
                self._key_errors.warning(key, "cluster directory: the key of block %s (%s) is of another type: a "
                                         "miss", key.hex()[:16], self.directory.key(root, key)[:48])
            elif isinstance(holders, Oversized):  # (a directory writer's forgeries: the sweep deletes them)
                self.stats["directory_keys_oversized"] += 1
                self._key_errors.warning(key, "cluster directory: the key of block %s (%s) holds %d fields, far "
                                         "more than any block's holders: not read, a miss (the sweep deletes "
                                         "those not sealed with the cluster token)", key.hex()[:16],
                                         self.directory.key(root, key)[:48], holders.fields)
                holders = {}
            out.append(holders or {})
        return out

    async def find(
        self, ns: NsEntry, keys: Sequence[bytes], parent: bytes = b"", depth: int = 1
    ) -> tuple[int, list[PeerBlock]]:
        found = await self._records(ns.root, keys)
        if found is None:
            return 0, []
        now = self._now_ms()
        index, movers, slab = self.store.index, self.store.space.movers, self.store.slab
        ns = index.live(ns)  # the live entry: a write meanwhile may have made it
        adopted = 0
        peers: list[PeerBlock] = []
        through: set[str] = set()  # the nodes the run goes through
        previous = ""
        self._void_met(ns.root, keys, found, now)
        for i, holders in enumerate(found):
            key = keys[i]
            live: list[tuple[Member, Record]] = []
            shared: Record | None = None
            for node, rec in holders.items():
                if node == self.node:
                    continue  # this node's own record (it does not hold the block any more, or it would have matched)
                m = self._live(node, rec, now)
                if m is not None:
                    live.append((m, rec))
                if rec.tiers & SHARED and rec.checksum and shared is None:
                    shared = rec
            if not peers and shared is not None and index.get(ns, key) is None and slab.holds(shared.size):
                b = index.add(ns, BlockKey(key), keys[i - 1] if i else parent, shared.size, State.COMMITTED, depth + i)
                b.checksum = shared.checksum
                if movers.adopt(b, shared.tiers):
                    ns = b.ns
                    adopted += 1
                    continue
                index.drop(b)  # this node lacks that tier, or it is down
            if not live or index.get(ns, key) is not None:
                break
            m, rec = min(live, key=lambda mr: (mr[0].node != previous, _rank(mr[1].tiers), mr[0].node))
            if not slab.holds(rec.size):
                break  # a block larger than any slot here (the holder has larger pages): a miss
            if m.node not in through and len(through) == MAX_HOLDERS:
                break  # (the run goes through at most that many nodes: a miss from here)
            through.add(m.node)
            previous = m.node
            peers.append(PeerBlock(m.node, rec.tiers, rec.size, rec.checksum, rec.retain_until_ms,
                                   rec.retain_priority))
        self.stats["blocks_adopted"] += adopted
        return adopted, peers

    def _void_met(self, root: bytes, keys: Sequence[bytes], found: list[dict[str, Record]], now: float) -> None:
        """Mark for deletion every void record a lookup read (of every key, not only those up to
        where its run ends), this node's own past lives' included."""
        for key, holders in zip(keys, found):
            for node, rec in holders.items():
                if len(self._stale) >= STALE_MAX:
                    return  # (the sweep gets the rest)
                if (node != self.node or rec.incarnation != self.incarnation) and self._live(node, rec, now) is None \
                        and self._void(node, rec):
                    self._stale.append((root, key, node, rec))  # a past life's, a lapsed lease's, a gone node's

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        found = await self._records(ns.root, keys) if self._up else None
        now = self._now_ms()
        own = self.store.index.leading_run(ns, keys)
        # where each live node holds each key: node -> placement bits, per key
        holders: list[dict[str, int]] = []
        for i in range(len(keys)):
            here = {self.node: own[i].tiers} if i < len(own) else {}
            for node, rec in (found[i] if found is not None else {}).items():
                if node != self.node and self._live(node, rec, now) is not None:
                    here[node] = rec.tiers
            if not here:
                break
            holders.append(here)
        # Each node that holds some of the run: its blocks by place, the rest through its peers;
        # every other node: all of it through its peers. Work in the holders' records and the
        # members, not in members x keys (thousands of members, a live lease each, and a long
        # prompt took the loop for half a second).
        held: dict[str, dict[str, int]] = {}
        for here in holders:
            for node, tiers in here.items():
                counts = held.setdefault(node, {})
                label = top_label(tiers & 15)
                counts[label] = counts.get(label, 0) + 1
        n = len(holders)
        out: dict[str, dict[str, int]] = {}
        for node in [self.node, *(m.node for m in self.live_members() if m.node != self.node)]:
            counts = dict(held.get(node, {}))
            if n > sum(counts.values()):
                counts["peer"] = n - sum(counts.values())
            out[node] = counts
        return out

    # --- fetch ----------------------------------------------------------------------------------

    async def fetch(self, ns: NsEntry, keys: Sequence[bytes], parent: bytes, depth: int) -> int:
        adopted, peers = await self.find(ns, keys, parent, depth)
        if not peers or self._closing:  # (closing: no fetch may start after close ended those in flight)
            return adopted
        index, space = self.store.index, self.store.space
        ns = index.live(ns)
        pending: list[tuple[Block, PeerBlock]] = []
        for i, pb in enumerate(peers, start=adopted):
            key = keys[i]
            if index.get(ns, key) is not None:
                break  # written or fetched here meanwhile
            b = index.add(ns, BlockKey(key), keys[i - 1] if i else parent, pb.size, State.ALLOCATED, depth + i)
            ns = b.ns
            try:
                b.slot = space.take_slot(b)
            except KVStoreError:  # DRAM full of pinned blocks, or a size this slab has no class for
                index.drop(b)
                break
            pending.append((b, pb))
        # The fetch runs on whatever happens to the caller: a cancelled Acquire must not leave
        # the blocks ALLOCATED with their slots; they are placed (or freed) all the same.
        # Only close() ends it (before the store goes away): see _fetches.
        task = asyncio.create_task(self._fetch_into(ns, pending), name="kvstore-cluster-fetch")
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)
        return adopted + await asyncio.shield(task)

    async def _fetch_into(self, ns: NsEntry, pending: list[tuple[Block, PeerBlock]]) -> int:
        """Fetch ``pending`` (blocks holding slots) from their holders, one fetch per holder's
        consecutive blocks, at once; place the leading run that arrived intact as replicas, free
        the rest. How many were placed.

        No slot is placed or freed before every one of these fetches has ended, its I/O thread
        too: a slot freed under a thread still reading into it takes the holder's bytes into
        whatever block gets the slot next (another tenant's, sealed after them). A holder's run
        that comes short cuts the runs after it (they cannot join the leading run): their
        fetches are cancelled, and awaited."""
        groups: list[list[tuple[Block, PeerBlock]]] = []
        for item in pending:
            if groups and groups[-1][0][1].node == item[1].node:
                groups[-1].append(item)
            else:
                groups.append([item])
        tasks = [asyncio.create_task(self._fetch_group(ns.root, g), name="kvstore-cluster-fetch-run") for g in groups]
        try:
            await _until_cut(tasks, [len(g) for g in groups])
        except BaseException:  # cancelled (close(), the loop ending): every fetch ends first
            await _ended(tasks)
            raise
        finally:
            placed = self._settle(groups, [_count(t) for t in tasks])
        return placed

    def _settle(self, groups: list[list[tuple[Block, PeerBlock]]], counts: list[int]) -> int:
        """Place the leading run of ``groups`` that arrived (``counts``: each group's leading
        blocks in intact), free every other block's slot. How many were placed."""
        index, space = self.store.index, self.store.space
        placed = placed_bytes = 0
        cut = False
        for group, n in zip(groups, counts):
            for j, (b, _) in enumerate(group):
                if cut or j >= n:
                    cut = True
                    space.free(b)  # never visible: the slot goes back, the block leaves the index
                    continue
                b.replica = True
                index.publish(b)
                space.place(b)
                self._retained_as(b, group[j][1])
                placed += 1
                placed_bytes += b.size
        self.stats["blocks_fetched"] += placed
        self.stats["bytes_fetched"] += placed_bytes
        return placed

    def _retention_of(self, b: Block) -> tuple[int, int]:
        """``b``'s retention for its record: (end in ms since the epoch, priority); (0, 0): none."""
        left = b.retain_until - self.store.clock()
        return (round(time.time() * 1000 + left * 1000), b.retain_priority) if left > 0 else (0, 0)

    def _retained_as(self, b: Block, holder: PeerBlock) -> None:
        """A fetched block keeps what is left of its holder's retention (the record's), on this
        node's clock (the two hosts' wall clocks are taken to agree)."""
        left = holder.retain_until_ms / 1000 - time.time()
        if holder.retain_until_ms and left > 0:
            b.retain_until, b.retain_priority = self.store.clock() + left, holder.retain_priority
            self.store.retention.adopt(b)

    def _client(self, node: str) -> PeerClient | None:
        """The client of ``node``'s peer data path; None when it is not a member, or its member
        entry's address is not one to dial (counted: a miss for whatever it holds)."""
        m = self._members.get(node)
        if m is None:
            return None
        client = self._peers.get(node)
        if client is None or client.address != m.address:
            if client is not None:
                client.close()
                del self._peers[node]
            try:
                client = PeerClient(m.address, self.key, self.node, node, self.cfg.fetch_timeout_s)
            except ValueError as exc:
                self.stats["bad_addresses"] += 1
                self._warn.warning("cluster member %s has no address to dial (a miss): %s", shown(node), exc)
                return None
            self._peers[node] = client
        return client

    async def _fetch_group(self, root: bytes, group: list[tuple[Block, PeerBlock]]) -> int:
        """Fetch one holder's consecutive blocks; how many leading ones arrived intact. A failure
        of any kind is a miss for this holder's run, never the request's error."""
        node = group[0][1].node
        try:
            return await self._fetch_run(root, group)
        except Exception as exc:  # noqa: BLE001 - any failure is a miss for this run (a cancellation ends it)
            self.stats["fetch_failures"] += 1
            self._warn.warning("peer fetch from %s failed (a miss): %s: %s", shown(node), type(exc).__name__, exc)
            return 0

    async def _fetch_run(self, root: bytes, group: list[tuple[Block, PeerBlock]]) -> int:
        node = group[0][1].node
        client = self._client(node)
        if client is None:
            return 0
        views = [self.store.space.view(b) for b, _ in group]
        start = time.perf_counter()
        result = await client.fetch(root, [b.key for b, _ in group], views, self.cfg.fetch_timeout_s)
        got = result.checksums
        outcome = "error" if result.error else "short" if len(got) < len(group) else "ok"
        self.latency.histogram("peer_fetch", (outcome,)).since(start)
        if result.error:
            self.stats["fetch_failures"] += 1
            self._warn.warning("peer fetch from %s ended after %d of %d blocks: %s",
                               node, len(got), len(group), result.error)
        elif len(got) < len(group):  # the holder could not lend the rest now (or no longer holds it:
            self.stats["fetch_misses"] += len(group) - len(got)  # then it unlists it itself, see lend)
        sums = result.hashes
        for j, (sent, actual) in enumerate(zip(got, sums)):
            expected = group[j][1].checksum
            if actual != sent or (expected and actual != expected):
                self.stats["checksum_failures"] += 1
                log.warning(
                    "block %s from %s failed its checksum (%#x, holder says %#x, directory %#x): a miss",
                    group[j][0].key.hex()[:16], node, actual, sent, expected,
                )
                return j
            group[j][0].checksum = actual
        return min(len(got), len(sums))

    # --- the holder's side ------------------------------------------------------------------------

    async def lend(self, root: bytes, keys: Sequence[bytes]) -> Lent:
        """The leading run of ``keys`` this node holds, brought into DRAM and leased while sent."""
        store = self.store
        ns = store.index.namespaces.get(NamespaceRoot(root))  # raw root bytes off the wire
        if ns is None:
            return NOTHING_LENT
        run = store.index.leading_run(ns, keys)
        if len(run) < len(keys):  # asked for what it does not hold: its record goes
            if len(self._unheld) < UNHELD_MAX:
                self._unheld.add((root, keys[len(run)]))
            else:
                self.stats["unheld_dropped"] += 1
        run = await store.space.movers.promote(run)
        readable: list[Block] = []
        for b in run:
            if not b.tiers & DRAM or b.state is not State.COMMITTED or b.slot is None:
                break
            readable.append(b)
        if not readable:
            return NOTHING_LENT
        lease = store.index.take_lease(readable, store.clock() + self.cfg.fetch_timeout_s * 2)

        def done() -> None:
            if lease.id in store.index.leases:
                store.index.release_lease(lease.id)

        def left_s() -> float:  # (the hashing below, a busy loop: less than the lease's length)
            return lease.deadline - store.clock()

        # A task cancelled while it hashes (its connection dropped, the server stopping) would
        # otherwise leave the lease pinning these blocks in DRAM until its deadline: until the
        # Lent owns the lease, anything that ends the call releases it (the Lent's own path).
        try:
            unsealed = [b for b in readable if b.checksum is None]
            if unsealed:
                for b, c in zip(unsealed, await checksums([store.space.view(b) for b in unsealed])):
                    if b.checksum is None:
                        b.checksum = c
            store.space.touch(readable)
            self.stats["blocks_lent"] += len(readable)
            return Lent([(b.checksum or 0, store.space.view(b)) for b in readable], done, left_s)
        except BaseException:
            done()
            raise


async def _until_cut(tasks: list[asyncio.Task[int]], sizes: list[int]) -> None:
    """Wait until every one of ``tasks`` (one holder's run each, of ``sizes`` blocks) has ended;
    when one ends short, cancel those after it (their blocks could not join the leading run)."""
    at = {t: i for i, t in enumerate(tasks)}
    left: set[asyncio.Task[int]] = set(tasks)
    while left:
        done, left = await asyncio.wait(left, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            i = at[t]
            if _count(t) < sizes[i]:
                for later in tasks[i + 1 :]:
                    later.cancel()


async def _ended(tasks: list[asyncio.Task[int]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, through any further cancellation of
    the caller (which the caller re-raises): a fetch's I/O thread writes into slots until then."""
    for t in tasks:
        t.cancel()
    while not all(t.done() for t in tasks):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(tasks)


def _count(t: asyncio.Task[int]) -> int:
    """Leading blocks a holder's fetch got in intact: 0 for one cancelled (or that failed)."""
    if not t.done() or t.cancelled() or t.exception() is not None:
        return 0
    return t.result()


def _advertised(peer_address: str, port: int) -> str:
    host = peer_address.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"

