"""Block metadata: state, placement per tier, leases, allocations, prefix links.

Pure bookkeeping, no I/O and no bytes: the store (:mod:`kvstore.store.block_store`) drives it, and
``kvstore replay`` drives the same code with a trace. Everything here runs on the server's event
loop thread, so nothing is locked.
"""

from __future__ import annotations

import enum
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

from kvstore.errors import FailedPrecondition, NotFound, shown
from kvstore.keys import BlockKey, Namespace, NamespaceRoot
from kvstore.tier_table import BY_NAME, ROWS, TOP_LABEL, TOP_TIER, TierRow
from kvstore.util.ints import shared

if TYPE_CHECKING:
    from kvstore.dram.slab import Slot


class State(enum.IntEnum):
    ALLOCATED = 1  # slot reserved, bytes being written, invisible to lookups
    COMMITTED = 2  # visible


class TierId(enum.IntFlag):
    """The built-in tiers' placement bits (the replay names them); every tier, a registered one
    included, is a row of :mod:`kvstore.tier_table`, whose bits these are."""

    DRAM = 1
    SSD = 2
    REDIS = 4
    S3 = 8

    @property
    def label(self) -> str:
        return self.name.lower()  # type: ignore[union-attr]  # a combined flag has no name; single tiers all do


TIER_ORDER: list[TierRow] = ROWS  # every tier, fastest first (int(t): its bit, t.label: its name)

# Plain-int bits for the hot paths (enum arithmetic runs in Python, ints in C).
DRAM, SSD, REDIS, S3 = (BY_NAME[n].bit for n in ("dram", "ssd", "redis", "s3"))


def top_label(mask: int) -> str:
    """Name of the fastest tier in a placement mask."""
    return TOP_LABEL[mask]


class _Rare:
    """The fields of a block that few blocks set (issue 41, the compact index): the cluster's
    replica mark and its retention. A block holds one only while one of them differs from its
    default (a fetched replica, a retention hint)."""

    __slots__ = ("replica", "retain_priority", "retain_until")

    def __init__(self) -> None:
        self.replica = False
        self.retain_until = 0.0
        self.retain_priority = 0

    def plain(self) -> bool:
        """Every rare field at its default: the block needs this object no more."""
        return not (self.replica or self.retain_until or self.retain_priority)


