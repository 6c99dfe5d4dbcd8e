"""Replay a prefix-cache trace through the server's own Index, placement and eviction policies.

For each request, in timestamp order, the replay does what the store does:

1. Lookup: ``Index.leading_run`` over the prompt's keys. Those blocks are the prefix hits (a
   block present after a gap is counted as a block hit only: a prefix cache cannot use it).
2. ``policy.access`` for every hit block, deepest first (so an ancestor is never older than its
   descendants), in every tier space that holds it; hits in a lower tier are promoted into the
   top tier as the store's Acquire does: victims popped for all of them (the run pinned), then
   inserted root first, then the readable run touched again when that evicted.
3. After the request is served, each block of the prompt that no tier holds is stored: Index.add,
   victims popped until there is room (no admission filter, as in the store), then
   ``policy.insert`` with the parent Block when the parent is resident in the same space.
   Like the store, victims are popped at allocation time; at commit blocks are inserted root
   first (so each parent is there to link to), then ``access_many`` on them deepest first sets
   their recency (ancestors at least as recent as descendants).
4. Every space is brought within its capacity by the store's own rule (``evictions``, the loop
   of ``Space.victim`` and ``next_home`` that the store's level eviction runs): each victim goes
   where the store's movers pass it down, placed there at once (the movers queue a demotion and
   place it when its batch is written: the one difference, in ``_evicted``); each tier below makes
   room after each allocation, its new arrivals held (being written). A block that no tier holds
   is dropped from the Index.

Each tier space is the store's own :class:`~kvstore.store.books.placement.Space` (a
:class:`ReplaySpace`): a block enters and leaves it as it enters and leaves the store's DRAM or a
tier below it (the tier bit, the policy's insert linked to the parent, the index).
Capacities are block counts per tier space (fixed-size slots: a partial block takes a whole slot).
Block ``size`` is the block's token count, so policies can tell a partial tail from a full block.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kvstore.keys import BlockKey, NamespaceRoot
from kvstore.policy import make_policy
from kvstore.policy.base import Eligible, EvictionPolicy
from kvstore.sim.belady import HitRates
from kvstore.sim.hints import Hinting, Hints
from kvstore.sim.traces import Request, Trace
from kvstore.store.books.index import Block, Index, State, TierId
from kvstore.store.books.placement import Space, evictions

if TYPE_CHECKING:
    from kvstore.store.books.retention import Retention

PROGRESS_EVERY = 1024  # requests between progress-bar updates


def index_keys(req: Request) -> Sequence[BlockKey]:
    """The request's block keys as the Index takes them. A trace names its blocks by integer ids; the
    Index only hashes and compares keys, so the ids stand in for ``BlockKey`` as they are (making bytes
    of each would slow the replay and change no hit). This is the one place the replay says so."""
    return cast("Sequence[BlockKey]", req.keys)


@dataclass(slots=True)
class TierSpec:
    tier: TierId
    capacity: int  # blocks


@dataclass(slots=True)
class ReplayResult(HitRates):
    policy: str
    references: int = 0
    prefix_hits: int = 0
    block_hits: int = 0
    tier_prefix_hits: dict[str, int] = field(default_factory=dict)  # by the tier that served it
    seconds: float = 0.0
    hints: str = ""  # the --hints replayed ("" for none)
    retained_peak: int = 0  # with hints: the most blocks retained at once

    @property
    def refs_per_s(self) -> float:
        return self.references / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prefix_hit_rate": round(self.prefix_hit_rate, 6),
            "block_hit_rate": round(self.block_hit_rate, 6),
        }
        if len(self.tier_prefix_hits) > 1:
            refs = self.references or 1
            out["tiers"] = {t: {"prefix_hit_rate": round(h / refs, 6)} for t, h in self.tier_prefix_hits.items()}
        if self.hints:
            out["hints"] = self.hints
            out["retained_peak_blocks"] = self.retained_peak
        out["refs_per_s"] = round(self.refs_per_s)
        return out


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="ref", unit_scale=True, leave=False, mininterval=0.5)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def replay(
    trace: Trace,
    tiers: int | Sequence[TierSpec],
    policy: str | Sequence[EvictionPolicy] = "lru",
    progress: bool = False,
    hints: Hints | None = None,
    **policy_kwargs: object,
) -> ReplayResult:
    """Replay ``trace`` with one policy per tier space. ``tiers`` is a DRAM block count or a list
    of tier specs, top tier first; ``policy`` a registry name or ready policy objects (one per
    tier); ``hints``: the retention hints the trace implies (:mod:`kvstore.sim.hints`), kept by
    the store's soft pin in every space."""
    specs = [TierSpec(TierId.DRAM, tiers)] if isinstance(tiers, int) else list(tiers)
    if isinstance(policy, str):
        name = policy
        policies = [make_policy(policy, **policy_kwargs) for _ in specs]
    else:
        policies = list(policy)
        name = getattr(policies[0], "name", type(policies[0]).__name__)
    if len(policies) != len(specs):
        raise ValueError("replay: one policy per tier space")
    result = ReplayResult(name, tier_prefix_hits={s.tier.label: 0 for s in specs})
    hinting = Hinting(trace, hints) if hints is not None else None
    bar = Progress(trace.references, f"{name}", progress)
    t0 = time.perf_counter()
    try:
        if len(specs) == 1:
            _OneSpace(trace, specs[0], policies[0], hinting).run(trace, result, bar)
        else:
            _Tiered(trace, specs, policies, hinting, result.tier_prefix_hits).run(trace, result, bar)
    finally:
        bar.close()
    result.seconds = time.perf_counter() - t0
    if hinting is not None:
        result.hints, result.retained_peak = hinting.hints.label(), hinting.peak
    return result


