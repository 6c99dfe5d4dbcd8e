"""Retention hints a trace implies: ``kvstore replay TRACE --hints continuation[:SECONDS]``.

An agent framework that ends a turn in a tool call knows the conversation will come back with this
turn's prompt and output as the next prompt's prefix. The replay gives each such request the hint
the framework would: retain its blocks for SECONDS (default 60) from its end, through the store's
own soft pin (:class:`~kvstore.store.books.retention.Retention`).

The rule on a Mooncake trace, whose ``hash_ids`` name the prompt's blocks only (an id names a
whole prefix, so equal ids at a position mean equal prefixes):

* request A is *continued* when a later request B starts with A's **full** prompt blocks
  (``input_length // block_tokens`` of them; A's partial last block is re-keyed once B's tokens
  fill it, so B never repeats its id) and B's prompt is at least as long as A's prompt plus A's
  output (``input_length + output_length``: A's whole turn is B's prefix, not just its prompt);
* A retains those full blocks (the ones B will use). The trace names no block of A's output
  (it is generated, not hashed), so no output block is retained or stored: B stores the blocks
  that cover A's tail and output as its own new blocks, as the replay stores every prompt;
* the trace has arrival times only, and the replay serves a request at once, so A's *end* is
  its timestamp: the retention lasts until ``timestamp + SECONDS``, on the trace's clock.

Only the first later request that continues A counts (the next turn); a request whose prompt
has no full block retains nothing.

``until-continued[:SECONDS]``, a variant: the retention also ends when the continuation is
served (the framework knows its tool call returned, and the next turn says ``Retain(keys, 0)``
for the earlier turn's blocks after its save, then retains what it needs with its own hint: the
connectors' hint of 0, connector/roles/hints.py). As the sidecar's ``Retain(keys, 0)`` does, it
ends the retention of every one of those blocks, also where another request's hint extended it (a
shared system prompt): the sidecar keeps one retention per block, not one per hint. And as that
call does, it acts on the cache that serves the next turn only: in a cluster replay whose routing
sends it elsewhere, the earlier turn's node keeps its copies retained until their time runs out.

``until-returned[:SECONDS]``, the other way to end it: the framework itself says ``Retain(keys, 0)``
to the sidecar that served the earlier turn (it routed the turn, so it knows which) when the tool
call returns, at the next turn's arrival, before it is served: on all the turn's blocks in that
cache, and in no other (copies other nodes fetched keep theirs). Under routing that sends a
continuation to its prefix the two are one cache; under round-robin they are not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.config import RETAINED_ADAPTIVE, RETAINED_FRACTION, TenantsConfig
from kvstore.errors import InvalidArgument
from kvstore.sim.traces import Request, Trace
from kvstore.store.books.hint_budget import HintBudget
from kvstore.store.books.index import Block, TierId
from kvstore.store.books.retention import Retention

KINDS = ("continuation", "until-continued", "until-returned")
ENDS = {"until-continued": "next-turn", "until-returned": "origin"}  # where the retention is ended
DEFAULT_SECONDS = 60.0


@dataclass(slots=True, frozen=True)
class Hints:
    kind: str
    seconds: float
    end: str = ""  # the variants: "next-turn" or "origin" (:data:`ENDS`); "": the retention runs out
    retained_fraction: float = RETAINED_FRACTION  # the replayed sidecar's budget for hints (1: none)
    adaptive: bool = RETAINED_ADAPTIVE  # tenants.retained_adaptive: the share scaled per node by what hints were worth

    @property
    def retain_ms(self) -> int:
        return round(self.seconds * 1000)

    def label(self) -> str:
        return f"{self.kind}:{self.seconds:g}"


def parse_hints(text: str) -> Hints:
    """``continuation`` or ``continuation:SECONDS``."""
    kind, sep, secs = text.partition(":")
    if kind not in KINDS:
        raise InvalidArgument(f"--hints: unknown kind {kind!r}; allowed: {list(KINDS)} (KIND[:SECONDS])")
    try:
        seconds = float(secs) if sep else DEFAULT_SECONDS
    except ValueError:
        raise InvalidArgument(f"--hints: {secs!r} is not a number of seconds") from None
    if not 0 < seconds <= 86_400:
        raise InvalidArgument(f"--hints: seconds must be in (0, 86400], got {secs}")
    return Hints(kind, seconds, end=ENDS.get(kind, ""))


def full_blocks(trace: Trace, i: int) -> int:
    """Request ``i``'s full prompt blocks (its partial last one excluded)."""
    r = trace.requests[i]
    return len(r.keys) - (r.last_size < trace.block_tokens)


def continuations(trace: Trace) -> list[int]:
    """Per request, how many of its leading blocks a later request continues (0: none), by the
    module's rule."""
    return [n for n, _ in continued_by(trace)]