class Block:
    """One block's record. Twelve slots (issue 41, the compact index): the fields every block sets
    or a hot path reads or writes (its DRAM slot, its pins) are slots of its own; its replica mark
    and retention share one, ``_x``: None, or a :class:`_Rare` holding them while either differs
    from its default. They read and write as attributes (properties) all the same; their owners
    (tests/test_block_owners.py) are unchanged. (The slot shared ``_x`` once, for 8 B a block: a
    property read cost ~90 ns against ~13, ~0.17 ms more for an Acquire of 2,048 blocks.)"""

    __slots__ = (
        "_x", "checksum", "depth", "key", "leases", "moving", "ns", "parent", "size", "slot", "state", "tiers",
    )

    ns: NsEntry
    key: BlockKey
    parent: bytes  # the previous block's key in its prefix, b"" for the first
    size: int
    depth: int
    state: State
    tiers: int  # placement bits (DRAM | SSD | REDIS | S3)
    checksum: int | None  # None until sealed
    leases: int
    moving: int  # movers reading its DRAM slot right now (write-through)
    slot: Slot | None  # while its bytes are in DRAM or being written there (kvstore.store.books.dram_space)

    def __init__(
        self, ns: NsEntry, key: BlockKey, parent: bytes, size: int, depth: int = 1, state: State = State.ALLOCATED
    ) -> None:
        self.ns = ns
        self.key = key
        self.parent = parent
        self.size = size
        self.depth = depth
        self.state = state
        self.tiers = 0
        self.checksum = None
        self.leases = 0
        self.moving = 0
        self.slot = None
        self._x: _Rare | None = None

    def __repr__(self) -> str:
        return (
            f"Block(key={self.key!r}, parent={self.parent!r}, size={self.size}, depth={self.depth}, "
            f"state={self.state!r}, tiers={self.tiers}, checksum={self.checksum}, slot={self.slot!r}, "
            f"leases={self.leases}, moving={self.moving}, replica={self.replica}, "
            f"retain_until={self.retain_until}, retain_priority={self.retain_priority})"
        )

    def _rare(self) -> _Rare:
        """The block's :class:`_Rare`, made when it has none."""
        x = self._x
        if x is not None:
            return x
        r = self._x = _Rare()
        return r

    def _settle(self, r: _Rare) -> None:
        """A rare field went back to its default: no side object once all of them are."""
        if r.plain():
            self._x = None

    # The rare fields. Their setters are where they are stored, not who writes them: their
    # owners are the methods tests/test_block_owners.py names.

    @property
    def replica(self) -> bool:
        """Fetched from another node of the cluster, which holds it too."""
        x = self._x
        return x.replica if x is not None else False

    @replica.setter
    def replica(self, value: bool) -> None:
        r = self._rare()
        r.replica = value
        if not value:
            self._settle(r)

    @property
    def retain_until(self) -> float:
        """A retention hint's end on the sidecar's clock (kvstore.store.books.retention); 0.0: none."""
        x = self._x
        return x.retain_until if x is not None else 0.0

    @retain_until.setter
    def retain_until(self, value: float) -> None:
        r = self._rare()
        r.retain_until = value
        if not value:
            self._settle(r)

    @property
    def retain_priority(self) -> int:
        """0..3: among retained blocks, the lowest goes first."""
        x = self._x
        return x.retain_priority if x is not None else 0

    @retain_priority.setter
    def retain_priority(self, value: int) -> None:
        r = self._rare()
        r.retain_priority = value
        if not value:
            self._settle(r)

    @property
    def top_tier(self) -> int:
        return TOP_TIER[self.tiers]

    @property
    def pinned(self) -> bool:
        return self.leases > 0 or self.state is State.ALLOCATED or self.moving > 0

    def seal(self, checksum: int) -> bool:
        """Record ``checksum`` as the block's (the xxh3-64 of its bytes): the one place a block's
        checksum is written (``tests/test_checksum_owner.py`` holds the tree to it).

        The rule: a block's checksum is recorded once and never changes. An unsealed block
        (``checksum`` None) takes the one given, whoever computed it first (the writer at commit,
        the sealer, a read, a peer's record, a tier's header). A sealed block keeps its own, and
        the answer says whether ``checksum`` agrees with it: False means the bytes just hashed are
        not the bytes sealed (a corrupt copy), which the caller counts and drops or skips. True
        when the block now carries ``checksum``."""
        if self.checksum is None:
            self.checksum = checksum
            return True
        return self.checksum == checksum


class Visible(Mapping[bytes, "Block"]):
    """A namespace's committed blocks, what lookups see: its ``blocks`` whose state is COMMITTED
    (issue 41, the compact index: one dict entry a block, where a second dict of the committed
    ones took another). Read-only; its length is the count ``visible_sizes`` keeps."""

    __slots__ = ("_blocks", "_sizes")

    def __init__(self, blocks: dict[bytes, Block], sizes: dict[int, int]) -> None:
        self._blocks = blocks
        self._sizes = sizes

    def get(self, key: bytes, default: Any = None) -> Any:
        b = self._blocks.get(key)
        return b if b is not None and b.state is State.COMMITTED else default

    def __getitem__(self, key: bytes) -> Block:
        b = self._blocks[key]
        if b.state is not State.COMMITTED:
            raise KeyError(key)
        return b

    def __contains__(self, key: object) -> bool:
        b = self._blocks.get(key)  # type: ignore[call-overload]  # (any key: a miss)
        return b is not None and b.state is State.COMMITTED

    def __iter__(self) -> Iterator[bytes]:
        return (k for k, b in self._blocks.items() if b.state is State.COMMITTED)

    def __len__(self) -> int:
        return sum(self._sizes.values())

    def values(self) -> Iterator[Block]:  # type: ignore[override]  # (an iterator, not a view)
        return (b for b in self._blocks.values() if b.state is State.COMMITTED)

    def items(self) -> Iterator[tuple[bytes, Block]]:  # type: ignore[override]
        return ((k, b) for k, b in self._blocks.items() if b.state is State.COMMITTED)


