"""What one node's hints have been worth: how much of its bound for hints it lets them hold now.

A retained block keeps room the policy would have given to other blocks, and whether that pays
depends on the node more than on the hint: on a cache small beside a turn, a retained turn comes
back to blocks the policy would have evicted; on a cache that keeps most turns anyway (or on a
node the turn does not come back to) it comes back to blocks that would have been there without
the hint, or never, while the blocks it pushed out are missed. One share of the cache cannot serve
both (docs/eviction.md, "Hints the cache can afford"), so each node's budget
(:class:`~kvstore.store.books.hint_budget.HintBudget`) weighs what its own hints did, block by block,
in bytes:

* **paid**: a retained block used (a hit here, or a peer served from here) after more unretained
  bytes were evicted here since it was retained than the room left unretained: the policy would
  have evicted it (**saved**); or a block a hint asked for that the budget did not retain, stored
  again before the end the hint asked for (**wanted**: a miss the hint would have saved);
* **cost**: a retained (or just returned) block used before that much was evicted: it would
  have been there anyway, and its room bought nothing (**early**); a retention that ran out, was
  ended by the budget, or left the tier unused (**unused**); an unretained block evicted while
  blocks were retained, stored again while it is among the latest evicted up to the bytes
  retained: with that room unretained the policy would have kept it (**displaced**).

A retention the client ended (a hint of 0: the turn came back) is judged at its next use here,
and never as unused: where the turn came back this node cannot tell, and under round-robin
routing it comes back to another node, which the retaining node would otherwise count as a
retention that bought nothing (over 8 round-robin nodes that took the Mooncake traces' 1.15-1.19x
to 1.02-1.06x at 1%; docs/eviction.md). What such a retention did cost here still shows as
**displaced**.

The budget's bounds are scaled by ``room / bound``, ``room`` being ``bound`` x (2 x
:data:`WHOLE` x paid / cost - 1) within 0..bound, each side with a prior (paid: 1/64 of the
bound, cost: 1/32, so that a node's first turns judged decide it: a node judges a few bounds of
blocks in a whole replay; each at most :data:`PRIOR_BLOCKS` blocks and twice that, the largest
block judged being the block, so that a large bound, a global cache of 8 nodes' bound, decides in
as many turns as a node: the agentic trace's global cache of 8 x 5% under ``credit`` went from
0.99993x to 1.00006x, docs/eviction.md): hints hold the whole bound while they paid at least an eighth of what
they cost, less as the cost grows past that, and nothing once it is sixteen times what they paid,
which is a cache that refuses every hint (exactly as if none were sent). Most blocks judged on
the Mooncake traces over 8 nodes are early (a continuation fetched or hit before the node turned
over; under a policy other than LRU the room is only a proxy of when it would have been evicted),
yet there the fixed share gains 1.15-1.26x: a node whose hints paid a third of what they cost
must keep its share; on the agentic trace over 8 nodes at 5% none is saved, and that node must
lose its share within a turn or two (docs/eviction.md has the cells). A node starts with its
whole bound. Refused hints still
count (wanted), so a node grows back where they would have paid. The evidence is halved once it
passes :data:`HORIZON` bounds, so a node follows a change of its load. Nothing but the calls
counts (no wall clock, no draw): a replay gives the same figures every run. Each call costs
O(its blocks); the ghosts are bounded (the bound's bytes, the bytes retained, and
:data:`RETURNING` blocks).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from kvstore.store.books.index import Block

JUDGED = ("saved", "wanted", "early", "unused", "displaced")  # the blocks judged, by how (/stats)
WHOLE = 8  # the whole bound while paid >= cost / WHOLE, none at paid <= cost / (2 x WHOLE)
PRIOR_PAID, PRIOR_COST = 1, 2  # the priors of paid and cost, in 64ths of the bound (of PRIOR_BLOCKS blocks where less)
PRIOR_BLOCKS = 256  # the priors at most this many blocks (the largest judged): a long turn, whatever the bound
HORIZON = 64  # bounds of evidence (paid + cost) past which both are halved
RETURNING = 1 << 16  # blocks returned and not yet used or evicted, at most (the oldest forgotten)


class HintWorth:
    """One node's evidence of what its hints were worth. ``bound``: the first bounded tier's bound
    on retained bytes (the evidence's unit); ``capacity``: that tier's bytes."""

    def __init__(self, bound: int, capacity: int, adapt: bool = True) -> None:
        if bound <= 0:
            raise ValueError(f"bound: {bound} bytes; a bound for hints must be positive")
        self.bound = bound
        self.capacity = capacity
        self.adapt = adapt  # False: the evidence is counted, the room stays the whole bound
        self.room = bound  # of ``bound``, what hints may hold now: the budget's bounds scale by it
        self.paid = 0  # bytes (halved past the horizon)
        self.cost = 0
        self.turnover = 0  # bytes of unretained blocks evicted so far
        self.marks: dict[Block, int] = {}  # retained, not yet judged -> ``turnover`` when retained
        self.returning: dict[Block, int] = {}  # ended by a hint of 0 (the turn came back), not yet judged
        self.displaced: OrderedDict[bytes, int] = OrderedDict()  # key -> size, the latest last
        self.displaced_bytes = 0
        self.wanted: OrderedDict[bytes, tuple[float, Block]] = OrderedDict()  # key -> (the hint's end, block)
        self.wanted_bytes = 0
        self.judged: Counter[str] = Counter()  # blocks, by :data:`JUDGED`
        self.block = 0  # bytes of the largest block judged: the unit of the priors on a large bound

    # --- what the retention tells ---------------------------------------------------------------

    def retained(self, b: Block) -> None:
        """``b``'s retention began (a hint, an adoption): judged at its first use, or unused."""
        self.marks.setdefault(b, self.turnover)

    def returned(self, b: Block) -> None:
        """``b``'s retention was ended early (a hint of 0: the turn came back): judged at its next
        use here, or unused when it is evicted first."""
        mark = self.marks.pop(b, None)
        if mark is not None:
            returning = self.returning
            returning[b] = mark
            if len(returning) > RETURNING:  # (the oldest, gone some way the budget was not told)
                del returning[next(iter(returning))]

    def unused(self, b: Block) -> None:
        """``b``'s retention ran out or was refused, or ``b`` left the tier, before any use (one
        the client ended is forgotten here: the module's docstring)."""
        if self.marks.pop(b, None) is not None:
            self._judge("unused", b.size)
        elif not b.tiers:
            self.returning.pop(b, None)  # (came back, maybe elsewhere: not judged)

    def used(self, blocks: Iterable[Block], retained: int) -> None:
        """``blocks`` were used here while ``retained`` bytes were retained: saved or early."""
        marks, returning = self.marks, self.returning
        if not marks and not returning:
            return
        room = self.capacity - retained
        for b in blocks:
            mark = marks.pop(b, None)
            if mark is None:
                mark = returning.pop(b, None)
                if mark is None:
                    continue
            self._judge("saved" if self.turnover - mark >= room else "early", b.size)

    def evicted(self, b: Block, retained: int) -> None:
        """Unretained ``b`` was evicted while ``retained`` bytes were retained in its tier."""
        self.turnover += b.size
        self.returning.pop(b, None)  # (came back, maybe elsewhere: not judged, the docstring)
        if not retained:
            return
        ghost = self.displaced
        old = ghost.pop(b.key, None)
        if old is not None:
            self.displaced_bytes -= old
        ghost[b.key] = b.size
        self.displaced_bytes += b.size
        while self.displaced_bytes > retained and ghost:
            self.displaced_bytes -= ghost.popitem(last=False)[1]

    def cut(self, blocks: Iterable[Block], until: float) -> None:
        """A hint asked to retain ``blocks`` until ``until`` and the budget did not retain them."""
        ghost = self.wanted
        for b in blocks:
            old = ghost.pop(b.key, None)
            if old is not None:
                self.wanted_bytes -= old[1].size
            ghost[b.key] = (until, b)
            self.wanted_bytes += b.size
        while self.wanted_bytes > self.bound and ghost:
            self.wanted_bytes -= ghost.popitem(last=False)[1][1].size

    def stored(self, blocks: Iterable[Block], now: float) -> None:
        """``blocks`` were stored anew here (each a miss of its key): displaced or wanted."""
        if not self.displaced and not self.wanted:
            return
        for b in blocks:
            size = self.displaced.pop(b.key, None)
            if size is not None:
                self.displaced_bytes -= size
                self._judge("displaced", b.size)
            asked = self.wanted.get(b.key)
            if asked is not None and asked[1] is not b:  # (not the hint's own block, committed with it)
                del self.wanted[b.key]
                self.wanted_bytes -= asked[1].size
                if asked[0] >= now:
                    self._judge("wanted", b.size)

    # --- the share --------------------------------------------------------------------------------

    def _judge(self, how: str, size: int) -> None:
        self.judged[how] += 1
        if size > self.block:
            self.block = size
        if how in ("saved", "wanted"):
            self.paid += size
        else:
            self.cost += size
        bound = self.bound
        if not self.adapt:
            return
        if self.paid + self.cost > HORIZON * bound:
            self.paid //= 2
            self.cost //= 2
        blocks = PRIOR_BLOCKS * self.block
        paid = self.paid + min(bound * PRIOR_PAID // 64, blocks * PRIOR_PAID)
        cost = self.cost + max(1, min(bound * PRIOR_COST // 64, blocks * PRIOR_COST))
        self.room = max(0, min(bound, bound * (2 * WHOLE * paid - cost) // cost))

    @property
    def scale(self) -> float:
        """The share of its bounds the budget lets hints hold now (0..1)."""
        return self.room / self.bound

    def limit(self, total: int) -> int:
        """What a tier's bound of ``total`` bytes allows now."""
        return total * self.room // self.bound

    def snapshot(self) -> dict[str, object]:
        """The budget's ``worth`` in /stats: the scale and the blocks judged each way."""
        return {"scale": round(self.scale, 4), **{k: self.judged[k] for k in JUDGED}}

    @property
    def gains(self) -> int:
        return self.judged["saved"] + self.judged["wanted"]

    @property
    def losses(self) -> int:
        return self.judged["early"] + self.judged["unused"] + self.judged["displaced"]
