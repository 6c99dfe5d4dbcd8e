"""Retention hints: a soft pin on blocks that a client says it will come back for.

An agent's turn ends in a tool call; the engine knows the conversation will return and the cache
does not. A client retains blocks for ``retain_ms`` (on Commit, Acquire or Retain) with a
``retain_priority`` of 0..3. A retained block stays in its eviction policy's order, but a space
(DRAM, a bounded tier below it) picks it as a victim only when nothing unretained is left to pick
there, the lowest priority first (:meth:`Retention.pop_victim`: the one rule, which ``kvstore
replay`` runs too). Evicted from DRAM it is demoted as any block is; a block that leaves every
tier loses its retention with it. A retention ends on the sidecar's own clock (monotonic), never
the client's; a new hint on a retained block keeps the later end and the higher priority.

The retention is the :class:`~kvstore.store.books.index.Block`'s (``retain_until``, ``retain_priority``);
this module keeps the retained blocks and two bounds on them:

* each tenant's, per tier (``tenants.<tier>_retained_bytes``): a hint that would pass it is
  refused whole, RESOURCE_EXHAUSTED naming the bound, before anything changes (:meth:`check`);
* all tenants' together, per tier (``tenants.retained_fraction`` of the tier's capacity): a salt
  is free, so per-tenant bounds alone let many salts retain the whole cache. This one is the
  cache's own judgement of what a hint may hold, not an error:
  :class:`~kvstore.store.books.hint_budget.HintBudget` shortens a hint past it to its leading blocks
  that fit, or refuses it, making room from lower priorities only.

Every way a block comes to be retained here is held to both: a hint (Commit, Acquire, Retain, a
peer fetch's whole run), a retention adopted from the peer a block was fetched from (:meth:`adopt`:
the retention the holder's answer says it holds now, never a directory record's, which a directory
writer could replay after the holder ended it; its end capped at this clock + a hint's limit),
and a retained block promoted into a tier (past its bounds there it is promoted unretained:
:meth:`recount`). A hint or adoption refused by a tenant's bound is counted per tenant
(``refused``: the busiest ``shown`` tenants, the rest under ``other``), one the total bound cut or
refused in the budget's counts.

What it costs is a heap's: the bytes retained per tier and tenant are kept as blocks gain or lose
a retention or a tier (:meth:`recount`, from the index's placement news), the ends wait on a heap
per priority (a retention that runs out is let go when the clock passes it; the budget makes room
from the lowest priority's earliest end), and the eviction policies keep a
retained block's candidates apart, in the band of its priority (``Banded``,
:mod:`kvstore.policy.leaves`): choosing a victim is O(log n), checking a bound O(blocks of the
hint), however many blocks are retained. ``work`` counts what the rule looked at (candidates a
victim search judged, blocks a check or a report added up): the tests count it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.store.books.index import Block
from kvstore.tier_table import BIT_NAMES

if TYPE_CHECKING:
    from kvstore.policy.base import Banded, Eligible, EvictionPolicy
    from kvstore.store.books.hint_worth import HintWorth

PRIORITIES = 4  # retain_priority is 0..3; the lowest goes first once only retained blocks are left
MAX_RETAIN_MS = 86_400_000  # a day: longer is a pin, not a hint
OTHER = "other"  # the refused count of every tenant past the ``shown`` first
_TIERS = BIT_NAMES  # (bit, label) of every tier (kvstore/tier_table.py, a registered one's too)


def check_hint(retain_ms: int, priority: int) -> None:
    """INVALID_ARGUMENT naming the field for a hint out of range."""
    if not 0 <= retain_ms <= MAX_RETAIN_MS:
        raise InvalidArgument(f"retain_ms: {retain_ms} is outside 0..{MAX_RETAIN_MS}")
    if not 0 <= priority < PRIORITIES:
        raise InvalidArgument(f"retain_priority: {priority} is outside 0..{PRIORITIES - 1}")


def tenant(b: Block) -> str:
    """The block's tenant tag ("" for none), as the tenant quotas name it (its entry's field)."""
    return b.ns.tenant


class Held:
    """The bytes retained in one tier: per tenant and in all, changed together (:meth:`add`). The
    one ledger of retained bytes: a tenant's bound reads ``tenants``, the budget's total bound
    ``total`` (:meth:`Retention.held_in`)."""

    __slots__ = ("tenants", "total")

    def __init__(self) -> None:
        self.tenants: Counter[str] = Counter()  # tenant -> bytes
        self.total = 0

    def add(self, who: str, n: int) -> None:
        """``n`` bytes more (fewer, negative) retained by tenant ``who``."""
        tenants = self.tenants
        tenants[who] += n
        if not tenants[who]:
            del tenants[who]
        self.total += n


class Budget(Protocol):
    """What a retention asks of its budget (:class:`kvstore.store.books.hint_budget.HintBudget`, which
    reads the retention it is handed: this module does not import it back)."""

    totals: dict[str, int]
    worth: HintWorth

    def admit(self, r: Retention, blocks: list[Block], priority: int, into: int, now: float,
              until: float) -> list[Block]: ...

    def fits(self, r: Retention, b: Block, gained: int) -> bool: ...

    def snapshot(self) -> dict[str, object]: ...


class Retention:
    """The retained blocks of one node (or one replayed cache) and the soft pin rule.

    ``bounds``: tier label -> bytes each tenant may retain there (0: no bound); ``budget``: what
    all hints together may hold (None: no total bound); ``shown``: how many tenants' refused
    counts are kept apart."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 bounds: Mapping[str, int] | None = None, budget: Budget | None = None,
                 shown: int = 32) -> None:
        self.clock = clock
        self.bounds = {t: n for t, n in (bounds or {}).items() if n}  # tier label -> bytes per tenant
        self.budget = budget
        self.shown = shown
        self.refused: Counter[str] = Counter()  # tenant (``OTHER`` past ``shown``) -> hints refused
        self.work: Counter[str] = Counter()  # "examined": candidates judged; "summed": blocks added up
        self.held: dict[str, Held] = {}  # tier label -> the bytes retained there now (the one ledger)
        self.counted: dict[Block, int] = {}  # the retained blocks some tier holds -> tier bits counted
        # Per priority a heap of (end, seq, block), stale ones too: a block's entry is in the heap
        # of its priority (pushed again when it rises), its end maybe earlier than the block's now.
        self.ends: list[list[tuple[float, int, Block]]] = [[] for _ in range(PRIORITIES)]
        self._seq = itertools.count()
        self._policies: list[Banded] = []  # the policies that keep retained candidates apart

    # --- hints ----------------------------------------------------------------------------------

    def check(self, blocks: Sequence[Block], retain_ms: int, priority: int, into: int = 0) -> None:
        """Refuse (RESOURCE_EXHAUSTED naming the bound) a hint that would take a tenant past its
        retained bytes in a tier; ``into``: tier bits the blocks are about to enter (a commit's,
        an acquire's DRAM, a fetch's). Changes nothing but the refused count. (What all hints
        together may hold shortens the hint in :meth:`retain`; it never fails the call.)"""
        check_hint(retain_ms, priority)
        if not retain_ms or not self.bounds:
            return
        now = self._expire()
        adding: Counter[tuple[str, str]] = Counter()
        unique = dict.fromkeys(blocks)
        self.work["summed"] += len(unique)
        for b in unique:
            if b.retain_until > now:
                continue  # counted already
            tiers, who = b.tiers | into, tenant(b)
            for bit, label in _TIERS:
                if tiers & bit:
                    adding[label, who] += b.size
        refusal = self._past(adding)
        if refusal is not None:
            self._refuse(refusal[0])
            raise ResourceExhausted(f"retain_ms: {refusal[1]}")

    def _past(self, adding: Mapping[tuple[str, str], int]) -> tuple[str, str] | None:
        """(tenant, why) of the first tenant's bound that ``adding`` (tier, tenant -> bytes) would pass."""
        for (tier, who), n in adding.items():
            bound = self.bounds.get(tier)
            held = self.held.get(tier)
            has = held.tenants[who] if held is not None else 0
            if bound and has + n > bound:
                return who, (f"tenant {who or '-'!r} would retain {has + n} bytes in {tier}, past its bound "
                             f"of {bound} (tenants.{tier}_retained_bytes)")
        return None

    def _refuse(self, who: str) -> None:
        """One more refused hint of ``who`` (under ``OTHER`` once ``shown`` tenants have a count)."""
        refused = self.refused
        refused[who if who in refused or len(refused) < self.shown else OTHER] += 1

    def retain(self, blocks: Iterable[Block], retain_ms: int, priority: int, into: int = 0) -> list[Block]:
        """Retain ``blocks`` for ``retain_ms`` from now (0: end their retention now): the leading
        ones the budget affords (:meth:`HintBudget.admit`; ``into``: tier bits they are about to
        enter). A block retained already keeps the later end and the higher priority. The blocks
        retained or ended (each once)."""
        now = self._expire()
        unique = list(dict.fromkeys(blocks))
        if not retain_ms:
            for b in unique:
                self.end(b)
            return unique
        until = now + retain_ms / 1000.0
        if self.budget is not None:
            unique = self.budget.admit(self, unique, priority, into, now, until)
        for b in unique:
            if b.retain_until > now:  # retained already: the later end (the heap learns it lazily)
                if until > b.retain_until:
                    b.retain_until = until
                if priority > b.retain_priority:
                    b.retain_priority = priority
                    self._rekey(b)
                    if b in self.counted:  # (its end waits in the heap of its new priority)
                        self.wait(b)
            else:
                b.retain_until, b.retain_priority = until, priority
                if self.budget is not None:
                    self.budget.worth.retained(b)
                self.recount(b, checked=True)  # (the caller checked the hint: check, and the budget's admit)
                self._rekey(b)
        return unique

    def end(self, b: Block, returned: bool = True) -> None:
        """``b``'s retention ends now: a hint of 0 (``returned``: the turn came back), or the
        budget's (room for a higher priority, a share that shrank)."""
        if b.retain_until > self.clock():
            if self.budget is not None:
                worth = self.budget.worth
                if returned:
                    worth.returned(b)
                else:
                    worth.marks.pop(b, None)  # (not judged: the budget ended it)
            b.retain_until, b.retain_priority = 0.0, 0
            self._update(b)

    def adopt(self, b: Block) -> bool:
        """``b`` came with a retention of its own (its holder's, as the holder's fetch answer gave
        it, or a copy's): its end capped at this clock + a hint's limit; refused (ended, counted)
        where it would pass a tenant's bound or the budget cannot afford it (:meth:`recount`).
        Whether ``b`` is retained now."""
        now = self._expire()
        if b.retain_until <= now:
            return False
        b.retain_until = min(b.retain_until, now + MAX_RETAIN_MS / 1000.0)
        self._update(b)
        if b.retain_until > now and self.budget is not None:
            self.budget.worth.retained(b)  # (its room is this node's: judged as a hint's)
        return b.retain_until > now

    def inherit(self, b: Block, until: float, priority: int) -> bool:
        """``b`` takes another copy's retention (ends at ``until`` on this clock, ``priority``):
        a fetched block its holder's, a copy its leaving sibling's. Where ``b`` is retained
        already it keeps the later end and the higher priority, as a second hint would give;
        then :meth:`adopt`. Whether ``b`` is retained now."""
        if b.retain_until > self.clock():
            b.retain_until = max(b.retain_until, until)
            b.retain_priority = max(b.retain_priority, priority)
        else:
            b.retain_until, b.retain_priority = until, priority
        return self.adopt(b)

    def left(self, b: Block) -> tuple[int, int]:
        """``b``'s retention now as a peer's fetch answer carries it (:class:`kvstore.wire.peer.Entry`):
        ms left of it on this clock (0: none) and its priority."""
        left = b.retain_until - self.clock()
        if left <= 0:
            return 0, 0
        return min(MAX_RETAIN_MS, max(1, int(left * 1000))), b.retain_priority

    def recount(self, b: Block, checked: bool = False) -> None:
        """``b``'s tiers or retention changed: its bytes move between the per tier and tenant
        counts (the index calls this for every placement of a block that was ever retained). A
        retained block that enters a tier (a promotion, a demotion, an adoption) where its bytes
        would pass a bound is retained no more (refused, counted): a retention taken where no
        bound held is not carried into a tier where one does (the total bound may first make
        room from lower priorities: :meth:`HintBudget.fits`). ``checked``: a hint's block, whose
        bytes :meth:`check` and the budget counted already."""
        old = self.counted.get(b, 0)
        new = b.tiers if b.retain_until > self.clock() else 0
        if old == new:
            return
        size, who = b.size, tenant(b)
        gained = new & ~old
        if gained and not checked:
            refusal = self._past({(label, who): size for bit, label in _TIERS if gained & bit}) \
                if self.bounds else None
            if refusal is not None:
                self._refuse(who)
            if refusal is not None or (self.budget is not None and not self.budget.fits(self, b, gained)):
                b.retain_until, b.retain_priority = 0.0, 0
                new = 0
        moved = old ^ new
        for bit, label in _TIERS:
            if moved & bit:
                n = size if new & bit else -size
                held = self.held.get(label)
                if held is None:
                    held = self.held[label] = Held()
                held.add(who, n)
        if new:
            if not old:
                self.wait(b)
            self.counted[b] = new
        elif old:
            del self.counted[b]
            if self.budget is not None:
                self.budget.worth.unused(b)
            self._rekey(b)  # (a retention that ran out, or was refused: back to band -1)
            if sum(map(len, self.ends)) > 2 * len(self.counted) + 1024:  # (the ends of blocks let go)
                self.ends = [[] for _ in range(PRIORITIES)]
                for x in self.counted:
                    self.ends[x.retain_priority].append((x.retain_until, next(self._seq), x))
                for heap in self.ends:
                    heapq.heapify(heap)

    def held_in(self, tier: str) -> int:
        """All tenants' bytes retained in ``tier`` (a label) now, as last counted."""
        held = self.held.get(tier)
        return held.total if held is not None else 0

    def stored(self, blocks: Iterable[Block]) -> None:
        """``blocks`` were stored anew here (a Commit's, the replay's misses; not a peer's
        fetched copies): the budget weighs what its hints were worth
        (:meth:`kvstore.store.books.hint_worth.HintWorth.stored`)."""
        if self.budget is not None:
            self.budget.worth.stored(blocks, self.clock())

    def used(self, blocks: Iterable[Block]) -> None:
        """``blocks`` were used here (an Acquire's run, the blocks a peer fetched from here, the
        replay's hits): the budget judges the retained ones among them
        (:meth:`kvstore.store.books.hint_worth.HintWorth.used`)."""
        if self.budget is not None:
            self.budget.worth.used(blocks, max((h.total for h in self.held.values()), default=0))

    def _update(self, b: Block) -> None:
        """``b``'s retention was set or ended: its bytes are counted (or not), and the policies
        file it in its band."""
        self.recount(b)
        self._rekey(b)

    def _rekey(self, b: Block) -> None:
        for p in self._policies:
            p.rekey(b)

    def _expire(self) -> float:
        """Let go of the retentions that ran out (now, returned)."""
        now = self.clock()
        for p in range(PRIORITIES):
            ends = self.ends[p]
            while ends and ends[0][0] <= now:
                b = heapq.heappop(ends)[2]
                if b not in self.counted or b.retain_priority != p:
                    continue  # (no tier holds it, its retention ended early, or it rose to another heap)
                if b.retain_until <= now:
                    self.recount(b)  # (out of its band too)
                else:  # extended since it was pushed: it waits for its new end
                    self.wait(b)
        return now

    def wait(self, b: Block) -> None:
        """``b``'s end waits in the heap of its priority (for it to run out, or to make room)."""
        heapq.heappush(self.ends[b.retain_priority], (b.retain_until, next(self._seq), b))

    # --- the soft pin ---------------------------------------------------------------------------

    def band(self, b: Block) -> int:
        """``b``'s band in the policies: its priority while retained, else -1."""
        return b.retain_priority if b.retain_until > self.clock() else -1

    def pop_victim(self, policy: EvictionPolicy, ok: Callable[[Block], bool] | None) -> Block | None:
        """The policy's next victim among the blocks ``ok`` accepts (removed from the policy): an
        unretained one while there is any, else a retained one of the lowest priority there is."""
        banded = cast("Banded", policy)
        if banded not in self._policies:  # (a replay's: the store's spaces are watched from the start)
            self.watch(policy)
        self._expire()
        if ok is not None:
            work, judge = self.work, ok

            def counted(b: Block) -> bool:
                work["examined"] += 1
                return judge(b)

            ok = counted
        eligible = cast("Eligible | None", ok)
        if not self.counted:
            v = cast("Block | None", banded.pop_victim(eligible))
            if v is not None:
                self.evicted(v)
            return v
        for p in range(-1, PRIORITIES):
            v = cast("Block | None", banded.pop_victim(eligible, p))
            if v is not None:
                if p < 0:
                    self.evicted(v)
                return v
        return None

    def evicted(self, v: Block) -> None:
        """Unretained ``v`` was chosen as a victim (here, or by the cluster replay's preference for
        spare copies): the budget counts what the policy turned over and what retained blocks
        displaced (:meth:`kvstore.store.books.hint_worth.HintWorth.evicted`)."""
        if self.budget is not None:
            self.budget.worth.evicted(v, max((h.total for h in self.held.values()), default=0))

    def watch(self, policy: EvictionPolicy) -> None:
        """``policy`` keeps retained candidates apart from now on (its blocks retained already
        move to their bands: a walk over them, none when it is watched from its space's start)."""
        banded = cast("Banded", policy)
        if banded in self._policies:
            return
        banded.band = cast("Callable[[object], int]", self.band)
        self._policies.append(banded)
        for b in self.counted:
            banded.rekey(b)

    def least(self, blocks: Iterable[Block]) -> Block | None:
        """The block of ``blocks`` to evict first by retention alone (an unretained one, else the
        lowest priority): for the spaces' fallbacks when the policy offers no victim."""
        now = self._expire()
        if not self.counted:
            return next(iter(blocks), None)
        best, rank = None, PRIORITIES
        for b in blocks:
            r = b.retain_priority if b.retain_until > now else -1
            if r < rank:
                best, rank = b, r
                if r < 0:
                    break
        return best

    # --- reporting ------------------------------------------------------------------------------

    def by_tier(self) -> dict[str, dict[str, int]]:
        """Retained bytes now, per tier label and tenant tag, of blocks some tier holds."""
        self._expire()
        return {t: dict(h.tenants) for t, h in self.held.items() if h.tenants}

    def count(self) -> int:
        """Blocks retained now that some tier holds."""
        self._expire()
        return len(self.counted)

    def snapshot(self) -> dict[str, object]:
        """The ``retained`` entry of /stats: blocks, and bytes per tier and tenant ("-": no salt;
        the ``shown`` busiest in each tier, the rest summed under ``other``), the bounds, refused
        hints per tenant, and the work counts."""
        tiers = self.by_tier()
        shown: dict[str, dict[str, int]] = {}
        for t, c in tiers.items():
            top = dict(Counter(c).most_common(self.shown))
            rest = sum(c.values()) - sum(top.values())
            shown[t] = {(k or "-"): n for k, n in top.items()} | ({OTHER: rest} if rest else {})
        return {
            "blocks": len(self.counted),
            "bytes": {t: self.held[t].total for t in tiers},
            "tenants": shown,
            "bounds": dict(self.bounds),
            "totals": dict(self.budget.totals) if self.budget is not None else {},
            **({"budget": self.budget.snapshot()} if self.budget is not None else {}),
            "refused": {(k or "-"): n for k, n in self.refused.items()},
            "work": dict(self.work),
        }
