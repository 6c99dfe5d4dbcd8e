"""Cluster replay: a trace over N nodes, each with the sidecar's own index and eviction policy.

``kvstore replay TRACE --nodes N --routing round-robin|random|prefix`` runs three models of the
same N × capacity blocks, all on the replay's cache model (:mod:`kvstore.sim.replay`: an
``Index`` per node and a ``ReplaySpace`` of one policy, the store's placement), making the store's
calls in the store's order as the single-space replay does (``Node.allocate`` pops victims until a
request's blocks fit, ``Node.commit`` places them root first with their parents, then
``access_many`` deepest first):

* **isolated**: every node its own cache; a request hits only what its node holds;
* **cluster**: a directory of which node holds each committed block, and peer fetch. A request's
  prefix runs on through blocks that another node holds (peer hits); those blocks are fetched and
  kept locally as replicas, counted against the fetching node's capacity, and the read counts as
  an access on the holder's policy (the holder serves it). Eviction prefers a block that another
  node also holds (the policy's own order, restricted to replicated blocks: the policy's
  ``eligible`` filter), so a replica goes before any block's last copy. With retention hints
  the spare copies still go in the policy's order, a retained one handing its retention to the
  copies left (:meth:`Directory.hand_on`), and last copies by the store's soft pin. The
  directory also keeps the cluster's ghost, as the sidecar's does (kvstore/cluster/node.py): a node that lets a block go
  leaves its use count there (the policy's ``uses``; 0, nothing, for LRU), and the next node to store
  it takes the count and resumes it (``resume``). An entry lasts as long as the sidecar's ``g:`` key
  would in Redis, in the trace's own time (its requests' timestamps): about as long as the node's
  own ghost would keep it at the rate the node lets blocks go, at most ``cluster.ghost_ttl_s``
  (:class:`~kvstore.policy.ghost.GhostSpan`);
* **global**: one cache of N × the capacity that sees every request (routing cannot matter).

Each request, on its node (with one node, exactly the single-space replay's calls):

1. the usable prefix: the leading run of its keys that the node holds, continued (cluster only)
   through keys that another node holds;
2. ``access`` on each block of that run, deepest first, in the policy of the node that holds it;
3. the peer blocks are placed locally, root first (replicas), as the store's peer fetch does:
   room made for all of them, then inserted, with no commit ``access``;
4. each key after the run that no node holds is allocated and committed (a key held behind the
   gap is a block hit, useless to the prefix, and is not stored again).

Routing: ``round-robin``, ``random`` (seeded), or ``prefix``: :func:`kvstore.routing.rank` over each
node's usable prefix (local blocks as ``dram``; in the cluster, blocks another node holds as
``peer``) and the requests each node has served so far. ``rank`` breaks a tie of score and load by
node index; with ``tie_seed`` each such tie is drawn at random instead (seeded): another, equally
valid order of the same routing, to show how much of a result is that draw. (A fixed renaming of
the nodes would change nothing: they start alike, so it gives the same run under other names.)
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, cast

from kvstore.config import ClusterConfig
from kvstore.keys import BlockKey, NamespaceRoot
from kvstore.policy import make_policy
from kvstore.policy.base import Eligible, EvictionPolicy, Item
from kvstore.policy.ghost import GHOST_MIN_USES, GhostSpan
from kvstore.policy.tree import PrefixLinks
from kvstore.routing import MAX_IMBALANCE, ROUTINGS, rank
from kvstore.sim.belady import HitRates
from kvstore.sim.hints import Hinting, Hints
from kvstore.sim.replay import PROGRESS_EVERY, Pop, Progress, ReplaySpace, TierSpec, index_keys, plain_pop
from kvstore.sim.traces import Request, Trace
from kvstore.store.books.index import DRAM, Block, Index, NsEntry, State, TierId
from kvstore.store.books.placement import evictions
from kvstore.store.books.retention import Retention

MODES = ("isolated", "cluster", "global")
GHOST_TTL_S: float = ClusterConfig.model_fields["ghost_ttl_s"].default  # the sidecar's default
CommitSpec = tuple[BlockKey, bytes, int, int]  # a block Node.commit adds: key, parent key, size, depth


class Directory:
    """Which nodes hold each committed block. It tells a node's policy when one of its blocks gains
    or loses its last other copy."""

    __slots__ = ("ghost", "ghost_ttl_s", "holders", "now_ms", "policies", "spans", "visible")

    def __init__(self, ghost_ttl_s: float = 0.0) -> None:
        self.holders: dict[BlockKey, list[int]] = {}
        self.policies: list[ClusterPolicy] = []
        self.visible: list[Mapping[bytes, Block]] = []  # each node's committed blocks by key
        # the cluster's ghost: key -> (uses, expiry in the trace's ms), oldest write first
        self.ghost: OrderedDict[BlockKey, tuple[int, float]] = OrderedDict()
        self.ghost_ttl_s = ghost_ttl_s  # the ceiling (0: no ghost)
        self.spans: list[GhostSpan] = []  # each node's let-go rate
        self.now_ms = 0  # the timestamp of the request being served

    def join(self, node: Node, prefer_replicas: bool = True) -> None:
        """Wrap the node's policy in a :class:`ClusterPolicy` and register it."""
        pol = ClusterPolicy(node.space.policy, node.id, self, prefer_replicas)
        node.space.policy = pol
        node.victims_by(pol)
        self.policies.append(pol)
        self.spans.append(GhostSpan())
        self.visible.append(node.ns.visible)

    def copies(self, key: BlockKey) -> int:
        return len(self.holders.get(key, ()))

    def add(self, key: BlockKey, node: int) -> int:
        """``node`` now holds ``key``: the use count the cluster's ghost kept of it, taken (0: none)."""
        held = self.holders.setdefault(key, [])
        held.append(node)
        if len(held) == 2:
            self._replicated(held[0], key, True)
        if len(held) >= 2:
            self._replicated(node, key, True)
        if not self.ghost_ttl_s:
            return 0
        kept = self.ghost.pop(key, None)
        return kept[0] if kept is not None and kept[1] > self.now_ms else 0

    def let_go(self, key: BlockKey, node: int, uses: int, entries: int) -> None:
        """``node`` no longer holds ``key``, with ``uses`` remembered by a ghost of ``entries``:
        kept for the next holder as the sidecar keeps it (the rule,
        :data:`~kvstore.policy.ghost.GHOST_MIN_USES`; the time, :class:`GhostSpan`)."""
        if not self.ghost_ttl_s or not entries:
            return
        span = self.spans[node]
        span.let_go(1, self.now_ms / 1000)
        if uses >= GHOST_MIN_USES:
            ghost = self.ghost
            ghost[key] = (uses, self.now_ms + 1000 * span.ttl_s(entries, self.ghost_ttl_s))
            ghost.move_to_end(key)
            while ghost:  # the expired at the front go (one written later may outlive one in front)
                first, (_, expiry) = next(iter(ghost.items()))
                if expiry > self.now_ms:
                    break
                del ghost[first]

    def remove(self, key: BlockKey, node: int) -> None:
        held = self.holders[key]
        held.remove(node)
        if not held:
            del self.holders[key]
        elif len(held) == 1:
            self._replicated(held[0], key, False)

    def _replicated(self, node: int, key: BlockKey, yes: bool) -> None:
        block = self.visible[node][key]
        self.policies[node].replicated(block, yes)

    def hand_on(self, b: Block, node: int) -> None:
        """``node`` lets go of ``b`` while it is retained: the other holders' copies take its
        retention (the later end, the higher priority, as a second hint would give), so a spare
        copy leaving takes neither the block nor its retention out of the cluster."""
        for h in self.holders.get(b.key, ()):
            retention = self.policies[h].retention
            if h == node or retention is None:
                continue
            retention.inherit(self.visible[h][b.key], b.retain_until, b.retain_priority)