class _Replay:
    """One replay's loop over the trace's requests, in timestamp order: the clock set for the
    hints, the request served by the store's calls (:meth:`serve`, the subclass's: one space or
    several), its retention hints given, the counts kept. The loop's state lives in slots, read
    as fast as locals; each step binds what it calls to locals once per request, and the
    per-reference loops stay inside one step."""

    __slots__ = ("blocks", "hinting", "hits", "index", "ns", "prefix", "retained", "retention")

    def __init__(self, trace: Trace, hinting: Hinting | None, retained: int, capacity: dict[int, int]) -> None:
        self.index = Index()
        self.ns = self.index.namespace(NamespaceRoot(b"replay"), trace.name)
        self.blocks = self.ns.blocks
        self.hinting = hinting
        self.retention = hinting.retention(capacity) if hinting is not None else None  # the store's soft pin
        if self.retention is not None:
            self.index.retained = self.retention.recount  # (its counts follow the placements, as the store's)
        self.retained = retained  # the tier bits whose blocks a request's hints retain
        self.prefix = self.hits = 0  # prefix hits, block hits

    def serve(self, req: Request, keys: Sequence[BlockKey]) -> None:
        """The store's calls for one request (counting its hits)."""
        raise NotImplementedError

    def run(self, trace: Trace, res: ReplayResult, bar: Progress) -> None:
        """Serve every request of ``trace`` in order; the counts into ``res``."""
        hinting, retention, blocks, retained = self.hinting, self.retention, self.blocks, self.retained
        serve = self.serve
        refs = 0
        for ri, req in enumerate(trace.requests):
            if hinting is not None:
                hinting.at(req, ri)
            keys = index_keys(req)
            refs += len(keys)
            serve(req, keys)
            if hinting is not None and retention is not None:
                hinting.retain(retention, ri, blocks, keys, retained)
            if ri % PROGRESS_EVERY == 0:
                bar.update(refs - res.references)
                res.references = refs
        bar.update(refs - res.references)
        res.references, res.prefix_hits, res.block_hits = refs, self.prefix, self.hits


