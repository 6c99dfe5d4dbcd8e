"""What the rest of a cluster may do to this store: blocks brought in from a peer or a shared tier,
blocks lent out to a peer, and the use counts the cluster's ghosts carry.

- **Reserve, then settle** (a peer fetch): :meth:`Exchange.reserve` files the blocks another node
  holds as ALLOCATED, each holding a DRAM slot, in a :class:`Reservation` (an open allocation of
  the cluster's, which :func:`tests.support.audit.audit` knows); the peer data path writes their
  bytes into :meth:`Reservation.views`; :meth:`Reservation.settle` places the leading run that
  arrived intact as replicas (with the checksum they arrived with and what is left of the
  holder's retention, as its answer said) and frees every other slot.
- **Adopt** (a shared tier's block): a block another node wrote to a Redis or S3 tier this node
  has joins the index as placed there (the movers read and verify it as any promotion).
- **Lend** (the holder's side of a fetch): the run is promoted into DRAM, leased, sealed where it
  was not, and handed out as views with the call that releases the lease and each block's
  retention now (the fetcher adopts that, not the directory's record of it).

Why a door of its own: the cluster (``kvstore/cluster/``) works on the store only through these
calls and the read-only lookups below, so placing, pinning and sealing stay where the state layer
does them for its own requests (a fetch's slots are reserved by :meth:`DramSpace.reserve` as an
Allocate's are, its lend seals with :func:`kvstore.store.sealing.seal` as the sealer does), and the
cluster knows nothing of the index's states, the DRAM space's slots or the movers. It holds this
object as :class:`kvstore.store.door.StoreDoor`, the only door, checked by mypy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.keys import BlockKey, NamespaceRoot
from kvstore.store.books.dram_space import DramSpace, Wanted
from kvstore.store.books.index import DRAM, Block, ChangeFeed, Index, NsEntry, State
from kvstore.store.books.retention import Retention
from kvstore.store.remote import PeerBlock
from kvstore.store.sealing import in_slots, seal


class Reservation:
    """Slots reserved for a peer fetch: ``blocks`` (ALLOCATED, each holding a slot, in no tier),
    one per ``holders``' entry (where its bytes come from). Open until :meth:`settle`."""

    def __init__(self, exchange: Exchange, ns: NsEntry, blocks: list[Block], holders: list[PeerBlock]) -> None:
        self.exchange = exchange
        self.ns = ns
        self.blocks = blocks
        self.holders = holders

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self, start: int, stop: int) -> list[bytes]:
        return [b.key for b in self.blocks[start:stop]]

    def views(self, start: int, stop: int) -> list[np.ndarray]:
        """The slots of blocks ``start`` to ``stop``, to be written into."""
        return [self.exchange.space.view(b) for b in self.blocks[start:stop]]

    def settle(self, sums: Sequence[int], retained: Sequence[tuple[int, int]] = ()) -> int:
        """The leading ``len(sums)`` blocks arrived intact with these checksums: placed in DRAM
        as replicas, visible, each with what is left of its holder's retention (``retained``:
        (ms left, priority) of each, as the holder's answer gave them; a block past its end is
        placed unretained);
        every other block's slot goes back (it was never visible). How many were placed. The
        reservation is closed."""
        self.exchange.closed(self)
        index, space = self.exchange.index, self.exchange.space
        for j, b in enumerate(self.blocks):
            if j >= len(sums):
                space.free(b)  # never visible: the slot goes back, the block leaves the index
                continue
            b.seal(sums[j])
            index.publish(b, replica=True)
            space.place(b)
            if j < len(retained):
                self.exchange.retained_as(b, *retained[j])
        return min(len(sums), len(self.blocks))


@dataclass(slots=True, frozen=True)
class Loan:
    """A run lent to a peer: its blocks as (checksum, bytes), the call that ends the lease, the
    seconds left of it, and each block's retention here now (ms left, priority; 0 ms: none)."""

    blocks: list[tuple[int, np.ndarray]]
    release: Callable[[], None]
    left_s: Callable[[], float]
    retained: list[tuple[int, int]]