class ClusterPolicy:
    """One node's policy with the cluster's eviction preference: the victim is the policy's own
    choice among this node's *spare* blocks (leaves here that another node holds too), or the
    policy's own choice among all when there is none; every block that leaves goes out of the
    directory. The policy orders everything; this only keeps the set of spare blocks (prefix
    links as the policies keep them, :class:`~kvstore.policy.tree.PrefixLinks`) and offers it as
    the policy's ``eligible`` filter."""

    name: ClassVar[str] = "cluster"

    def __init__(self, inner: EvictionPolicy, node: int, directory: Directory, prefer_replicas: bool = True) -> None:
        self.inner = inner
        self.node = node
        self.directory = directory
        self.prefer = prefer_replicas
        self.links = PrefixLinks()
        self.spare: set[Item] = set()
        self.pop: Pop = plain_pop  # the node's victim rule among last copies (the soft pin with hints)
        self.retention: Retention | None = None  # with hints: the node's retained blocks
        self.access = inner.access
        self.access_many = inner.access_many
        self.hold = inner.hold
        self.release = inner.release
        self.uses = inner.uses
        self.resume = inner.resume
        self.ghost_size = inner.ghost_size

    def insert(self, item: Item, parent: Item | None, depth: int, size: int) -> None:
        self.inner.insert(item, parent, depth, size)
        links = self.links
        if item in links:
            return
        if parent is not None and parent in links:
            links.link(item, parent)
            self.spare.discard(parent)  # no longer a leaf here
        else:
            links.link(item, None)

    def insert_many(
        self, items: Sequence[Item], parents: Sequence[Item | None], depths: Sequence[int], sizes: Sequence[int]
    ) -> None:
        for item, parent, depth, size in zip(items, parents, depths, sizes, strict=True):
            self.insert(item, parent if parent is not None and parent in self else None, depth, size)

    def replicated(self, item: Item, yes: bool) -> None:
        """The directory's news: another node now holds ``item`` too (or no other node does)."""
        if not yes:
            self.spare.discard(item)
        elif self.prefer and item not in self.links.kids:
            self.spare.add(item)

    def pop_victim(self, eligible: Eligible | None = None) -> Item | None:
        """The spare blocks first, in the policy's own order, then any by the node's rule (with
        retention hints, the store's soft pin). A spare copy is not the block's last, and a
        retained one hands its retention to the other copies as it goes (:meth:`Directory.hand_on`),
        so the cluster loses neither the block nor its retention by it: the soft pin has nothing
        to keep among spare copies, and reordering them by retention only moved other blocks'
        hits (docs/eviction.md, "Retention hints")."""
        victim: Item | None = None
        if self.spare:
            spare = self.spare.__contains__
            victim = plain_pop(self.inner, spare if eligible is None else (lambda b: spare(b) and eligible(b)))
            retention = self.retention
            if victim is not None and retention is not None and victim.retain_until <= retention.clock():
                retention.evicted(victim)  # (counted as the node's victims are: hint_worth.py)
        if victim is None:
            pop = cast("Callable[[EvictionPolicy, Eligible | None], Item | None]", self.pop)
            victim = pop(self.inner, eligible)
        if victim is not None:
            self._left(victim, self.inner.uses(victim))  # (from its ghost now)
        return victim

    def remove(self, item: Item) -> None:
        if item in self.inner:
            uses = self.inner.uses(item)
            self.inner.remove(item)
            self._left(item, uses)

    def _left(self, item: Item, uses: int) -> None:
        links = self.links
        parent = links.parent.get(item)
        links.unlink(item)
        self.spare.discard(item)
        retention = self.retention
        if retention is not None and item.retain_until > retention.clock():  # type: ignore[attr-defined]  # a Block
            self.directory.hand_on(cast(Block, item), self.node)
        self.directory.remove(item.key, self.node)  # type: ignore[attr-defined]  # policy items are Blocks
        self.directory.let_go(item.key, self.node, uses, self.inner.ghost_size())  # type: ignore[attr-defined]
        if (
            self.prefer
            and parent is not None
            and parent not in links.kids  # no child left here
            and self.directory.copies(parent.key) > 1  # type: ignore[attr-defined]  # a Block
        ):
            self.spare.add(parent)  # a leaf again

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, item: object) -> bool:
        return item in self.inner