class _OneSpace(_Replay):
    """One space, in the store's order of calls (kvstore/store/block_store.py): Lookup (leading run), the
    run's hits via ``access_many`` deepest first, Allocate (victims popped for every new block,
    blocks added ALLOCATED), then Commit (published and inserted root first, with the parent
    Block when the policy holds it, then ``access_many`` on them deepest first). The hot loop is kept
    lean: no per-reference allocation beyond the new Blocks themselves."""

    __slots__ = (
        "access_many",
        "add",
        "bt",
        "capacity",
        "drop",
        "label",
        "place",
        "placed",
        "publish",
        "space",
        "unplace",
    )

    def __init__(self, trace: Trace, spec: TierSpec, policy: EvictionPolicy, hinting: Hinting | None) -> None:
        super().__init__(trace, hinting, int(spec.tier), {int(spec.tier): spec.capacity})
        index = self.index
        space = ReplaySpace(spec, policy, index)
        self.add, self.drop, self.publish = index.add, index.drop, index.publish
        self.place, self.unplace, self.placed = space.place, space.unplace, space.sizes
        self.access_many = policy.access_many
        self.space = space
        self.capacity = spec.capacity
        self.bt = trace.block_tokens
        self.label = spec.tier.label

    def run(self, trace: Trace, res: ReplayResult, bar: Progress) -> None:
        super().run(trace, res, bar)
        res.tier_prefix_hits[self.label] = res.prefix_hits

    def serve(self, req: Request, keys: Sequence[BlockKey]) -> None:
        n = self.lookup(keys)
        new = self.allocate(req, keys, n)
        if new:
            self.commit(new)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Lookup: the leading run of ``keys`` (its length), each block a prefix hit, touched
        deepest first."""
        run = Index.leading_run(self.ns, keys)
        n = len(run)
        self.prefix += n
        self.hits += n
        if n:
            self.access_many(run[::-1])
            if self.retention is not None:
                self.retention.used(run)
        return n

    def allocate(self, req: Request, keys: Sequence[BlockKey], n: int) -> list[Block]:
        """Allocate: each key after the run of ``n`` that the index lacks, added ALLOCATED with
        victims popped until it has a slot (dropped when none is left to pop); the blocks allocated,
        root first. A key present behind the gap is a block hit only."""
        blocks, add, drop, committed = self.blocks, self.add, self.drop, State.COMMITTED
        space, retention, unplace, placed = self.space, self.retention, self.unplace, self.placed
        ns, capacity, bt, allocated = self.ns, self.capacity, self.bt, State.ALLOCATED
        hits = 0
        new: list[Block] = []

        def full() -> bool:  # no slot for one more: the placed, this allocation's
            return len(placed) + len(new) >= capacity

        nk = len(keys)
        last = nk - 1
        for i in range(n, nk):
            key = keys[i]
            if key in blocks:  # present behind a gap: a block hit, useless to this prefix
                hits += blocks[key].state is committed  # (visible)
                continue
            size = req.last_size if i == last else bt
            b = add(ns, key, keys[i - 1] if i else b"", size, allocated, i + 1)
            if capacity <= 0:
                drop(b)
                continue
            if full():
                for v, _ in evictions(space, full, retention, (), space.bit):  # (one space: nowhere below)
                    unplace(v)  # (each victim frees its slot)
                if full():
                    drop(b)
                    continue
            new.append(b)
        self.hits += hits
        return new

    def commit(self, new: list[Block]) -> None:
        """Commit: ``new`` published and placed root first (so each parent is there to link to),
        then touched deepest first (ancestors at least as recent as descendants)."""
        publish, place = self.publish, self.place
        for b in new:
            publish(b)
            place(b)
        self.access_many(new[::-1])
        if self.retention is not None:
            self.retention.stored(new)


class ReplaySpace(Space):
    """A replayed tier space: the store's placement (:class:`~kvstore.store.books.placement.Space`, a
    block taking its token count), with a capacity in blocks (``len(sizes)`` counts them) and the
    spaces below it."""

    __slots__ = ("below", "capacity", "under")
    policy: EvictionPolicy  # always one here
    down: ClassVar[bool] = False  # a replayed tier never has an outage (:class:`~kvstore.store.books.placement.Home`)

    def __init__(self, spec: TierSpec, policy: EvictionPolicy, index: Index) -> None:
        super().__init__(int(spec.tier), policy, index)
        self.capacity = spec.capacity
        self.below: ReplaySpace | None = None  # the next space down
        self.under: tuple[ReplaySpace, ...] = ()  # every space below, fastest first


def _evicted(sp: ReplaySpace, v: Block, home: ReplaySpace | None, arrivals: dict[ReplaySpace, list[Block]]) -> None:
    """``v`` leaves ``sp`` for ``home``, where the store's movers pass it down (:func:`evictions`'
    answer; a space of no capacity takes nothing), then leaves ``sp`` (and the index, when no
    space holds it)."""
    if home is not None and home.capacity > 0:
        home.place(v)  # the one difference: the store queues the demotion and places it when its batch is written
        arrivals.setdefault(home, []).append(v)
    sp.unplace(v)


def _within(
    top: ReplaySpace,
    sp: ReplaySpace,
    n: int,
    retention: Retention | None,
    ok: Callable[[Block], bool] | None,
    arrivals: dict[ReplaySpace, list[Block]],
) -> None:
    """``sp`` brought within its capacity with room for ``n`` more by the store's capacity rule
    (:func:`~kvstore.store.books.placement.evictions`; ``ok``: which blocks may leave, None: any the
    policy offers), each victim passed down (:func:`_evicted`)."""

    def over() -> bool:
        return len(sp.sizes) + n > sp.capacity

    for v, home in evictions(sp, over, retention, sp.under, top.bit, ok):
        _evicted(sp, v, home, arrivals)


Pop = Callable[[EvictionPolicy, Callable[[Block], bool] | None], Block | None]


def plain_pop(policy: EvictionPolicy, ok: Callable[[Block], bool] | None) -> Block | None:
    """The policy's own victim (no retention hints: the soft pin's rule reduces to this)."""
    return cast("Block | None", policy.pop_victim(cast("Eligible | None", ok)))


def _allocate(top: ReplaySpace, n: int, pinned: Sequence[Block] = (), retention: Retention | None = None) -> int:
    """The store's slots for ``n`` blocks in the top space: victims popped until they fit (or none
    is left but ``pinned`` ones), each demoted; then every space below is brought within its
    capacity with its new arrivals and ``pinned`` held (being written, leased: the demotion
    writer's ``_make_room``), then, when only they are left, the oldest arrivals passed on. How
    many of the ``n`` fit. Every step is :func:`_within`, the store's capacity rule (with hints,
    ``retention``'s soft pin picks)."""
    arrivals: dict[ReplaySpace, list[Block]] = {}
    pins = set(pinned)
    ok = pins.__contains__
    unpinned = (lambda b: not ok(b)) if pins else None
    _within(top, top, n, retention, unpinned, arrivals)
    sp = top.below
    while sp is not None:
        held = [*arrivals.get(sp, []), *pinned]
        for b in held:
            sp.policy.hold(b)
        _within(top, sp, 0, retention, None, arrivals)
        for b in held:
            sp.policy.release(b)
        # Only arrivals left: the oldest are refused (passed on or dropped).
        _within(top, sp, 0, retention, unpinned, arrivals)
        sp = sp.below
    return max(0, min(n, top.capacity - len(top.sizes)))


def _touch(spaces: Sequence[ReplaySpace], run: Sequence[Block]) -> None:
    """The store's touch of a run: ``access_many`` deepest first, in each space on what it holds."""
    for sp in spaces:
        mine = [b for b in reversed(run) if b.tiers & sp.bit]
        if mine:
            sp.policy.access_many(mine)


class _Tiered(_Replay):
    """Several spaces, top (DRAM) first, inclusive of promoted copies, making the store's calls
    in the store's order (kvstore/store/block_store.py lookup, acquire, allocate, commit;
    kvstore/movers/tiering.py promote, demotion):

    1. Lookup: the run touched (``access_many`` deepest first, in each space on what it holds).
    2. Acquire: the run's blocks only below the top are promoted: victims popped for all of them
       (the run pinned), then inserted root first. When that evicted, the lookup's touch was
       applied before it and the acquire's touch of the readable run is applied too (the store
       buffers touches and skips a run touched twice in a row).
    3. Allocate: victims popped for all new blocks; Commit: inserted root first, then
       ``access_many`` deepest first.

    A victim of the top goes to the next space down at once (the movers place a demotion before
    it is written); the spaces below make room after each allocation, their arrivals held."""

    __slots__ = ("bt", "labels", "spaces", "tier_hits", "top")

    def __init__(
        self,
        trace: Trace,
        specs: Sequence[TierSpec],
        policies: Sequence[EvictionPolicy],
        hinting: Hinting | None,
        tier_hits: dict[str, int],
    ) -> None:
        super().__init__(trace, hinting, ~0, {int(s.tier): s.capacity for s in specs})
        spaces = [ReplaySpace(s, p, self.index) for s, p in zip(specs, policies)]
        for i, (upper, lower) in enumerate(itertools.pairwise(spaces)):
            upper.below, upper.under = lower, tuple(spaces[i + 1 :])
        self.spaces, self.top = spaces, spaces[0]
        self.labels = [(int(s.tier), s.tier.label) for s in specs]
        self.tier_hits = tier_hits  # prefix hits by the tier that served them
        self.bt = trace.block_tokens

    def serve(self, req: Request, keys: Sequence[BlockKey]) -> None:
        run = self.lookup(keys)
        if run:
            self.acquire(run)
        new = self.allocate(req, keys, len(run))
        if new:
            self.commit(new)

    def lookup(self, keys: Sequence[BlockKey]) -> list[Block]:
        """Lookup: the leading run of ``keys``, each block a prefix hit of the highest tier that
        holds it, the run touched."""
        run = self.index.leading_run(self.ns, keys)
        n = len(run)
        self.prefix += n
        self.hits += n
        labels, tier_hits = self.labels, self.tier_hits
        for b in run:
            for t, label in labels:
                if b.tiers & t:
                    tier_hits[label] += 1
                    break
        if n:
            _touch(self.spaces, run)
            if self.retention is not None:
                self.retention.used(run)
        return run

    def acquire(self, run: list[Block]) -> None:
        """Acquire: the run's blocks only below the top promoted (slots for all, the run pinned,
        then placed root first), and the readable run touched again when that evicted."""
        top = self.top
        up = [b for b in run if not b.tiers & top.bit]
        if not up:
            return
        evicts = len(top.sizes) + len(up) > top.capacity
        room = _allocate(top, len(up), run, self.retention)
        for b in up[:room]:
            top.place(b)
        readable = list(itertools.takewhile(lambda b: bool(b.tiers & top.bit), run))
        if evicts or readable != run:
            _touch(self.spaces, readable)

    def allocate(self, req: Request, keys: Sequence[BlockKey], n: int) -> list[Block]:
        """Allocate: each key after the run of ``n`` that the index lacks, added ALLOCATED; slots
        for all of them in the top space, the ones that do not fit dropped. The blocks allocated,
        root first. A key present behind the gap is a block hit only."""
        blocks, index, ns, bt, allocated = self.blocks, self.index, self.ns, self.bt, State.ALLOCATED
        nk = len(keys)
        hits = 0
        new: list[Block] = []
        for i in range(n, nk):
            key = keys[i]
            if key in blocks:
                hits += 1
                continue
            size = req.last_size if i == nk - 1 else bt
            new.append(index.add(ns, key, keys[i - 1] if i else b"", size, allocated, i + 1))
        self.hits += hits
        if new:
            top = self.top
            room = _allocate(top, len(new), retention=self.retention) if top.capacity > 0 else 0
            for b in new[room:]:
                index.drop(b)
            del new[room:]
        return new

    def commit(self, new: list[Block]) -> None:
        """Commit: ``new`` published and placed in the top space root first (so each parent is
        there to link to), then touched deepest first."""
        index, top = self.index, self.top
        for b in new:
            index.publish(b)
            top.place(b)
        top.policy.access_many(new[::-1])
        if self.retention is not None:
            self.retention.stored(new)