def continued_by(trace: Trace) -> list[tuple[int, int]]:
    """Per request, (how many of its leading blocks a later request continues, that request's
    index); (0, -1): none. One pass: a request waits on (position, id) of its last full block."""
    reqs, bt = trace.requests, trace.block_tokens
    out = [(0, -1)] * len(reqs)
    waiting: dict[tuple[int, int], list[int]] = {}
    for j, r in enumerate(reqs):
        length = (len(r.keys) - 1) * bt + r.last_size
        for pos, key in enumerate(r.keys):
            waits = waiting.get((pos, key))
            if not waits:
                continue
            left = []
            for i in waits:
                a = reqs[i]
                if length >= (len(a.keys) - 1) * bt + a.last_size + a.output_length:
                    out[i] = (pos + 1, j)
                else:
                    left.append(i)  # B shares A's prompt but not A's turn: not A's continuation
            if left:
                waiting[pos, key] = left
            else:
                del waiting[pos, key]
        n = full_blocks(trace, j)
        if n:
            waiting.setdefault((n - 1, r.keys[n - 1]), []).append(j)
    return out


class TraceClock:
    """The trace's clock in seconds, for the store's :class:`Retention` (set per request)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Hinting:
    """The hints of one replay: which requests retain how many leading blocks, on the trace's
    clock, and the peak of blocks retained (in any node's cache)."""

    def __init__(self, trace: Trace, hints: Hints) -> None:
        self.hints = hints
        self.fraction = hints.retained_fraction  # tenants.retained_fraction (kvstore/store/books/hint_budget.py)
        self.bt = trace.block_tokens
        links = continued_by(trace)
        self.keep = [n for n, _ in links]
        self.ends: dict[int, list[int]] = {}  # request -> the earlier ones it continues
        for i, (_, j) in enumerate(links):
            if j >= 0:
                self.ends.setdefault(j, []).append(i)
        self.held: dict[int, list[bytes]] = {}  # request -> the keys it retained, until its next turn
        # with until-returned, request -> the cache that served it (popped with ``held``)
        self.origin: dict[int, tuple[Retention, Mapping[bytes, Block]]] = {}
        self.clock = TraceClock()
        self.peak = 0  # blocks retained at once, at most (summed over the nodes)
        self.retentions: list[Retention] = []

    def retention(self, capacity: Mapping[int, int]) -> Retention:
        """A cache's retention on the trace's clock (one per node), with the sidecar's budget for
        hints over its spaces' ``capacity`` (tier bit -> blocks; a block's size is its tokens)."""
        totals = TenantsConfig(retained_fraction=self.fraction).retained_totals(
            {TierId(t).label: n * self.bt for t, n in capacity.items()})
        budget = HintBudget(totals, self.fraction, self.hints.adaptive) if totals else None
        r = Retention(self.clock, budget=budget)
        self.retentions.append(r)
        return r

    def at(self, req: Request, j: int) -> None:
        """The clock stands at ``req`` (request ``j``)'s arrival while it is served; with
        ``until-returned``, the requests it continues end their retention now, in the caches that
        served them (the framework's Retain(keys, 0) there: on all their blocks, as the sidecar
        ends it)."""
        self.clock.now = req.timestamp / 1000.0
        if self.hints.end == "origin":
            for a in self.ends.get(j, ()):
                keys = self.held.pop(a, None)
                if keys is not None:
                    _end(*self.origin.pop(a), keys)

    def retain(self, retention: Retention, i: int, blocks: Mapping[bytes, Block], keys: Sequence[bytes],
               tier: int) -> None:
        """Request ``i``, served by the cache of ``retention`` and ``blocks``: with
        ``until-continued``, the requests it continues end their retention in that cache
        first (the framework's Retain(keys, 0) after the save: on all their blocks held there, as
        the sidecar ends it, and in no other cache); then it retains its continued blocks that
        ``tier`` of this cache holds."""
        if self.hints.end == "next-turn":
            for a in self.ends.get(i, ()):
                ended = self.held.pop(a, None)
                if ended is not None:
                    _end(retention, blocks, ended)
        n = self.keep[i]
        if not n:
            return
        held = [b for k in keys[:n] if (b := blocks.get(k)) is not None and b.tiers & tier]
        retention.retain(held, self.hints.retain_ms, 0)
        if self.hints.end:
            self.held[i] = list(keys[:n])
        if self.hints.end == "origin":
            self.origin[i] = (retention, blocks)
        self.peak = max(self.peak, sum(r.count() for r in self.retentions))


def _end(retention: Retention, blocks: Mapping[bytes, Block], keys: Sequence[bytes]) -> None:
    """The framework's ``Retain(keys, 0)`` on one cache: the retention of every block of ``keys``
    it holds, in any tier, ends (as :meth:`kvstore.store.block_store.BlockStore.retain` ends it)."""
    retention.retain([b for k in keys if (b := blocks.get(k)) is not None and b.tiers], 0, 0)