class Node:
    """One sidecar's index and DRAM space."""

    __slots__ = ("id", "index", "ns", "pick", "requests", "retention", "space")

    def __init__(
        self, node_id: int, capacity: int, policy: EvictionPolicy, label: str, retention: Retention | None = None
    ) -> None:
        self.id = node_id
        self.index = Index()
        self.ns: NsEntry = self.index.namespace(NamespaceRoot(b"replay"), label)
        self.space = ReplaySpace(TierSpec(TierId.DRAM, capacity), policy, self.index)
        self.requests = 0
        self.retention = retention  # with hints: the store's soft pin picks the victims
        if retention is not None:
            self.index.retained = retention.recount  # (its counts follow the placements, as the store's)
        # Whose soft pin Allocate's victim rule picks through (Space.victim); None: the policy's own pick.
        self.pick: Retention | None = retention

    def victims_by(self, policy: ClusterPolicy) -> None:
        """The node joined a cluster: ``policy`` picks its victims, by the node's rule in each pass."""
        policy.pop = self.pick.pop_victim if self.pick is not None else plain_pop
        policy.retention, self.pick = self.retention, None

    def allocate(self, n: int) -> int:
        """The store's Allocate: victims popped until ``n`` more blocks fit (or none is left to
        pop), by the store's capacity rule (:func:`~kvstore.store.books.placement.evictions`); how many
        of the ``n`` fit."""
        sp = self.space

        def over() -> bool:
            return len(sp.sizes) + n > sp.capacity

        for v, _ in evictions(sp, over, self.pick, (), sp.bit):  # (a node's one space: nowhere below)
            sp.unplace(v)
        return max(0, min(n, sp.capacity - len(sp.sizes)))

    def commit(self, specs: Sequence[CommitSpec]) -> list[Block]:
        """The store's Commit of allocated blocks, ``(key, parent key, size, depth)`` root first: each
        added and placed (inserted with its parent Block when the policy holds it)."""
        place, add, ns = self.space.place, self.index.add, self.ns
        out = []
        for key, parent, size, depth in specs:
            b = add(ns, key, parent, size, State.COMMITTED, depth)
            place(b)
            out.append(b)
        return out


