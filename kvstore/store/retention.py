"""Retention hints: a soft pin on blocks that a client says it will come back for.

An agent's turn ends in a tool call; the engine knows the conversation will return and the cache
does not. A client retains blocks for ``retain_ms`` (on Commit, Acquire or Retain) with a
``retain_priority`` of 0..3. A retained block stays in its eviction policy's order, but a space
(DRAM, a bounded tier below it) picks it as a victim only when nothing unretained is left to pick
there, the lowest priority first (:meth:`Retention.pop_victim`: the one rule, which ``kvstore
replay`` runs too). Evicted from DRAM it is demoted as any block is; a block that leaves every
tier loses its retention with it. A retention ends on the sidecar's own clock (monotonic), never
the client's; a new hint on a retained block keeps the later end and the higher priority.

The retention is the :class:`~kvstore.store.index.Block`'s (``retain_until``, ``retain_priority``);
this module keeps the set of retained blocks, so that the rule costs nothing while none is, and
their bytes per tier and tenant (/stats, /metrics, and each tenant's bound,
``tenants.<tier>_retained_bytes``: a hint that would pass it is refused whole, RESOURCE_EXHAUSTED
naming the bound, before anything changes). What all hints together may hold is the cache's own
judgement, :class:`~kvstore.store.hint_budget.HintBudget` (``tenants.retained_fraction``), which
:meth:`Retention.retain` and :meth:`Retention.adopt` ask first.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.store.index import TIER_ORDER, Block

if TYPE_CHECKING:
    from kvstore.policy.base import Eligible, EvictionPolicy
    from kvstore.store.hint_budget import HintBudget

PRIORITIES = 4  # retain_priority is 0..3; the lowest goes first once only retained blocks are left
MAX_RETAIN_MS = 86_400_000  # a day: longer is a pin, not a hint


def check_hint(retain_ms: int, priority: int) -> None:
    """INVALID_ARGUMENT naming the field for a hint out of range."""
    if not 0 <= retain_ms <= MAX_RETAIN_MS:
        raise InvalidArgument(f"retain_ms: {retain_ms} is outside 0..{MAX_RETAIN_MS}")
    if not 0 <= priority < PRIORITIES:
        raise InvalidArgument(f"retain_priority: {priority} is outside 0..{PRIORITIES - 1}")


def tenant(b: Block) -> str:
    """The block's tenant tag ("" for none), as the tenant quotas name it (its entry's field)."""
    return b.ns.tenant


class Retention:
    """The retained blocks of one node (or one replayed cache) and the soft pin rule."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 bounds: Mapping[str, int] | None = None, budget: HintBudget | None = None) -> None:
        self.clock = clock
        self.budget = budget  # what a hint may hold (kvstore/store/hint_budget.py); None: all it asks
        self.bounds = {t: n for t, n in (bounds or {}).items() if n}  # tier label -> bytes per tenant
        self.blocks: dict[Block, None] = {}  # given a retention (some may have ended since)
        self.refused: Counter[str] = Counter()  # tenant -> hints refused by its bound
        self.changed: Callable[[Block], None] = lambda b: None  # told of each block whose retention changed
        self._soonest = math.inf  # the earliest end among ``blocks``
        self._prune_at = 1024  # past this many, the blocks no tier holds any more are let go too

    # --- hints ----------------------------------------------------------------------------------

    def check(self, blocks: Sequence[Block], retain_ms: int, priority: int, into: int = 0) -> None:
        """Refuse (RESOURCE_EXHAUSTED naming the bound) a hint that would take a tenant past its
        retained bytes in a tier; ``into``: tier bits the blocks are about to enter (a commit's,
        an acquire's DRAM). Changes nothing."""
        check_hint(retain_ms, priority)
        if not self.bounds or not retain_ms:
            return
        now = self.clock()
        adding: Counter[tuple[str, str]] = Counter()
        for b in dict.fromkeys(blocks):
            if b.retain_until > now:
                continue  # counted already
            for t in TIER_ORDER:
                if (b.tiers | into) & t:
                    adding[t.label, tenant(b)] += b.size
        if not adding:
            return
        held = self.by_tier(now)
        for (tier, who), n in adding.items():
            bound = self.bounds.get(tier)
            if bound and held.get(tier, {}).get(who, 0) + n > bound:
                self.refused[who] += 1
                raise ResourceExhausted(
                    f"retain_ms: tenant {who or '-'!r} would retain {held.get(tier, {}).get(who, 0) + n} bytes in "
                    f"{tier}, past its bound of {bound} (tenants.{tier}_retained_bytes)"
                )

    def retain(self, blocks: Iterable[Block], retain_ms: int, priority: int) -> list[Block]:
        """Retain ``blocks`` for ``retain_ms`` from now (0: end their retention now). A block
        retained already keeps the later end and the higher priority. The blocks retained (the
        leading ones the budget affords) or ended."""
        now = self.clock()
        blocks = list(blocks) if self.budget is None or not retain_ms else \
            self.budget.admit(blocks, now + retain_ms / 1000.0, priority, now, self._let_go)
        if not retain_ms:
            for b in blocks:
                self._let_go(b)
            return blocks
        until = now + retain_ms / 1000.0
        for b in blocks:
            if b.retain_until > now:
                b.retain_until = max(b.retain_until, until)
                b.retain_priority = max(b.retain_priority, priority)
            else:
                b.retain_until, b.retain_priority = until, priority
            self.blocks[b] = None
            self.changed(b)
        self._soonest = min(self._soonest, until)
        self._live()  # (lets go of the blocks no tier holds any more once they are many)
        return blocks

    def _let_go(self, b: Block) -> None:
        """``b``'s retention ends now."""
        b.retain_until, b.retain_priority = 0.0, 0
        self.blocks.pop(b, None)
        if self.budget is not None:
            self.budget.release(b)
        self.changed(b)

    def adopt(self, b: Block) -> None:
        """``b`` came with a retention of its own (a peer's directory record), kept as far as
        the budget affords it."""
        now = self.clock()
        if self.budget is not None and b.retain_until > now and not self.budget.admit(
                [b], b.retain_until, b.retain_priority, now, self._let_go):
            b.retain_until, b.retain_priority = 0.0, 0
        if b.retain_until > now:
            self.blocks[b] = None
            self._soonest = min(self._soonest, b.retain_until)

    # --- the soft pin ---------------------------------------------------------------------------

    def pop_victim(self, policy: EvictionPolicy, ok: Callable[[Block], bool] | None) -> Block | None:
        """The policy's next victim among the blocks ``ok`` accepts (removed from the policy): an
        unretained one while there is any, else a retained one of the lowest priority there is."""
        pop = cast("Callable[[Eligible | None], Block | None]", policy.pop_victim)
        if not self._live():
            return pop(cast("Eligible | None", ok))
        now = self.clock()
        for p in range(-1, PRIORITIES):
            def may(b: Block, p: int = p) -> bool:
                return (b.retain_until <= now or b.retain_priority <= p) and (ok is None or ok(b))

            v = pop(cast("Eligible", may))
            if v is not None:
                self.evicted(v)
                return v
        return None

    def evicted(self, b: Block) -> None:
        """``b`` was picked as a victim (by :meth:`pop_victim` or another path): the budget
        counts it again."""
        if self.budget is not None:
            self.budget.left(b)

    def least(self, blocks: Iterable[Block]) -> Block | None:
        """The block of ``blocks`` to evict first by retention alone (an unretained one, else the
        lowest priority): for the spaces' fallbacks when the policy offers no victim."""
        if not self._live():
            return next(iter(blocks), None)
        now = self.clock()
        best, rank = None, PRIORITIES
        for b in blocks:
            r = b.retain_priority if b.retain_until > now else -1
            if r < rank:
                best, rank = b, r
                if r < 0:
                    break
        return best

    def _live(self) -> bool:
        """Whether any block is retained now (the retentions ended since are let go)."""
        if not self.blocks:
            return False
        now = self.clock()
        if now >= self._soonest or len(self.blocks) > self._prune_at:
            self.blocks = {b: None for b in self.blocks if b.retain_until > now and b.tiers}
            self._soonest = min((b.retain_until for b in self.blocks), default=math.inf)
            self._prune_at = 2 * len(self.blocks) + 1024
        return bool(self.blocks)

    # --- reporting ------------------------------------------------------------------------------

    def by_tier(self, now: float | None = None) -> dict[str, dict[str, int]]:
        """Retained bytes now, per tier label and tenant tag, of blocks some tier holds."""
        now = self.clock() if now is None else now
        out: dict[str, Counter[str]] = {}
        for b in self.blocks:
            if b.retain_until > now and b.tiers:
                for t in TIER_ORDER:
                    if b.tiers & t:
                        out.setdefault(t.label, Counter())[tenant(b)] += b.size
        return {t: dict(c) for t, c in out.items()}

    def count(self) -> int:
        """Blocks retained now that some tier holds."""
        now = self.clock()
        return sum(1 for b in self.blocks if b.retain_until > now and b.tiers)

    def snapshot(self) -> dict[str, object]:
        """The ``retained`` entry of /stats: blocks, and bytes per tier and tenant ("-": no salt)."""
        tiers = self.by_tier()
        return {
            "blocks": self.count(),
            "bytes": {t: sum(c.values()) for t, c in tiers.items()},
            "tenants": {t: {(k or "-"): n for k, n in c.items()} for t, c in tiers.items()},
            "bounds": dict(self.bounds),
            "refused": {(k or "-"): n for k, n in self.refused.items()},
            **({"budget": self.budget.snapshot()} if self.budget is not None else {}),
        }
