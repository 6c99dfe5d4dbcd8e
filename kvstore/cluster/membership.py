"""This node in the cluster directory: its heartbeat, the members it read, and which records count.

A heartbeat every ``heartbeat_ms`` renews this node's lease and reads every member's
(:data:`kvstore.cluster.directory.HEARTBEAT`). A record counts only while its node's lease runs in
the directory's clock (estimated here from the last heartbeat) and its incarnation is the node's
current one. A heartbeat that renews a lease which had run out gives this node a new incarnation
(others may have deleted the old one's records meanwhile): it asks for everything it holds to be
re-published under that one, as it does when the directory comes back. The walk that deletes void
records (:mod:`kvstore.cluster.sweep`) asks here which records are void.

Why one owner: the publisher, the fetcher and the sweep all judge records by the same members and
the same clock, and any of them that finds the directory unreachable marks it so for all
(:meth:`Membership.unreachable`): nothing is written to it, and nobody waits on it, until the next
heartbeat gets through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from itertools import islice

from kvstore.cluster.directory import Directory, Member, Record
from kvstore.cluster.sweep import Sweeper
from kvstore.config import ClusterConfig
from kvstore.errors import Unavailable
from kvstore.stats.counters import Stats
from kvstore.util.logs import Once, Throttled

log = logging.getLogger(__name__)
ABSENT_TRACKED = 65536  # nodes missing from the members followed at once (records of forged names)
FORGET_MEMBERS_BATCH = 32768  # unreadable members entries deleted at most a heartbeat


class Membership:
    def __init__(
        self, directory: Directory, cfg: ClusterConfig, node: str, stats: Stats, republish: Callable[[], None]
    ) -> None:
        self.directory = directory
        self.cfg = cfg
        self.node = node
        self.incarnation = time.time_ns() // 1_000_000  # ms: each start of a node is a later life
        self.address = ""  # this node's peer address, once its server listens
        self.stats = stats.cluster
        self.latency = stats.latency  # directory round trips (kvstore/stats/latency.py)
        self.up = False  # the directory answered the last call made to it
        self.closing = False  # the node is leaving: the sweep starts no pass
        self.warn = Throttled(log)  # the node's warnings (a flood of bad input must not flood the log)
        self.key_errors = Once(log)  # a directory key of another type: told once per key
        self._republish = republish
        self._members: dict[str, Member] = {}
        self._clock: tuple[int, float] = (0, 0.0)  # (directory ms, local monotonic) at the last heartbeat
        self._absent: dict[str, int] = {}  # nodes of records met that the members lack -> since (directory ms)
        self._older = 0  # member entries of an older version at the last heartbeat (a rolling update)
        self._unreadable = UnreadableMembers()
        per_pass = round(cfg.sweep_keys_per_s * cfg.heartbeat_ms / 1000)
        self._sweeper = Sweeper(directory, self.sweepable, self.stats, max(1, per_pass))

    # --- the members ----------------------------------------------------------------------

    def now_ms(self) -> float:
        """The directory's clock now, as estimated from the last heartbeat."""
        server_ms, local = self._clock
        return server_ms + (time.monotonic() - local) * 1000.0

    def member(self, node: str) -> Member | None:
        return self._members.get(node)

    def live(self, node: str, rec: Record, now_ms: float) -> Member | None:
        """``node``'s member entry when its record ``rec`` counts at ``now_ms``, else None."""
        m = self._members.get(node)
        if m is None or m.incarnation != rec.incarnation or m.expiry_ms <= now_ms:
            return None
        return m

    def live_members(self) -> list[Member]:
        now = self.now_ms()
        return [m for m in self._members.values() if m.expiry_ms > now]

    def void(self, node: str, rec: Record) -> bool:
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
        return self.live(node, rec, self.now_ms()) is None and self.void(node, rec)

    def stale(self, node: str, rec: Record, now_ms: float) -> bool:
        """Whether a record another life wrote (another node's, or this node's past one) is void."""
        return (
            (node != self.node or rec.incarnation != self.incarnation)
            and self.live(node, rec, now_ms) is None
            and self.void(node, rec)
        )

    # --- the heartbeat and the sweep ------------------------------------------------------

    async def sweep(self) -> None:
        """A pass of the walk that deletes void records (:mod:`kvstore.cluster.sweep`)."""
        if not self.up or self.closing:
            return
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                await self._sweeper.step()
            self.round_trip("sweep", start, "ok")
        except (Unavailable, TimeoutError) as exc:
            self.round_trip("sweep", start, "error")
            self.stats["directory_errors"] += 1
            self.warn.warning("cluster directory sweep failed (tried again next pass): %s", self.why(exc))

    async def heartbeat(self) -> None:
        was_up = self.up
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                sent = time.monotonic()
                # (the entry is sealed whole, its expiry too: estimated here in the directory's clock)
                expiry = round(self.now_ms()) + self.cfg.lease_ms if self._clock[0] else 0
                beat = await self.directory.heartbeat(self.address, self.incarnation, self.cfg.lease_ms, expiry)
            self.round_trip("heartbeat", start, "ok")
            self._clock = (beat.now_ms, (sent + time.monotonic()) / 2)
            self._members = beat.members
            if beat.wrong_type:
                self.stats["directory_key_errors"] += 1
                self.warn.warning(
                    "cluster directory: the members key %s was a %s, not a hash (a directory "
                    "writer's): deleted, written anew by this heartbeat; every node joins it again "
                    "at its next",
                    self.directory.members_key,
                    beat.wrong_type,
                )
            self.count_rejected()
            for node in [n for n in self._absent if n in beat.members]:
                del self._absent[node]
            self.up = True
            self.stats["heartbeats"] += 1
            older, self._older = self._older, beat.older
            if beat.incarnation != self.incarnation:
                # the lease had run out (a pause, a cut, a late heartbeat, with or without a call
                # failing): a new life, whose records nobody has deleted as void
                log.warning(
                    "cluster lease of node %s had run out; incarnation %d now (was %d), re-publishing "
                    "what this node holds",
                    self.node,
                    beat.incarnation,
                    self.incarnation,
                )
                self.incarnation = beat.incarnation
                self._republish()
            elif older and not beat.older:
                # the last node of an older version is gone (a rolling update is over): while it
                # ran it read this node's entry as one that does not check out and deleted its
                # records as void; this node publishes them again (docs/cluster.md, "Rolling updates")
                log.info("cluster: no member of an older version is left; re-publishing what this node holds")
                self._republish()
            elif self.stats["heartbeats"] > 1 and (not was_up or beat.created):
                # back after calls failed, or back without a word (restarted, failed over: our own
                # member entry was gone): either way what it held may be gone
                log.info(
                    "cluster directory is back%s; re-publishing what this node holds",
                    " and had lost this node's entry" if beat.created else "",
                )
                self._republish()
        except (Unavailable, TimeoutError) as exc:
            self.unreachable(
                "heartbeat", start, exc, "cluster directory unreachable (serving local and shared tiers only)"
            )
            return
        await self._unreadable_members(beat.unreadable, beat.now_ms)

    def count_rejected(self) -> None:
        """Show the directory's count of records and member entries that did not check out (written
        without the cluster token, moved, or of an older version: never read), and warn of new ones."""
        records, members = self.directory.rejected_records, self.directory.rejected_members
        if records > self.stats["records_rejected"] or members > self.stats["members_rejected"]:
            self.warn.warning(
                "cluster directory holds entries not sealed with this cluster's token (ignored: %d records, "
                "%d member entries so far): written by a process without the token, by a node with another "
                "token, or by an older version",
                records,
                members,
            )
        self.stats["records_rejected"], self.stats["members_rejected"] = records, members

    async def _unreadable_members(self, entries: dict[bytes, bytes], now_ms: int) -> None:
        """Count the members entries this node cannot read (skipped) and delete those that have
        outlasted a lease unchanged (:class:`UnreadableMembers`, below)."""
        new = self._unreadable.seen(entries, now_ms)
        if new:
            self.stats["members_unreadable"] += new
            self.warn.warning(
                "cluster directory: %d members entries this node cannot read (not UTF-8, not "
                "address|incarnation|expiry_ms, or not sealed whole with this cluster's token; skipped, deleted after "
                "%d ms), e.g. %r",
                new,
                self.cfg.lease_ms,
                next(iter(entries))[:64],
            )
        due = self._unreadable.due(now_ms, self.cfg.lease_ms, FORGET_MEMBERS_BATCH)
        if not due:
            return
        start = time.perf_counter()  # a round trip of its own, after the heartbeat's: op="forget_members"
        try:
            async with asyncio.timeout(self.cfg.directory_timeout_s):
                self.stats["members_forgotten"] += await self.directory.forget_members(due)
        except (Unavailable, TimeoutError) as exc:
            self.unreachable(
                "forget_members", start, exc, "cluster directory unreachable deleting unreadable members entries"
            )
            return
        self.round_trip("forget_members", start, "ok")
        self._unreadable.gone(due)

    # --- the directory's calls ------------------------------------------------------------

    def unreachable(self, op: str, start: float, exc: BaseException, what: str) -> None:
        """A directory call ``op`` begun at ``start`` failed with ``exc``: the directory counts as
        away until a heartbeat gets through (warned of as ``what``)."""
        self.round_trip(op, start, "error")
        self.up = False
        self.stats["directory_errors"] += 1
        self.warn.warning("%s: %s", what, self.why(exc))

    def why(self, exc: BaseException) -> str:
        """What a directory call failed with, for a log line: a deadline (a TimeoutError says
        nothing) named as one."""
        if isinstance(exc, TimeoutError) and not str(exc):
            return f"no answer within cluster.directory_timeout_s ({self.cfg.directory_timeout_s:g} s)"
        return str(exc)

    def round_trip(self, op: str, start: float, outcome: str) -> None:
        """A directory call begun at ``start`` (``time.perf_counter()``) has ended: its latency."""
        self.latency.histogram("directory", (op, outcome)).since(start)