@dataclass(slots=True)
class ClusterRun(HitRates):
    mode: str
    routing: str
    capacity: int  # blocks per node
    references: int = 0
    prefix_hits: int = 0
    block_hits: int = 0
    peer_hits: int = 0  # prefix hits served by another node
    replicas: int = 0  # fetched blocks kept locally
    requests: list[int] = field(default_factory=list)  # per node
    seconds: float = 0.0
    hints: str = ""  # the --hints replayed ("" for none)
    retained_peak: int = 0  # with hints: the most blocks retained at once, all nodes together

    @property
    def imbalance(self) -> float:
        """The busiest node's requests over the mean."""
        total = sum(self.requests)
        return max(self.requests) * len(self.requests) / total if total else 0.0

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "prefix_hit_rate": round(self.prefix_hit_rate, 6),
            "block_hit_rate": round(self.block_hit_rate, 6),
        }
        if self.mode == "cluster":
            refs = self.references or 1
            out["peer_hit_rate"] = round(self.peer_hits / refs, 6)
            out["replicas"] = self.replicas
        if self.hints:
            out["hints"] = self.hints
            out["retained_peak_blocks"] = self.retained_peak
        if self.mode != "global":
            out["imbalance"] = round(self.imbalance, 4)
            out["requests_per_node"] = list(self.requests)
        return out