@dataclass(slots=True, eq=False)
class NsEntry:
    root: NamespaceRoot
    label: str  # for reading only (stats): built from free text, it names no tenant
    namespace: Namespace | None
    tenant: str = ""  # whose quotas its blocks count against (kvstore.store.books.tenants): fixed at creation
    blocks: dict[bytes, Block] = field(default_factory=dict)  # every block, allocated or committed
    visible_sizes: dict[int, int] = field(default_factory=dict)  # block size -> visible blocks of it
    pending: dict[bytes, Block] = field(default_factory=dict)  # the ALLOCATED ones (being written: few)
    visible: Visible = field(init=False)  # the committed ones: what lookups see (a view of ``blocks``)

    def __post_init__(self) -> None:
        self.visible = Visible(self.blocks, self.visible_sizes)

    @property
    def uniform_size(self) -> int:
        """The size every visible block has, or 0 when sizes differ (or nothing is visible)."""
        if len(self.visible_sizes) == 1:
            return next(iter(self.visible_sizes))
        return 0

    def show(self, block: Block) -> None:
        """Count the committed ``block`` (in ``blocks``: lookups see it now) in ``visible_sizes``
        (:meth:`Index.add` and :meth:`Index.publish` do)."""
        self.visible_sizes[block.size] = self.visible_sizes.get(block.size, 0) + 1

    def hide(self, block: Block) -> None:
        """Take the visible ``block`` out of ``visible_sizes`` as it leaves ``blocks`` (:meth:`Index.drop` does)."""
        n = self.visible_sizes[block.size] - 1
        if n:
            self.visible_sizes[block.size] = n
        else:
            del self.visible_sizes[block.size]


def _entry(root: NamespaceRoot, label: str, namespace: Namespace | None, tenant: str) -> NsEntry:
    return NsEntry(root, label, namespace, namespace.tenant if namespace is not None else tenant)


@dataclass(slots=True, eq=False)
class Allocation:
    id: str
    ns: NsEntry
    blocks: dict[int, Block]  # slot_id -> block
    deadline: float


@dataclass(slots=True, eq=False)
class Lease:
    id: str
    blocks: list[Block]
    deadline: float


class ChangeFeed:
    """The blocks whose visibility or placement changed since their reader last drained them, in
    order: what the cluster's publisher writes to the directory. Each is True when it became
    visible meanwhile (:meth:`Index.publish`: new on this node, whose cluster-wide use count the
    publisher reads) and False when only it moved. Handed out by :meth:`Index.subscribe`, so the
    index keeps no log while nothing reads one (a node on its own)."""

    def __init__(self) -> None:
        self.changes: dict[Block, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.changes)

    def moved(self, block: Block) -> None:
        """``block`` changed (new here, when it already was since the last drain)."""
        self.changes.setdefault(block, False)

    def drain(self) -> dict[Block, bool]:
        """The changes gathered so far; the feed starts empty again."""
        out, self.changes = self.changes, {}
        return out

    def restore(self, pending: dict[Block, bool]) -> None:
        """Put back changes drained but not written (a failed pass): they come before the ones
        gathered since, and a block new in either is new."""
        merged = dict(pending)
        for b, new in self.changes.items():
            merged[b] = merged.get(b, False) or new
        self.changes = merged