# --- The ``members`` entries a node cannot read, and since when each has been there unchanged. An entry
# that is not UTF-8 or not ``address|incarnation|expiry_ms`` (a stray write, a bad byte, a version
# that writes another format) is skipped by every read of the members
# (:func:`~kvstore.cluster.directory.parse_member`); nobody renews it, so once it has been there
# unchanged for longer than a lease it is deleted (compare-and-delete: an entry rewritten since
# stays), a bounded batch a heartbeat. So such entries cannot pile up and slow every heartbeat.

TRACKED = 1 << 20  # entries followed at most (the rest are followed once those are gone)


class UnreadableMembers:
    def __init__(self) -> None:
        self._since: dict[bytes, tuple[bytes, int]] = {}  # field -> (value, first seen in directory ms)

    def __len__(self) -> int:
        return len(self._since)

    def seen(self, entries: dict[bytes, bytes], now_ms: int) -> int:
        """The unreadable entries of a heartbeat (field -> value) read at ``now_ms`` (the
        directory's clock); how many of them are new (or changed) since the last one."""
        since: dict[bytes, tuple[bytes, int]] = {}
        new = 0
        for field, value in islice(entries.items(), TRACKED):
            prev = self._since.get(field)
            if prev is not None and prev[0] == value:
                since[field] = prev
            else:
                since[field] = (value, now_ms)
                new += 1
        self._since = since
        return new

    def due(self, now_ms: int, age_ms: int, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` entries (field, value) unchanged for ``age_ms`` or longer at ``now_ms``."""
        old = ((f, v) for f, (v, t) in self._since.items() if now_ms - t >= age_ms)
        return list(islice(old, limit))

    def gone(self, entries: list[tuple[bytes, bytes]]) -> None:
        for field, _ in entries:
            self._since.pop(field, None)