class _Router:
    def __init__(
        self,
        routing: str,
        nodes: list[Node],
        directory: Directory | None,
        seed: int,
        max_imbalance: float,
        tie_seed: int | None = None,
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing: unknown {routing!r}; allowed: {list(ROUTINGS)}")
        self.nodes = nodes
        self.ties = random.Random(tie_seed) if tie_seed is not None else None  # None: ties by node index
        self.directory = directory
        self.max_imbalance = max_imbalance
        self.rng = random.Random(seed)
        self.turn = 0
        self.pick: Callable[[Request], Node] = {
            "round-robin": self._round_robin,
            "random": self._random,
            "prefix": self._prefix,
        }[routing]

    def _round_robin(self, req: Request) -> Node:
        node = self.nodes[self.turn % len(self.nodes)]
        self.turn += 1
        return node

    def _random(self, req: Request) -> Node:
        return self.nodes[self.rng.randrange(len(self.nodes))]

    def _prefix(self, req: Request) -> Node:
        prefixes = node_prefixes(self.nodes, self.directory, index_keys(req))
        tie = None
        if self.ties is not None:
            tie = [self.ties.random() for _ in self.nodes].__getitem__
        return self.nodes[rank(prefixes, [n.requests for n in self.nodes], self.max_imbalance, tie=tie)[0]]


def node_prefixes(nodes: Sequence[Node], directory: Directory | None, keys: Sequence[BlockKey]) -> list[dict[str, int]]:
    """Each node's usable prefix of ``keys`` by place: its own leading run (``dram``) or, with a
    directory, the cluster's leading run split into the blocks it holds and those only peers hold."""
    if directory is None:
        return [{"dram": len(Index.leading_run(n.ns, keys))} for n in nodes]
    held = directory.holders
    run = 0
    for key in keys:
        if key not in held:
            break
        run += 1
    head = keys[:run]
    out = []
    for n in nodes:
        local = sum(map(n.ns.visible.__contains__, head))
        out.append({"dram": local, "peer": run - local})
    return out


def replay_cluster(
    trace: Trace,
    nodes: int,
    capacity: int,
    mode: str = "cluster",
    routing: str = "round-robin",
    policy: str = "lru",
    seed: int = 0,
    max_imbalance: float = MAX_IMBALANCE,
    prefer_replicas: bool = True,
    progress: bool = False,
    tie_seed: int | None = None,
    ghost_ttl_s: float = GHOST_TTL_S,
    hints: Hints | None = None,
) -> ClusterRun:
    """Replay ``trace`` over ``nodes`` nodes of ``capacity`` blocks each (``global``: one node of
    ``nodes`` × ``capacity``), in one of :data:`MODES`; ``tie_seed``: the node order of prefix
    routing's ties; ``ghost_ttl_s``: how long the cluster's ghost keeps a count, in the trace's time
    (0: no ghost; the module's docstring); ``hints``: the retention hints the trace implies
    (:mod:`kvstore.sim.hints`), kept by each node's soft pin; a replica takes its holder's
    retention, as the directory record carries it."""
    if mode not in MODES:
        raise ValueError(f"mode: unknown {mode!r}; allowed: {list(MODES)}")
    if nodes < 1:
        raise ValueError("nodes: at least 1")
    if mode == "global":
        nodes, capacity = 1, nodes * capacity
    directory = Directory(ghost_ttl_s) if mode == "cluster" else None
    hinting = Hinting(trace, hints) if hints is not None else None
    members = []
    for i in range(nodes):
        retention = hinting.retention({DRAM: capacity}) if hinting else None
        node = Node(i, capacity, make_policy(policy), trace.name, retention)
        if directory is not None:
            directory.join(node, prefer_replicas)
        members.append(node)
    router = _Router(routing, members, directory, seed, max_imbalance, tie_seed)
    res = ClusterRun(mode, routing, capacity)
    bar = Progress(trace.references, f"{mode} {routing}", progress)
    t0 = time.perf_counter()
    try:
        _replay_requests(trace, members, router, directory, hinting, res, bar)
    finally:
        bar.close()
    res.requests = [n.requests for n in members]
    res.seconds = time.perf_counter() - t0
    if hinting is not None:
        res.hints, res.retained_peak = hints.label() if hints else "", hinting.peak
    return res


def _replay_requests(
    trace: Trace,
    members: list[Node],
    router: _Router,
    directory: Directory | None,
    hinting: Hinting | None,
    res: ClusterRun,
    bar: Progress,
) -> None:
    """Each request of ``trace`` in timestamp order: the directory's and the hints' clocks set,
    routed to a node, served there (:func:`_serve`), the retention its hints imply given."""
    bt = trace.block_tokens
    done = 0
    for ri, req in enumerate(trace.requests):
        if directory is not None:
            directory.now_ms = req.timestamp
        if hinting is not None:
            hinting.at(req, ri)
        node = router.pick(req)
        node.requests += 1
        _serve(node, members, directory, req, bt, res)
        if hinting is not None and node.retention is not None:
            hinting.retain(node.retention, ri, node.ns.blocks, index_keys(req), DRAM)
        if ri % PROGRESS_EVERY == 0:
            bar.update(res.references - done)
            done = res.references


def _serve(
    node: Node, members: list[Node], directory: Directory | None, req: Request, bt: int, res: ClusterRun
) -> None:
    """``req`` on ``node``, in the store's order of calls (the module's four steps): the usable
    prefix looked up, its blocks touched deepest first where they are held, the peer blocks fetched
    as replicas, then each key after the prefix that no node holds allocated and committed."""
    keys = index_keys(req)
    nk = len(keys)
    held = directory.holders if directory is not None else {}
    run, owners, fetched = _usable_prefix(node, members, held, keys)
    n = len(run)
    res.references += nk
    res.prefix_hits += n
    res.block_hits += n
    res.peer_hits += len(fetched)
    for i in range(n - 1, -1, -1):  # deepest first, in the policy of the node that holds it
        owners[i].access(run[i])
    if node.retention is not None and n:  # (hints: each holder's budget weighs its retained blocks' use)
        _used(node, members, held, run, fetched)
    if fetched and directory is not None:  # (only a directory names peers)
        res.replicas += _fetch(node, directory, _specs(req, bt, fetched), [run[i] for i in fetched])
    blocks = node.ns.blocks
    new = [i for i in range(n, nk) if keys[i] not in blocks and keys[i] not in held]
    res.block_hits += nk - n - len(new)  # the keys held behind the gap: useless to the prefix
    if new:
        _store(node, directory, _specs(req, bt, new))


def _usable_prefix(
    node: Node, members: list[Node], held: dict[BlockKey, list[int]], keys: Sequence[BlockKey]
) -> tuple[list[Block], list[EvictionPolicy], list[int]]:
    """Lookup: the leading run of ``keys`` that ``node`` holds, continued through the keys that
    ``held`` (the directory) names a holder of: its blocks (this node's, or the first holder's for
    a peer block), the policy of the node that holds each, and the positions that a peer holds."""
    visible = node.ns.visible
    run: list[Block] = []
    owners: list[EvictionPolicy] = []
    own = node.space.policy
    fetched: list[int] = []
    for i, key in enumerate(keys):
        b = visible.get(key)
        if b is None:
            holders = held.get(key)
            if not holders:
                break
            holder = members[holders[0]]  # the first node that stored it
            b = holder.ns.visible[key]
            owners.append(holder.space.policy)
            fetched.append(i)
        else:
            owners.append(own)
        run.append(b)
    return run, owners, fetched


def _used(node: Node, members: list[Node], held: dict[BlockKey, list[int]], run: list[Block],
          fetched: list[int]) -> None:
    """The blocks of ``run`` used where they are held: ``node``'s own, and each peer block on the
    node that serves it (the first holder, as :func:`_usable_prefix` takes it)."""
    if not fetched:
        node.retention.used(run)  # type: ignore[union-attr]  # (the caller checked)
        return
    peer = set(fetched)
    node.retention.used([b for i, b in enumerate(run) if i not in peer])  # type: ignore[union-attr]
    by: dict[int, list[Block]] = {}
    for i in fetched:
        by.setdefault(held[run[i].key][0], []).append(run[i])
    for h, blocks in by.items():
        retention = members[h].retention
        if retention is not None:
            retention.used(blocks)


def _specs(req: Request, bt: int, positions: Sequence[int]) -> list[CommitSpec]:
    """:meth:`Node.commit`'s specs of ``req``'s blocks at ``positions``: key, parent key, size
    (``bt`` tokens, the last block its own), depth."""
    keys = index_keys(req)
    last = len(keys) - 1
    return [(keys[i], keys[i - 1] if i else b"", req.last_size if i == last else bt, i + 1) for i in positions]


def _fetch(node: Node, directory: Directory, specs: Sequence[CommitSpec], sources: Sequence[Block]) -> int:
    """The store's peer fetch of the blocks ``specs`` names (``sources``: the holders' copies):
    slots made for all of them, then placed root first as replicas, with no commit ``access``;
    each takes its holder's retention (the directory record carries it) and resumes a count the
    cluster's ghost kept. How many were kept."""
    room = node.allocate(len(specs))
    replicas = node.commit(specs[:room])
    if node.retention is not None:
        for b, src in zip(replicas, sources):
            node.retention.inherit(b, src.retain_until, src.retain_priority)
    own = node.space.policy
    for b in replicas:
        if uses := directory.add(b.key, node.id):
            own.resume(b, uses)
    return len(replicas)


def _store(node: Node, directory: Directory | None, specs: Sequence[CommitSpec]) -> None:
    """The store's Allocate of the new blocks ``specs`` names (victims popped for all of them),
    then Commit: inserted root first, then ``access_many`` deepest first (ancestors at least as
    recent as descendants), the order kvstore/sim/replay.py's single-space replay follows. Then
    published in the directory: a count the cluster's ghost kept resumes."""
    room = node.allocate(len(specs))
    committed = node.commit(specs[:room])
    own = node.space.policy
    own.access_many(committed[::-1])
    if node.retention is not None:
        node.retention.stored(committed)
    if directory is not None:
        for b in committed:
            if uses := directory.add(b.key, node.id):
                own.resume(b, uses)


def compare(
    trace: Trace,
    nodes: int,
    capacity: int,
    routings: Sequence[str] = ("round-robin", "prefix"),
    policy: str = "lru",
    seed: int = 0,
    max_imbalance: float = MAX_IMBALANCE,
    progress: bool = False,
    tie_seed: int | None = None,
    ghost_ttl_s: float = GHOST_TTL_S,
    hints: Hints | None = None,
) -> dict[str, object]:
    """The global cache once, then isolated nodes and the cluster for each routing, with the
    cluster's ratios and load imbalance: the JSON of ``kvstore replay --nodes``."""
    glob = replay_cluster(trace, nodes, capacity, "global", policy=policy, progress=progress, hints=hints)
    out: dict[str, object] = {"global": {"capacity_blocks": nodes * capacity, **glob.to_json()}}
    by_routing: dict[str, object] = {}
    for routing in routings:
        runs = {
            mode: replay_cluster(
                trace,
                nodes,
                capacity,
                mode,
                routing,
                policy,
                seed,
                max_imbalance,
                progress=progress,
                tie_seed=tie_seed,
                ghost_ttl_s=ghost_ttl_s,
                hints=hints,
            )
            for mode in ("isolated", "cluster")
        }
        iso, clu = runs["isolated"].prefix_hit_rate, runs["cluster"].prefix_hit_rate
        by_routing[routing] = {
            "isolated": runs["isolated"].to_json(),
            "cluster": runs["cluster"].to_json(),
            "cluster_vs_isolated": round(clu / iso, 4) if iso else None,
            "cluster_vs_global": round(clu / glob.prefix_hit_rate, 4) if glob.prefix_hit_rate else None,
            "imbalance": round(runs["cluster"].imbalance, 4),
        }
    out["routing"] = by_routing
    return out
