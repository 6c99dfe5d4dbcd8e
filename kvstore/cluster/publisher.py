"""This node's records in the cluster directory: the index's change feed written out in passes.

The index feeds the publisher every block whose visibility or placement changes
(:meth:`kvstore.store.books.index.Index.subscribe`); every ``publish_interval_ms`` :meth:`Publisher.flush`
writes those records to the directory in one pipeline (HSET for a block this node holds, HDEL for
one it no longer does), deletes the void records met meanwhile (by lookups) and the records of
blocks peers asked for that this node does not hold. A failed write keeps the changes for the next
pass; when the directory comes back, or this node begins a new incarnation, it re-publishes
everything it holds (:meth:`Publisher.republish_all`). The same pipeline carries the cluster's
ghosts (the ``g:`` keys of :mod:`kvstore.cluster.directory`): a block this node lets go leaves
behind the use count its policies have of it, for about as long as this node's own ghost would
keep it (:class:`~kvstore.policy.ghost.GhostSpan`), and a block new here (committed, or fetched
from a peer) takes up the count another node left, in the policies of the spaces that hold it.

Why a feed: the index says what changed as it changes and the publisher reads it when it writes,
so a pass costs the changes since the last one, never a walk over everything held; and nothing is
kept while no publisher reads (a node on its own).

Paced (``cluster.publish_records_per_s``): a pass writes at most that rate times
``publish_interval_ms`` records of blocks that only moved (a restart's recovery entering a
million blocks, a re-publish of everything after an outage or a new incarnation); the rest wait
in the publisher's backlog, in order, for the next passes. Blocks new on this node (committed,
fetched), those a ``wait_published`` commit waits for, and the deletes of the records of blocks
this node no longer holds are never held back. So a restarted
node's million records go out in bounded pipelines, a pass at a time, between which the event
loop serves requests and heartbeats (before, one pass wrote them all: 100 k records in 25
back-to-back pipelines, and the 100 k-record walk that built them, on one turn of the loop).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.cluster.directory import Ghosts, Published, Record
from kvstore.cluster.membership import Membership
from kvstore.errors import FailedPrecondition, KVStoreError, Unavailable
from kvstore.policy.ghost import GhostSpan
from kvstore.store.books.index import Block, ChangeFeed
from kvstore.store.door import StoreDoor

PUBLISH_BATCH = 4096  # directory records in one pipeline
STALE_MAX = 65536  # void records met and not yet deleted (the publisher's next pass deletes them)
# Keys peers asked for that this node does not hold, remembered for the next publish to delete their
# records: at most this many (one pipeline's worth). While the directory is down nothing drains them;
# past this, a request's key is not remembered (another request, or the holder's own next look at
# it, finds the record again).
UNHELD_MAX = PUBLISH_BATCH


@dataclass(slots=True)
class _Pass:
    """One pass's records: the puts (and per put whether it is new here), the removes (and per
    remove the use count this node leaves in the ghost, and whether it was let go this pass)."""

    puts: list[tuple[bytes, bytes, Record]] = field(default_factory=list)
    fresh: list[bool] = field(default_factory=list)  # per put: new on this node (its ghost is read), not a re-publish
    removes: list[tuple[bytes, bytes]] = field(default_factory=list)
    uses: list[int] = field(default_factory=list)  # per remove: the use count its policies have or remember of it
    unread: list[bool] = field(default_factory=list)  # per remove: stored and let go since the last pass


class Publisher:
    def __init__(self, store: StoreDoor, members: Membership) -> None:
        self.store = store
        self.members = members
        self.stats = members.stats
        self._feed: ChangeFeed | None = None  # while the node runs
        self._waiters = PublishWaiters()
        self._stale: list[tuple[bytes, bytes, str, Record]] = []
        self._unheld: set[tuple[bytes, bytes]] = set()  # keys peers asked for that this node does not hold
        self._span = GhostSpan()  # how fast this node lets blocks go: how long its ghosts last
        self._call: tuple[str, float] = ("publish", 0.0)  # the directory call in flight, and its start
        # Changes of blocks that only moved, not written yet: a pass takes at most ``budget`` of them.
        self._backlog: OrderedDict[Block, bool] = OrderedDict()
        rate, interval_ms = members.cfg.publish_records_per_s, members.cfg.publish_interval_ms
        self.budget = max(1, rate * interval_ms // 1000) if rate else 0  # records of moved blocks a pass (0: all)

    @property
    def backlog(self) -> int:
        """Changes waiting for a pass (paced: ``cluster.publish_records_per_s``)."""
        return len(self._backlog)

    def start(self) -> None:
        """Read the index's changes from now on, everything it holds first."""
        self._feed = self.store.subscribe()
        self.republish_all()

    def stop(self, why: str) -> None:
        self._waiters.fail_all(why)
        self.store.unsubscribe()
        self._feed = None

    # --- what the next pass writes ----------------------------------------------------------

    def republish_all(self) -> None:
        feed = self._feed
        if feed is None:
            return
        for b in self.store.held():
            feed.moved(b)

    @property
    def voids_full(self) -> bool:
        """Whether as many void records wait for the next pass as it deletes (the sweep gets the
        rest): a lookup then judges no more of the records it read."""
        return len(self._stale) >= STALE_MAX

    def void_met(self, root: bytes, key: bytes, node: str, rec: Record) -> None:
        """Delete this void record at the next pass (unless :attr:`voids_full`)."""
        if not self.voids_full:
            self._stale.append((root, key, node, rec))

    def unheld(self, root: bytes, key: bytes) -> None:
        """A peer asked for a block this node does not hold: its record goes at the next pass."""
        if len(self._unheld) < UNHELD_MAX:
            self._unheld.add((root, key))
        else:
            self.stats["unheld_dropped"] += 1

    def published(self, blocks: Sequence[Block]) -> asyncio.Future[None] | None:
        """Answered after the pass that writes ``blocks``' records (:class:`PublishWaiters`, below):
        an error at once while the directory is away."""
        fut = self._waiters.add(blocks)
        if not self.members.up:
            self._waiters.fail_all("unreachable since the last call to it")
        return fut

    # --- a pass -----------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write the changes gathered since the last pass (and the void records met meanwhile)."""
        feed = self._feed
        if feed is None:
            return
        if not self.members.up:  # nothing is written while the directory is away: whoever waits is told now
            self._waiters.fail_all("unreachable since the last call to it")
            return
        if not (feed or self._stale or self._waiters or self._unheld or self._backlog):
            return
        waiters = self._waiters.take()
        changed, taken = self._paced(feed.drain(), waiters)
        stale, self._stale = self._stale, []
        records = self._gather(changed)
        pending = changed
        error = ""
        refused: dict[Where, str] = {}
        try:
            await self._write(records, refused)
            pending = {}
            if stale:
                self._call = ("forget", time.perf_counter())
                async with asyncio.timeout(self.members.cfg.directory_timeout_s):
                    await self.members.directory.forget(stale)
                self.members.round_trip("forget", self._call[1], "ok")
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            # Re-writing a batch that did land is harmless. Those the backlog had handed out go
            # back to its front (counted in records_paced once: not again as changes of the feed).
            self._unpace([b for b in taken if b in pending])  # (none once the records landed)
            feed.restore({b: new for b, new in pending.items() if b not in taken})
            if not isinstance(exc, (Unavailable, TimeoutError)):
                raise  # (not the directory's: its loop counts and logs it; the changes wait for the next pass)
            self.members.unreachable(*self._call, exc, "cluster directory write failed (kept for the next pass)")
        finally:
            self._waiters.answer(waiters, error, refused)

    def _paced(
        self, changed: dict[Block, bool], waiters: list[tuple[asyncio.Future[None], list[Where]]]
    ) -> tuple[dict[Block, bool], dict[Block, None]]:
        """This pass's changes: every new block's, every one ``waiters`` wait for and every one
        of a key this node no longer holds (its record's delete: a block gone from this node
        leaves the directory at once), then the oldest of the rest, up to :attr:`budget` in all;
        the others wait in the backlog (each counted once in ``records_paced``). And those of
        them the backlog handed out (:meth:`_unpace` puts them back when the pass fails)."""
        backlog, budget = self._backlog, self.budget
        if not budget or (not backlog and len(changed) <= budget):
            return changed, {}  # (the usual pass: nothing held back)
        now: dict[Block, bool] = {}
        taken: dict[Block, None] = {}  # (in the backlog's order)
        for b, new in changed.items():
            if new:
                backlog.pop(b, None)
                now[b] = True
            elif self._let_go(b):  # (not paced, nor put back in the backlog if the pass fails)
                backlog.pop(b, None)
                now[b] = False
            elif b not in backlog:
                backlog[b] = False
                self.stats["records_paced"] += 1
        for _, where in waiters:  # (their records as the index has them now: e.g. after a write-through)
            for root, key in where:
                held = self.store.visible(root, key)
                if held is not None and held in backlog:
                    now[held] = backlog.pop(held)
                    taken[held] = None
        while backlog and len(now) < budget:
            b, new = backlog.popitem(last=False)
            if b not in now:
                now[b] = new
                taken[b] = None
        return now, taken

    def _let_go(self, b: Block) -> bool:
        """Whether ``b``'s key is held here no more (its record's change is a delete)."""
        now = self.store.visible(b.ns.root, b.key)
        return now is None or not now.tiers

    def _unpace(self, taken: Sequence[Block]) -> None:
        """A failed pass's changes that came from the backlog: back at its front, in order."""
        for b in reversed(taken):
            self._backlog[b] = False
            self._backlog.move_to_end(b, last=False)

    def _gather(self, changed: dict[Block, bool]) -> _Pass:
        """The records of ``changed`` (one per key, as the index has it now: not per Block object,
        a key deleted and written again is two Blocks) and of the keys peers asked for in vain."""
        out = _Pass()
        store, count, incarnation = self.store, self.store.uses, self.members.incarnation
        seen: set[tuple[bytes, bytes]] = set()
        for b, new in changed.items():
            where: tuple[bytes, bytes] = (b.ns.root, b.key)
            if where in seen:
                continue
            seen.add(where)
            now = store.visible(b.ns.root, b.key)
            if now is not None and now.tiers:
                out.puts.append((b.ns.root, b.key, Record(incarnation, now.tiers, now.size, now.checksum or 0)))
                out.fresh.append(new if now is b else changed.get(now, False))
            else:
                out.removes.append(where)
                out.uses.append(count(b))
                out.unread.append(new)  # (the key's first change of the pass: it was not held before it)
        if out.removes:  # the blocks let go this pass: the rate the node's ghosts turn over at
            self._span.let_go(len(out.removes), time.monotonic())
        unheld, self._unheld = self._unheld, set()
        for where in unheld - seen:
            if store.visible(*where) is None:
                out.removes.append(where)
                # A record left behind, not a block let go now: its count went to the ghost when
                # it left (rewriting it could replace a newer count another node left since).
                out.uses.append(0)
                out.unread.append(False)
        return out

    async def _write(self, records: _Pass, refused: dict[Where, str]) -> None:
        """Write ``records`` in pipelines of PUBLISH_BATCH, each under the deadline: a node
        re-publishing millions of blocks after an outage gets there in steps instead of timing out
        whole. The records the directory refused go into ``refused``."""
        members = self.members
        ttl_ms = round(1000 * self._span.ttl_s(self.store.ghost_size(), members.cfg.ghost_ttl_s))
        puts, removes = records.puts, records.removes
        self._call = ("publish", time.perf_counter())
        for i in range(0, max(len(puts), len(removes)), PUBLISH_BATCH):
            batch = slice(i, i + PUBLISH_BATCH)
            self._call = ("publish", time.perf_counter())
            async with asyncio.timeout(members.cfg.directory_timeout_s):
                published = await members.directory.publish(
                    puts[batch],
                    removes[batch],
                    fresh=records.fresh[batch],
                    uses=records.uses[batch],
                    unread=records.unread[batch],
                    ttl_ms=ttl_ms,
                )
            members.round_trip("publish", self._call[1], "ok")
            refused.update(self._refused(puts[batch], removes[batch], published))
            self.stats["records_published"] += len(puts[batch]) - len(published.refused_puts)
            self.stats["records_removed"] += len(removes[batch]) - len(published.refused_removes)
            self._resume(puts[batch], published.ghosts)

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
            self.members.key_errors.warning(
                key,
                "cluster directory refused the record of block %s (its key %s): %s; the block stays on this "
                "node, unlisted",
                key.hex()[:16],
                self.members.directory.key(root, key)[:48],
                why,
            )
        return out

    def _resume(self, puts: Sequence[tuple[bytes, bytes, Record]], ghosts: Ghosts) -> None:
        """Take up the use counts other nodes left of the blocks new here (``ghosts.found``, by
        index into ``puts``): the policies of the spaces that still hold each one resume them."""
        self.stats["ghosts_written"] += ghosts.written
        if ghosts.error:
            self.members.warn.warning(
                "cluster directory refused a ghost command (the records landed; a Redis "
                "Cluster's GETDEL needs Redis 6.2 or later): %s",
                ghosts.error,
            )
        for i, n in ghosts.found.items():
            root, key, _ = puts[i]
            b = self.store.visible(root, key)
            if b is not None and b.tiers:  # (let go meanwhile: the count goes with it)
                self.store.resume(b, n)
                self.stats["ghosts_resumed"] += 1


