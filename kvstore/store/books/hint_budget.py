"""What a retention hint may hold: the share of each tier that all retained blocks may take.

A hint is a client's guess that it will come back; the cache pays for it with room the policy
would have given to blocks that are being used. On long agentic prompts one turn is a large share
of a small cache, a hundred turns wait on tool calls at once, and a cache that keeps every hinted
turn keeps turns that return after they would have been evicted anyway while the turns and shared
prefixes in use go (docs/eviction.md, "Hints the cache can afford"). And a salt is free, so
per-tenant bounds alone let many salts retain the whole cache. So the sidecar judges each hint
against one total bound per tier (:class:`HintBudget`), the one place of that decision, which
:class:`~kvstore.store.books.retention.Retention` asks before it retains anything:

* in each tier with a capacity (DRAM, the SSD), retained blocks together take at most
  ``tenants.retained_fraction`` of it (the rest stays in the policy's own order;
  :meth:`kvstore.config.TenantsConfig.retained_totals`), with ``tenants.retained_adaptive``
  scaled by what this node's hints were worth so far (:class:`~kvstore.store.books.hint_worth.HintWorth`:
  the whole share where they paid an eighth of what they cost, none at a sixteenth); a share that
  shrank ends retentions at once (:meth:`HintBudget.trim`);
* a hint that does not fit is **shortened** to its leading blocks that do (a prefix hit needs the
  leading run, so what lies past a block the cache cannot keep is worth nothing to it), and is
  **refused** when not one fits; blocks it already retains cost nothing more. Neither is an
  error: the call succeeds, and ``Retain`` answers how many blocks it holds;
* a hint may make room by ending retentions of a **lower priority** than its own: the lowest
  priority first, the earliest end first. Among equal priorities the retentions held are kept
  (first come): a hint the cache accepted is honoured until it ends, runs out, or its block
  leaves the tier. Letting the newest hint push out the oldest would keep only the last few
  turns, which the policy keeps anyway;
* every other way a block comes to be retained in a tier (a peer's record adopted, a promotion,
  a demotion) is held to the same rule, one block at a time (:meth:`HintBudget.fits`); past it
  the block is placed unretained.

The bytes it judges against are the retention's own counts per tier, kept incrementally as blocks
gain or lose a retention or a tier (``Retention.held_in``, its one ledger), and the room it makes comes off the
retention's heaps of ends per priority: a hint costs O(its blocks), and each retention ended to
make room O(log n), however many blocks are retained.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvstore.store.books.hint_worth import HintWorth
from kvstore.store.books.index import Block
from kvstore.tier_table import BIT_NAMES

if TYPE_CHECKING:
    from kvstore.store.books.retention import Retention

_TIERS = BIT_NAMES  # (bit, label) of every tier (kvstore/tier_table.py, a registered one's too)


class HintBudget:
    """All tenants' retained bytes per tier label within ``totals`` (bytes; a tier not named is
    not bounded) scaled by what this node's hints were worth (:class:`HintWorth`; ``adapt``
    False: not scaled, the fixed share alone), ``fraction`` being the share of each tier's
    capacity that gave them."""

    def __init__(self, totals: Mapping[str, int], fraction: float, adapt: bool = True) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"retained_fraction: {fraction} is outside 0..1")
        self.totals = dict(totals)
        self.fraction = fraction
        # What this node's hints were worth: its bounds now are ``totals`` x ``worth.scale``.
        bound = max(1, next(iter(self.totals.values()), 1))
        self.worth = HintWorth(bound, int(bound / fraction) if fraction else bound, adapt)
        self.shortened = 0  # hints cut to the leading blocks that fit
        self.refused = 0  # hints of which not one new block fit, and blocks that came retained and did not

    def _need(self, b: Block, tiers: int) -> dict[str, int]:
        """The bytes ``b`` takes in the bounded tiers of ``tiers``."""
        return {label: b.size for bit, label in _TIERS if tiers & bit and label in self.totals}

    def admit(self, r: Retention, blocks: list[Block], priority: int, into: int, now: float,
              until: float) -> list[Block]:
        """The leading blocks of ``blocks`` (no key twice) that a hint at ``priority`` until
        ``until`` may retain in ``r``; ``into``: tier bits they are about to enter. Room made from
        lower priorities is made now (their retentions ended); the blocks' own bytes are counted
        as they are retained. The rest are the worth's ``wanted`` (:meth:`HintWorth.cut`)."""
        if not self.totals:
            return blocks
        self.trim(r, now)
        r.work["summed"] += len(blocks)  # (the hint's own blocks: what it costs, however many are retained)
        adding: dict[str, int] = {}
        hint: set[Block] | None = None
        for i, b in enumerate(blocks):
            if b.retain_until > now:
                continue  # retained already: costs nothing more
            need = self._need(b, b.tiers | into)
            for label, n in need.items():
                need[label] = n + adding.get(label, 0)
            if not self._short(r, need):
                adding.update(need)
                continue
            if hint is None:
                hint = set(blocks)
            if self._room(r, need, priority, now, hint):
                adding.update(need)
                continue
            if i:
                self.shortened += 1
            else:
                self.refused += 1
            self.worth.cut((x for x in blocks[i:] if x.retain_until <= now), until)
            return blocks[:i]
        return blocks

    def trim(self, r: Retention, now: float) -> None:
        """The node's hints were worth less than the retentions it holds (:class:`HintWorth`):
        end retentions, the lowest priority first, the earliest end first, until what is held
        fits the bounds as they are now (a share that shrank takes effect at once, not as the
        retentions held end)."""
        worth = self.worth
        if worth.room < worth.bound:
            need = dict.fromkeys(self.totals, 0)
            if self._short(r, need):
                self._room(r, need, len(r.ends), now, set())

    def fits(self, r: Retention, b: Block, gained: int) -> bool:
        """Whether retained ``b`` may keep its retention in the tiers of ``gained`` it enters
        (a promotion, a demotion, an adoption), after making room from lower priorities than its
        own; counted as refused where it may not."""
        if not self.totals:
            return True
        need = self._need(b, gained)
        if not self._short(r, need) or self._room(r, need, b.retain_priority, r.clock(), {b}):
            return True
        self.refused += 1
        return False

    def _short(self, r: Retention, need: Mapping[str, int]) -> list[str]:
        """The tiers where ``need`` more bytes do not fit now."""
        held, limit, totals = r.held_in, self.worth.limit, self.totals
        return [t for t, n in need.items() if held(t) + n > limit(totals[t])]

    def _room(self, r: Retention, need: Mapping[str, int], priority: int, now: float, keep: set[Block]) -> bool:
        """Whether ``need`` more bytes fit in every tier they are for, after ending retentions of a
        lower priority than ``priority`` (lowest first, earliest end first; never one of ``keep``)
        that are counted in a tier where they do not."""
        short = self._short(r, need)
        limit = self.worth.limit
        if any(need[t] > limit(self.totals[t]) for t in short):
            return False
        bits = sum(bit for bit, label in _TIERS if label in short)
        for p in range(priority):
            skipped: list[tuple[float, int, Block]] = []
            while short and r.ends[p]:
                entry = heapq.heappop(r.ends[p])
                r.work["examined"] += 1
                until, _, b = entry
                if b not in r.counted or b.retain_priority != p or b.retain_until <= now:
                    continue  # a stale entry: ended, run out, or risen to another heap
                if until != b.retain_until:  # extended since: it waits for its new end
                    r.wait(b)
                    continue
                if b in keep or not r.counted[b] & bits:
                    skipped.append(entry)
                    continue
                r.end(b, returned=False)
                short = self._short(r, need)
                bits = sum(bit for bit, label in _TIERS if label in short)
            for entry in skipped:
                heapq.heappush(r.ends[p], entry)
            if not short:
                return True
        return False

    def snapshot(self) -> dict[str, object]:
        """The budget's part of /stats' ``retained``: the fraction, hints shortened and refused."""
        return {"fraction": self.fraction, "shortened": self.shortened, "refused": self.refused,
                "worth": self.worth.snapshot()}
