"""Find and fetch: the blocks of a prompt other nodes hold, brought into this one.

A lookup that ends short of the request asks the directory about the rest (one script call; one
pipeline on a Redis Cluster). A block in a shared tier this node has (Redis, S3) is adopted: it
joins the local index as placed there (``StoreDoor.adopt``; the movers read and verify
it as any promotion). A block only another node holds is fetched from it over the peer data path
straight into a local slot reserved for it (``StoreDoor.reserve``), checked against the
holder's checksum and the directory's, and settled: the leading run that arrived intact is kept as
replicas (``Block.replica``: dropped, not demoted, when DRAM evicts it) with the retention the
holder's answer says it holds now (not the directory record's), every other slot freed.

Why the fetch runs in a task of its own: a cancelled Acquire must not leave its reservation open;
only :meth:`Fetcher.close` (before the store goes away) ends a fetch in flight, and no slot is
settled while an I/O thread may still write into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.cluster.directory import Member, Oversized, Record
from kvstore.cluster.membership import Membership
from kvstore.cluster.peer_client import PeerClient
from kvstore.cluster.publisher import Publisher
from kvstore.errors import Unavailable, shown
from kvstore.store.books.index import DRAM, NsEntry, top_label
from kvstore.store.door import StoreDoor
from kvstore.store.exchange import Reservation
from kvstore.store.remote import MAX_HOLDERS, PeerBlock
from kvstore.tier_table import shared_bits
from kvstore.util.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class Arrived(NamedTuple):
    """A block that arrived intact: its checksum, and its holder's retention of it as the holder's
    answer gave it (ms left, priority; 0 ms: none), which this node adopts (never a directory
    record's: a directory writer can put back one its holder has ended since)."""

    checksum: int
    retain_ms: int
    priority: int


def _rank(tiers: int) -> int:
    """Which holder to read from: its copy in DRAM first, then anywhere else."""
    return 0 if tiers & DRAM else 1


class Fetcher:
    def __init__(self, store: StoreDoor, members: Membership, publisher: Publisher) -> None:
        self.store = store
        self.members = members
        self.publisher = publisher  # (the void records a lookup meets go to its next pass)
        self.stats = members.stats
        self.latency = members.latency  # peer fetches too
        self.closing = False  # no fetch may start once close() has ended those in flight
        self._peers: dict[str, PeerClient] = {}
        self._fetches: set[asyncio.Task[int]] = set()  # peer fetches in flight (shielded from their Acquire)

    async def close(self) -> None:
        """End the fetches in flight (their blocks freed before this returns) and the peer links.
        A fetch runs shielded from its Acquire (cancelled by now): ended here, or an I/O thread
        would go on reading into the slots of a stopped store. Their deadline shuts their sockets
        down."""
        self.closing = True
        await cancel_and_wait(list(self._fetches))

    def close_peers(self) -> None:
        for p in self._peers.values():
            p.close()

    # --- find -------------------------------------------------------------------------------

    async def records(self, root: bytes, keys: Sequence[bytes]) -> list[dict[str, Record]] | None:
        """Every record the directory holds of ``keys``, by holder; None when it did not answer."""
        members = self.members
        start = time.perf_counter()
        try:
            async with asyncio.timeout(members.cfg.directory_timeout_s):
                found = await members.directory.find(root, keys)
        except (Unavailable, TimeoutError) as exc:
            members.unreachable("find", start, exc, "cluster directory lookup failed (a miss)")
            return None
        members.round_trip("find", start, "ok")
        self.stats["directory_lookups"] += 1
        members.count_rejected()
        out: list[dict[str, Record]] = []
        for key, holders in zip(keys, found):
            if holders is None:  # that key's error, not the directory's: a miss from that key on
                self.stats["directory_key_errors"] += 1
                members.key_errors.warning(
                    key,
                    "cluster directory: the key of block %s (%s) is of another type: a miss",
                    key.hex()[:16],
                    members.directory.key(root, key)[:48],
                )
            elif isinstance(holders, Oversized):  # (a directory writer's forgeries: the sweep deletes them)
                self.stats["directory_keys_oversized"] += 1
                members.key_errors.warning(
                    key,
                    "cluster directory: the key of block %s (%s) holds %d fields, far "
                    "more than any block's holders: not read, a miss (the sweep deletes "
                    "those not sealed with the cluster token)",
                    key.hex()[:16],
                    members.directory.key(root, key)[:48],
                    holders.fields,
                )
                holders = {}
            out.append(holders or {})
        return out

    async def find(
        self, ns: NsEntry, keys: Sequence[bytes], parent: bytes = b"", depth: int = 1
    ) -> tuple[int, list[PeerBlock]]:
        found = await self.records(ns.root, keys)
        if found is None:
            return 0, []
        now = self.members.now_ms()
        store = self.store
        ns = store.live(ns)  # the live entry: a write meanwhile may have made it
        adopted = 0
        peers: list[PeerBlock] = []
        through: set[str] = set()  # the nodes the run goes through
        previous = ""
        self._void_met(ns.root, keys, found, now)
        for i, holders in enumerate(found):
            key = keys[i]
            live, shared = self._holders(holders, now)
            if not peers and shared is not None:
                here = store.adopt(
                    ns, key, keys[i - 1] if i else parent, shared.size, shared.tiers, shared.checksum, depth + i
                )
                if here is not None:
                    ns = here
                    adopted += 1
                    continue
            if not live or store.stored(ns, key):
                break
            m, rec = min(live, key=lambda mr: (mr[0].node != previous, _rank(mr[1].tiers), mr[0].node))
            if not store.fits(rec.size):
                break  # a block larger than any slot here (the holder has larger pages): a miss
            if m.node not in through and len(through) == MAX_HOLDERS:
                break  # (the run goes through at most that many nodes: a miss from here)
            through.add(m.node)
            previous = m.node
            peers.append(PeerBlock(m.node, rec.tiers, rec.size, rec.checksum))  # (not its retention: the answer's)
        self.stats["blocks_adopted"] += adopted
        return adopted, peers

    def _holders(self, holders: dict[str, Record], now: float) -> tuple[list[tuple[Member, Record]], Record | None]:
        """A key's records: those of live other nodes, and the first that lies in a shared tier
        (sealed) whichever node wrote it."""
        live: list[tuple[Member, Record]] = []
        shared: Record | None = None
        for node, rec in holders.items():
            if node == self.members.node:
                continue  # this node's own record (it does not hold the block any more, or it would have matched)
            m = self.members.live(node, rec, now)
            if m is not None:
                live.append((m, rec))
            if rec.tiers & shared_bits() and rec.checksum and shared is None:
                shared = rec
        return live, shared

    def _void_met(self, root: bytes, keys: Sequence[bytes], found: list[dict[str, Record]], now: float) -> None:
        """Mark for deletion every void record a lookup read (of every key, not only those up to
        where its run ends), this node's own past lives' included."""
        for key, holders in zip(keys, found):
            for node, rec in holders.items():
                # Full first, then judged: judging a record of a node missing from the members
                # starts that node's absence clock (Membership.void), which only records that
                # can still be deleted may do.
                if self.publisher.voids_full:
                    return  # (the sweep gets the rest)
                if self.members.stale(node, rec, now):  # a past life's, a lapsed lease's, a gone node's
                    self.publisher.void_met(root, key, node, rec)

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        members = self.members
        found = await self.records(ns.root, keys) if members.up else None
        now = members.now_ms()
        own = self.store.leading_run(ns, keys)
        # where each live node holds each key: node -> placement bits, per key
        holders: list[dict[str, int]] = []
        for i in range(len(keys)):
            here = {members.node: own[i].tiers} if i < len(own) else {}
            for node, rec in (found[i] if found is not None else {}).items():
                if node != members.node and members.live(node, rec, now) is not None:
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
        for node in [members.node, *(m.node for m in members.live_members() if m.node != members.node)]:
            counts = dict(held.get(node, {}))
            if n > sum(counts.values()):
                counts["peer"] = n - sum(counts.values())
            out[node] = counts
        return out

    # --- fetch ------------------------------------------------------------------------------

    async def fetch(self, ns: NsEntry, keys: Sequence[bytes], parent: bytes, depth: int) -> int:
        adopted, peers = await self.find(ns, keys, parent, depth)
        if not peers or self.closing:  # (closing: no fetch may start after close ended those in flight)
            return adopted
        reservation = self.store.reserve(
            ns, keys[adopted:], keys[adopted - 1] if adopted else parent, depth + adopted, peers
        )
        # The fetch runs on whatever happens to the caller: a cancelled Acquire must not leave
        # the reservation open with its slots; its blocks are placed (or freed) all the same.
        # Only close() ends it (before the store goes away): see _fetches.
        task = asyncio.create_task(self._fetch_into(reservation), name="kvstore-cluster-fetch")
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)
        return adopted + await asyncio.shield(task)

    async def _fetch_into(self, reservation: Reservation) -> int:
        """Fetch the reserved blocks from their holders, one fetch per holder's consecutive
        blocks, at once; settle the reservation: the leading run that arrived intact placed as
        replicas, the rest freed. How many were placed.

        No slot is placed or freed before every one of these fetches has ended, its I/O thread
        too: a slot freed under a thread still reading into it takes the holder's bytes into
        whatever block gets the slot next (another tenant's, sealed after them). A holder's run
        that comes short cuts the runs after it (they cannot join the leading run): their
        fetches are cancelled, and awaited."""
        groups: list[tuple[int, int]] = []  # (start, stop) of each holder's consecutive blocks
        for i, pb in enumerate(reservation.holders):
            if groups and reservation.holders[groups[-1][0]].node == pb.node:
                groups[-1] = (groups[-1][0], i + 1)
            else:
                groups.append((i, i + 1))
        tasks = [
            asyncio.create_task(self._fetch_group(reservation, *g), name="kvstore-cluster-fetch-run") for g in groups
        ]
        try:
            await _until_cut(tasks, [stop - start for start, stop in groups])
        except BaseException:  # cancelled (close(), the loop ending): every fetch ends first
            await _ended(tasks)
            raise
        finally:
            placed = self._settle(reservation, groups, tasks)
        return placed

    def _settle(
        self, reservation: Reservation, groups: list[tuple[int, int]], tasks: list[asyncio.Task[list[Arrived]]]
    ) -> int:
        """Settle ``reservation`` with the checksums of its leading run that arrived intact (each
        holder's leading blocks in intact, up to the first holder's run that came short)."""
        arrived: list[Arrived] = []
        for (start, stop), t in zip(groups, tasks):
            got = _got(t)
            arrived += got
            if len(got) < stop - start:
                break
        placed = reservation.settle([a.checksum for a in arrived], [(a.retain_ms, a.priority) for a in arrived])
        self.stats["blocks_fetched"] += placed
        self.stats["bytes_fetched"] += sum(pb.size for pb in reservation.holders[:placed])
        return placed

    def _client(self, node: str) -> PeerClient | None:
        """The client of ``node``'s peer data path, for the address and incarnation its member entry
        names (a later one, or another address: a new client); None when it is not a member, or its
        member entry's address is not one to dial (counted: a miss for whatever it holds)."""
        m = self.members.member(node)
        if m is None:
            return None
        client = self._peers.get(node)
        if client is None or client.address != m.address or client.incarnation != m.incarnation:
            if client is not None:
                client.close()
                del self._peers[node]
            try:
                client = PeerClient(
                    m.address,
                    self.members.directory.sealer,
                    self.members.node,
                    node,
                    m.incarnation,
                    self.members.cfg.fetch_timeout_s,
                    self.members.cfg.peer_encryption,
                )
            except ValueError as exc:
                self.stats["bad_addresses"] += 1
                self.members.warn.warning("cluster member %s has no address to dial (a miss): %s", shown(node), exc)
                return None
            self._peers[node] = client
        return client

    async def _fetch_group(self, reservation: Reservation, start: int, stop: int) -> list[Arrived]:
        """Fetch one holder's consecutive blocks; the leading ones that arrived intact. A failure
        of any kind is a miss for this holder's run, never the request's error."""
        node = reservation.holders[start].node
        try:
            return await self._fetch_run(reservation, start, stop)
        except Exception as exc:  # noqa: BLE001 - any failure is a miss for this run (a cancellation ends it)
            self.stats["fetch_failures"] += 1
            self.members.warn.warning(
                "peer fetch from %s failed (a miss): %s: %s", shown(node), type(exc).__name__, exc
            )
            return []

    async def _fetch_run(self, reservation: Reservation, start: int, stop: int) -> list[Arrived]:
        holders = reservation.holders[start:stop]
        node = holders[0].node
        client = self._client(node)
        if client is None:
            return []
        views = reservation.views(start, stop)
        keys = reservation.keys(start, stop)
        began = time.perf_counter()
        result = await client.fetch(reservation.ns.root, keys, views, self.members.cfg.fetch_timeout_s)
        got = result.checksums
        outcome = "error" if result.error else "short" if len(got) < len(holders) else "ok"
        self.latency.histogram("peer_fetch", (outcome,)).since(began)
        if result.error:
            self.stats["fetch_failures"] += 1
            self.members.warn.warning(
                "peer fetch from %s ended after %d of %d blocks: %s", node, len(got), len(holders), result.error
            )
        elif len(got) < len(holders):  # the holder could not lend the rest now (or no longer holds it:
            self.stats["fetch_misses"] += len(holders) - len(got)  # then it unlists it itself, see lend)
        sums = result.hashes
        intact: list[Arrived] = []
        for j, (sent, actual) in enumerate(zip(got, sums)):
            expected = holders[j].checksum
            if actual != sent or (expected and actual != expected):
                self.stats["checksum_failures"] += 1
                log.warning(
                    "block %s from %s failed its checksum (%#x, holder says %#x, directory %#x): a miss",
                    keys[j].hex()[:16],
                    node,
                    actual,
                    sent,
                    expected,
                )
                return intact
            intact.append(Arrived(actual, *result.retained[j]))
        return intact


async def _until_cut(tasks: list[asyncio.Task[list[Arrived]]], sizes: list[int]) -> None:
    """Wait until every one of ``tasks`` (one holder's run each, of ``sizes`` blocks) has ended;
    when one ends short, cancel those after it (their blocks could not join the leading run)."""
    at = {t: i for i, t in enumerate(tasks)}
    left: set[asyncio.Task[list[Arrived]]] = set(tasks)
    while left:
        done, left = await asyncio.wait(left, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            i = at[t]
            if len(_got(t)) < sizes[i]:
                for later in tasks[i + 1 :]:
                    later.cancel()


async def _ended(tasks: list[asyncio.Task[list[Arrived]]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, through any further cancellation of
    the caller (which the caller re-raises): a fetch's I/O thread writes into slots until then."""
    for t in tasks:
        t.cancel()
    while not all(t.done() for t in tasks):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(tasks)


def _got(t: asyncio.Task[list[Arrived]]) -> list[Arrived]:
    """The leading blocks a holder's fetch got in intact: none for one cancelled (or that failed)."""
    if not t.done() or t.cancelled() or t.exception() is not None:
        return []
    return t.result()