class Exchange:
    """The store's door for the cluster (see the module's docstring)."""

    def __init__(self, index: Index, space: DramSpace, retention: Retention, clock: Callable[[], float]) -> None:
        self.index = index
        self.space = space
        self.retention = retention
        self.clock = clock
        self.stats = space.stats
        self.reservations: set[Reservation] = set()  # open: a peer fetch in flight each

    # --- read-only lookups (kvstore.store.door) -------------------------------------------

    def live(self, ns: NsEntry) -> NsEntry:
        """The live entry of ``ns``'s namespace (:meth:`Index.live`)."""
        return self.index.live(ns)

    def namespace(self, root: bytes) -> NsEntry | None:
        """The live entry of the namespace ``root`` names (raw bytes off the wire), None: none here."""
        return self.index.namespaces.get(NamespaceRoot(root))

    def stored(self, ns: NsEntry, key: bytes) -> bool:
        """Whether ``key`` is stored here in ``ns`` (in any state)."""
        return self.index.get(ns, key) is not None

    def leading_run(self, ns: NsEntry, keys: Sequence[bytes]) -> list[Block]:
        """The committed blocks at the head of ``keys`` (:meth:`Index.leading_run`)."""
        return self.index.leading_run(ns, keys)

    def visible(self, root: bytes, key: bytes) -> Block | None:
        """The committed block of ``key`` in the namespace ``root``, None: none here."""
        ns = self.index.namespaces.get(NamespaceRoot(root))
        return ns.visible.get(key) if ns is not None else None

    def held(self) -> Iterator[Block]:
        """Every committed block here."""
        for ns in self.index.namespaces.values():
            yield from ns.visible.values()

    def fits(self, size: int) -> bool:
        """Whether a block of ``size`` bytes fits a slot here."""
        return self.space.slab.holds(size)

    def subscribe(self) -> ChangeFeed:
        """The index's change feed, from now on (:meth:`Index.subscribe`)."""
        return self.index.subscribe()

    def unsubscribe(self) -> None:
        self.index.unsubscribe()

    # --- a peer fetch ---------------------------------------------------------------------

    def reserve(
        self, ns: NsEntry, keys: Sequence[bytes], parent: bytes, depth: int, holders: Sequence[PeerBlock]
    ) -> Reservation:
        """Slots for the leading run of ``keys`` (``holders``' blocks, one each; ``parent`` is the
        key before ``keys[0]``, ``depth`` its 1-based position) that is not here yet: the run
        stops at a key stored (written or fetched here meanwhile), or when DRAM cannot take
        one more (full of pinned blocks, or a size this slab has no class for)."""
        ns = self.index.live(ns)
        wanted: list[Wanted] = [
            (BlockKey(keys[i]), keys[i - 1] if i else parent, pb.size, depth + i) for i, pb in enumerate(holders)
        ]
        blocks = self.space.reserve(ns, wanted)
        reservation = Reservation(self, blocks[-1].ns if blocks else ns, blocks, list(holders[: len(blocks)]))
        self.reservations.add(reservation)
        return reservation

    def closed(self, reservation: Reservation) -> None:
        self.reservations.discard(reservation)

    def retained_as(self, b: Block, left_ms: int, priority: int) -> None:
        """A fetched block keeps what is left of its holder's retention: ``left_ms`` from now on
        this node's clock, as the holder's answer to the fetch said (no wall clocks compared). Not
        the directory record's: a directory writer can put back a record of a retention its
        holder has ended since, and it would be taken up again (docs/security.md)."""
        if left_ms > 0:
            self.retention.inherit(b, self.clock() + left_ms / 1000, priority)

    # --- a shared tier's block --------------------------------------------------------------

    def adopt(
        self, ns: NsEntry, key: bytes, parent: bytes, size: int, tiers: int, checksum: int, depth: int
    ) -> NsEntry | None:
        """File ``key`` (not stored here) as placed in the shared tiers of ``tiers`` this node has
        and that are up, with the checksum its writer recorded; the namespace's live entry, or None
        when it is stored here already, fits no slot here, or no such tier takes it."""
        if self.index.get(ns, key) is not None or not self.space.slab.holds(size):
            return None
        b = self.index.add(ns, BlockKey(key), parent, size, State.COMMITTED, depth)
        b.seal(checksum)
        if self.space.below.adopt(b, tiers):
            return b.ns
        self.index.drop(b)  # this node lacks that tier, or it is down
        return None

    # --- the holder's side ------------------------------------------------------------------

    async def lend(self, run: list[Block], lease_s: float) -> Loan | None:
        """``run`` (a leading run held here) brought into DRAM, leased for ``lease_s`` and sealed:
        its leading blocks readable from DRAM now, None when there are none."""
        run = await self.space.movers.promote(run)
        readable: list[Block] = []
        for b in run:
            if not b.tiers & DRAM or b.state is not State.COMMITTED or b.slot is None:
                break
            readable.append(b)
        if not readable:
            return None
        index, space = self.index, self.space
        lease = index.take_lease(readable, self.clock() + lease_s)

        def release() -> None:
            if lease.id in index.leases:
                index.release_lease(lease.id)

        def left_s() -> float:  # (the hashing below, a busy loop: less than the lease's length)
            return lease.deadline - self.clock()

        # A task cancelled while it hashes (its connection dropped, the server stopping) would
        # otherwise leave the lease pinning these blocks in DRAM until its deadline: until the
        # Loan owns the lease, anything that ends the call releases it.
        try:
            kept = await seal(readable, *in_slots(space, readable))
            # The lease ended while they were hashed (the reaper): the run ends before the first
            # block that left its slot meanwhile (what was hashed there was not only its bytes).
            moved = next((i for i, k in enumerate(kept) if k is None), None)
            if moved is not None:
                readable = readable[:moved]
                if not readable:
                    release()
                    return None
            space.touch(readable)
            retained = [self.retention.left(b) for b in readable]
            self.retention.used(readable)  # (after: the fetcher adopts what is left of their retention)
            return Loan([(b.checksum or 0, space.view(b)) for b in readable], release, left_s, retained)
        except BaseException:
            release()
            raise

    # --- the cluster's ghosts ---------------------------------------------------------------

    def uses(self, b: Block | bytes) -> int:
        """The use count this node's policies have or remember of ``b`` (:meth:`DramSpace.uses`)."""
        return self.space.uses(b)

    def ghost_size(self) -> int:
        """How many evicted blocks' counts this node's tiers remember (:meth:`DramSpace.ghost_size`)."""
        return self.space.ghost_size()

    def resume(self, b: Block, uses: int) -> None:
        """Another node left ``uses`` uses of ``b``: its spaces' policies resume them."""
        self.space.resume(b, uses)