class Index:
    def __init__(self) -> None:
        self.namespaces: dict[NamespaceRoot, NsEntry] = {}
        self.allocations: dict[str, Allocation] = {}
        self.leases: dict[str, Lease] = {}
        self._feed: ChangeFeed | None = None  # the one subscriber's (the cluster's publisher)
        # Told of each move of a block that was ever retained (its retention's byte counts:
        # Retention.recount, kvstore/store/books/retention.py); None: no retention watches.
        self.retained: Callable[[Block], None] | None = None

    # --- the change feed ----------------------------------------------------------------

    def subscribe(self) -> ChangeFeed:
        """A feed of the blocks whose visibility or placement changes from now on (one reader: a
        new subscription replaces the last)."""
        self._feed = ChangeFeed()
        return self._feed

    def unsubscribe(self) -> None:
        """Stop keeping the feed (its reader has gone)."""
        self._feed = None

    # --- namespaces ---------------------------------------------------------------------

    # An entry lives while it holds a block: reads of a namespace that stores nothing get a
    # detached empty entry (``find``), the first block registers it (``add``), the last one to
    # go drops it (``drop``). Clients choose namespaces freely; only stored blocks cost memory.

    # An entry's tenant is the namespace's (``Namespace.tenant``) when it is known, else the one
    # given (a tier's block header after a restart); it never changes while the entry lives.

    def namespace(
        self, root: NamespaceRoot, label: str, namespace: Namespace | None = None, tenant: str = ""
    ) -> NsEntry:
        """The namespace's entry, registered (created empty when it holds nothing yet)."""
        entry = self.namespaces.get(root)
        if entry is None:
            entry = self.namespaces[root] = _entry(root, label, namespace, tenant)
        elif namespace is not None and entry.namespace is None:
            entry.namespace = namespace
        return entry

    def find(self, root: NamespaceRoot, label: str, namespace: Namespace | None = None, tenant: str = "") -> NsEntry:
        """The namespace's entry, or a detached empty one when it holds nothing (not registered:
        a lookup must not make the index grow)."""
        entry = self.namespaces.get(root)
        if entry is None:
            return _entry(root, label, namespace, tenant)
        if namespace is not None and entry.namespace is None:
            entry.namespace = namespace
        return entry

    def live(self, ns: NsEntry) -> NsEntry:
        """The live entry of ``ns``'s namespace (``ns`` may be a stale or detached one)."""
        return self.find(ns.root, ns.label, ns.namespace, ns.tenant)

    # --- lookups ------------------------------------------------------------------------

    @staticmethod
    def leading_run(ns: NsEntry, keys: Sequence[bytes]) -> list[Block]:
        """The committed blocks at the head of ``keys``, in order.

        The hot path of every Lookup: dictionary probes run in C (``map``), no Python loop; the
        blocks being written (``pending``, ALLOCATED: invisible) probed only when there are any."""
        found: list[Any] = list(map(ns.blocks.get, keys))  # Blocks up to the first None
        with suppress(ValueError):  # (every key found)
            del found[found.index(None) :]
        pending = ns.pending
        if pending and found:
            writing = list(map(pending.__contains__, islice(keys, len(found))))
            if True in writing:  # the run ends at the first block still being written
                del found[writing.index(True) :]
        return found

    def get(self, ns: NsEntry, key: bytes) -> Block | None:
        return ns.blocks.get(key)

    def add(
        self, ns: NsEntry, key: BlockKey, parent: bytes, size: int, state: State, depth: int | None = None
    ) -> Block:
        """Record a block. ``depth`` is its 1-based position in the prompt when the caller knows
        it (the parent may have been evicted); otherwise it is derived from the parent."""
        parent_block = ns.blocks.get(parent) if parent else None
        if parent_block is not None:
            parent = parent_block.key  # the same bytes: one object for both blocks (issue 41)
        if depth is None:
            depth = parent_block.depth + 1 if parent_block is not None else 1
        size = shared(size)  # (the few block sizes: one int object each, kvstore.util.ints)
        if not ns.blocks:  # its first block: register it (again, when it was dropped on emptying)
            ns = self.namespaces.setdefault(ns.root, ns)
        block = Block(ns, key, parent, size, depth, state)
        ns.blocks[key] = block
        if state is State.COMMITTED:
            ns.show(block)
            self.moved(block)
        else:
            ns.pending[key] = block
        return block

    def add_sealed(
        self, ns: NsEntry, keys: Sequence[BlockKey], parents: Sequence[bytes], sizes: Sequence[int],
        checksums: Sequence[int],
    ) -> list[Block]:
        """:meth:`add` of each of ``keys`` (none in ``ns`` yet, none twice), committed, then sealed
        with its checksum, in order (a restart's batch, kvstore/movers/recovery.py): the same
        blocks, links and depths, the visible ones and their sizes counted in C."""
        if not keys:
            return []
        if not ns.blocks:  # its first block: register it (again, when it was dropped on emptying)
            ns = self.namespaces.setdefault(ns.root, ns)
        blocks, committed = ns.blocks, State.COMMITTED
        get, out = blocks.get, []
        for key, parent, size, csum in zip(keys, parents, sizes, checksums, strict=True):
            parent_block = get(parent) if parent else None
            if parent_block is not None:
                block = Block(ns, key, parent_block.key, shared(size), parent_block.depth + 1, committed)
            else:
                block = Block(ns, key, parent, shared(size), 1, committed)
            blocks[key] = block
            block.seal(csum)
            out.append(block)
        counts = ns.visible_sizes  # (visible: the view of ``blocks`` shows them already)
        for size, n in Counter(sizes).items():  # (in the order each size first comes, as one by one)
            size = shared(size)
            counts[size] = counts.get(size, 0) + n
        self.moved_many(out)
        return out

    def moved_many(self, blocks: Sequence[Block]) -> None:
        """:meth:`moved` for each of ``blocks``, in order."""
        if self.retained is not None and any(b.retain_until for b in blocks):
            for b in blocks:
                self.moved(b)
            return
        feed = self._feed
        if feed is not None:
            setdefault = feed.changes.setdefault
            for b in blocks:
                setdefault(b, False)

    def moved(self, block: Block) -> None:
        """``block``'s visibility or placement changed (for the cluster directory, when one watches,
        and the retention, when the block was ever retained)."""
        if block.retain_until and self.retained is not None:
            self.retained(block)
        if self._feed is not None:
            self._feed.changes.setdefault(block, False)

    def publish(self, block: Block, replica: bool = False) -> None:
        """ALLOCATED -> COMMITTED: the block becomes visible to lookups (committed, or fetched
        from a peer: new on this node, a ``replica`` of the holder's)."""
        block.state = State.COMMITTED
        if replica:
            block.replica = True
        ns = block.ns
        if ns.pending.get(block.key) is block:
            del ns.pending[block.key]
        ns.show(block)
        if self._feed is not None:
            self._feed.changes[block] = True

    def drop(self, block: Block) -> None:
        """Forget a block that no tier holds any more. A committed block whose last copy goes
        must be dropped here: lookups trust ``visible``. The namespace's last block takes its
        entry with it."""
        ns = block.ns
        if ns.blocks.get(block.key) is block:
            del ns.blocks[block.key]
            if block.state is State.COMMITTED:
                ns.hide(block)
                self.moved(block)
            elif ns.pending.get(block.key) is block:
                del ns.pending[block.key]
            if not ns.blocks and self.namespaces.get(ns.root) is ns:
                del self.namespaces[ns.root]

    def drop_if_gone(self, block: Block) -> None:
        """:meth:`drop` ``block`` when no tier holds a copy of it any more."""
        if not block.tiers:
            self.drop(block)

    # --- allocations --------------------------------------------------------------------

    def open_allocation(self, ns: NsEntry, blocks: dict[int, Block], deadline: float) -> Allocation:
        alloc = Allocation(uuid.uuid4().hex, ns, blocks, deadline)
        self.allocations[alloc.id] = alloc
        return alloc

    def allocation(self, alloc_id: str) -> Allocation:
        alloc = self.allocations.get(alloc_id)
        if alloc is None:
            raise NotFound(
                f"allocation_id: {shown(alloc_id)} is unknown "
                "(never allocated, already committed, aborted or reclaimed)"
            )
        return alloc

    def close_allocation(self, alloc: Allocation) -> None:
        self.allocations.pop(alloc.id, None)

    def expired_allocations(self, now: float) -> list[Allocation]:
        return [a for a in self.allocations.values() if a.deadline <= now]

    # --- leases -------------------------------------------------------------------------

    def take_lease(self, blocks: Iterable[Block], deadline: float) -> Lease:
        lease = Lease(uuid.uuid4().hex, list(blocks), deadline)
        for b in lease.blocks:
            b.leases += 1
        self.leases[lease.id] = lease
        return lease

    def release_lease(self, lease_id: str) -> Lease:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise NotFound(f"lease_id: {shown(lease_id)} is unknown (never taken, released or expired)")
        for b in lease.blocks:
            b.leases -= 1
        return lease

    def expired_leases(self, now: float) -> list[Lease]:
        return [le for le in self.leases.values() if le.deadline <= now]

    # --- pins -----------------------------------------------------------------------------
    # A block's pin counts (``leases``, ``moving``) are written here only (``Block.pinned``
    # reads them; tests/test_block_owners.py holds the tree to it).

    @staticmethod
    @contextmanager
    def pinned(blocks: Sequence[Block]) -> Iterator[None]:
        """Pin ``blocks`` while the caller awaits (a promotion making room for parts of its run,
        a peer fetch extending the local run): one more lease count each, with no :class:`Lease`
        (the audit allows a count above the live leases only while such a pin can be held),
        taken back however the block ends."""
        for b in blocks:
            b.leases += 1
        try:
            yield
        finally:
            for b in blocks:
                b.leases -= 1

    @staticmethod
    def start_moving(blocks: Iterable[Block]) -> None:
        """A mover reads the DRAM slots of ``blocks`` from now on (a write-through): pinned there
        until :meth:`stop_moving`, which may be called from another task, so this is no ``with``."""
        for b in blocks:
            b.moving += 1

    @staticmethod
    def stop_moving(blocks: Iterable[Block]) -> None:
        """The mover that :meth:`start_moving` ``blocks`` reads their slots no more."""
        for b in blocks:
            b.moving -= 1

    # --- counts -------------------------------------------------------------------------

    def count(self) -> dict[str, int]:
        out = {
            "namespaces": len(self.namespaces),
            "blocks": 0,
            "allocations": len(self.allocations),
            "leases": len(self.leases),
        }
        for ns in self.namespaces.values():
            out["blocks"] += len(ns.blocks)
        return out


def require_state(block: Block, state: State, field_name: str) -> None:
    if block.state is not state:
        raise FailedPrecondition(f"{field_name}: block is {block.state.name}, expected {state.name}")
