"""What the cluster may use of a store: :class:`StoreDoor`, the only door, as a type.

The cluster (``kvstore/cluster/``) is handed the store's :class:`~kvstore.store.exchange.Exchange`
typed as this Protocol, never the ``BlockStore``: its modules name ``StoreDoor`` and nothing of the
index's books, the DRAM space, the slab or the movers, so mypy refuses a reach past it and
``tests/test_store_door.py`` refuses an import of the store's other rooms. What it offers:

- the exchange's own steps (:mod:`kvstore.store.exchange`): reserve slots for a peer fetch and
  settle them, adopt a shared tier's block, lend a run, the use counts the cluster's ghosts carry;
- read-only lookups: a namespace's live entry, whether a key is stored, the leading run of keys
  held, the block visible under a key, every visible block; whether a size fits a slot here;
- the index's change feed (what the publisher writes to the directory), the store's clock (a
  retention's end) and its counters (``Stats.cluster``, the loops' errors, the latencies).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # (types only: the exchange imports nothing of this module)
    from kvstore.stats.counters import Stats
    from kvstore.store.books.index import Block, ChangeFeed, NsEntry
    from kvstore.store.exchange import Loan, Reservation
    from kvstore.store.remote import PeerBlock


class StoreDoor(Protocol):
    """The calls the cluster may make on a store (the module's docstring)."""

    @property
    def stats(self) -> Stats: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    # --- read-only lookups --------------------------------------------------------------------

    def live(self, ns: NsEntry) -> NsEntry: ...

    def namespace(self, root: bytes) -> NsEntry | None: ...

    def stored(self, ns: NsEntry, key: bytes) -> bool: ...

    def leading_run(self, ns: NsEntry, keys: Sequence[bytes]) -> list[Block]: ...

    def visible(self, root: bytes, key: bytes) -> Block | None: ...

    def held(self) -> Iterator[Block]: ...

    def fits(self, size: int) -> bool: ...

    # --- the change feed ----------------------------------------------------------------------

    def subscribe(self) -> ChangeFeed: ...

    def unsubscribe(self) -> None: ...

    # --- the exchange's steps -----------------------------------------------------------------

    def reserve(
        self, ns: NsEntry, keys: Sequence[bytes], parent: bytes, depth: int, holders: Sequence[PeerBlock]
    ) -> Reservation: ...

    def adopt(
        self, ns: NsEntry, key: bytes, parent: bytes, size: int, tiers: int, checksum: int, depth: int
    ) -> NsEntry | None: ...

    async def lend(self, run: list[Block], lease_s: float) -> Loan | None: ...

    def uses(self, b: Block | bytes) -> int: ...

    def ghost_size(self) -> int: ...

    def resume(self, b: Block, uses: int) -> None: ...