# --- The commits waiting for their blocks' records to be published (``Commit(wait_published=true)``). A
# waiter is answered after the publisher's pass that wrote its blocks: success only when the directory
# took every one of their records; an error when it refused one (its key of another type:
# :class:`~kvstore.errors.FailedPrecondition`, trying again does not help) or could not be written to
# (:class:`~kvstore.errors.Unavailable`: the records are kept and written when it is back, but the
# commit does not wait that long). Never success for a block that was not published.

Where = tuple[bytes, bytes]  # (namespace root, block key)


class PublishWaiters:
    def __init__(self) -> None:
        self._waiting: list[tuple[asyncio.Future[None], list[Where]]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, blocks: Sequence[Block]) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieved)  # (a commit cancelled meanwhile never reads the answer)
        self._waiting.append((fut, [(b.ns.root, b.key) for b in blocks]))
        return fut

    def take(self) -> list[tuple[asyncio.Future[None], list[Where]]]:
        """The waiters so far: those a pass starting now answers."""
        taken, self._waiting = self._waiting, []
        return taken

    def answer(
        self, waiters: list[tuple[asyncio.Future[None], list[Where]]], error: str = "",
        refused: dict[Where, str] | None = None,
    ) -> None:
        """Answer ``waiters`` after a pass that failed with ``error`` ("" where it ran) and in
        which the directory refused the records of ``refused`` (where -> why)."""
        refused = refused or {}
        for fut, where in waiters:
            if fut.done():
                continue
            exc: KVStoreError | None = None
            if error:
                exc = Unavailable(f"wait_published: the cluster directory was not written (the blocks are committed "
                                  f"on this node and published once it is back): {error}")
            elif bad := [w for w in where if w in refused]:
                exc = FailedPrecondition(f"wait_published: the cluster directory refused the records of {len(bad)} "
                                         f"of the {len(where)} blocks (committed on this node, not listed): "
                                         f"{refused[bad[0]]}")
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

    def fail_all(self, error: str) -> None:
        self.answer(self.take(), error)


def _retrieved(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()
