"""The eviction-policy interface.

A policy orders the blocks of ONE capacity-limited space (the DRAM slab, the SSD directory, a
replayed cache) and picks victims. It never frees anything itself: the owner of the space calls
:meth:`EvictionPolicy.pop_victim` until it has room, and tells the policy about every insert,
access and removal. There is no admission filter: every block the owner stores enters its space,
and blocks used once are left to the eviction order (:mod:`kvstore.policy.credit` puts them ahead
of reused ones). Items are opaque hashables (the server passes its ``Block`` objects, the replay
passes its own), and ``parent`` links let a policy stay prefix-aware: a prefix cache can only use
the leading run of a prompt's blocks, so a block whose parent is gone is worthless and leaves
should go before their ancestors.

Owners call :meth:`access` for a request's blocks deepest-first, so that an ancestor is always
at least as recent as its descendants.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar, Protocol, runtime_checkable

Item = Hashable
Eligible = Callable[[Item], bool]


@runtime_checkable
class EvictionPolicy(Protocol):
    name: ClassVar[str]

    def insert(self, item: Item, parent: Item | None, depth: int, size: int) -> None:
        """A block entered the space. ``parent`` is the previous block of its prefix, if it is
        in this space; ``depth`` is its 1-based position in the prefix."""
        ...

    def insert_many(
        self, items: Sequence[Item], parents: Sequence[Item | None], depths: Sequence[int], sizes: Sequence[int]
    ) -> None:
        """:meth:`insert` for each of ``items`` in order, with its parent, depth and size (a
        restart's batch, kvstore/movers/recovery.py): a parent counts when the space holds it at
        that item's turn (before these, or earlier among them). The state it leaves is exactly
        the one the inserts one after the other leave (tests/policy/test_insert_many.py)."""
        ...

    def access(self, item: Item) -> None:
        """A block in the space was hit."""
        ...

    def access_many(self, items: Sequence[Item]) -> None:
        """:meth:`access` for each of ``items`` in order (a request's hits, deepest first)."""
        ...

    def remove(self, item: Item) -> None:
        """A block left the space for a reason other than :meth:`pop_victim` (delete, move)."""
        ...

    def pop_victim(self, eligible: Eligible | None = None) -> Item | None:
        """Remove and return the block to evict next, skipping those ``eligible`` rejects
        (leased, being written, wrong size class); None when there is none."""
        ...

    def hold(self, item: Item) -> None:
        """``item`` is no victim until :meth:`release` (a block being written): :meth:`pop_victim`
        does not look at it, which is cheaper than rejecting it through ``eligible`` on every pop.
        It may be called whether or not ``item`` is in the space; a hold outlasts :meth:`remove`."""
        ...

    def release(self, item: Item) -> None:
        """End a :meth:`hold` (no-op when ``item`` is not held)."""
        ...

    def uses(self, item: Item) -> int:
        """The uses this space counts or remembers of ``item`` (resident, or on a ghost list by its
        key), 0 when it keeps no count: what a node tells the cluster's directory when the block
        leaves it (kvstore/cluster/publisher.py), so that the next node to store it may resume it."""
        ...

    def ghost_size(self) -> int:
        """How many evicted blocks' counts this space's ghost keeps (0: it keeps none)."""
        ...

    def resume(self, item: Item, uses: int) -> None:
        """Another node remembered ``uses`` uses of resident ``item`` (the cluster's ghost): its
        count becomes what this space's own ghost would have given it on the insert (``uses`` plus
        the store itself) if that is higher; a no-op for a policy that keeps no count, or an item
        not in the space."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, item: object) -> bool: ...


@runtime_checkable
class Banded(Protocol):
    """A policy whose candidates its owner may sort into bands (the prefix-aware policies,
    :mod:`kvstore.policy.leaves`): ``band`` gives an item's band (-1: the common one), read as the
    item becomes a candidate; :meth:`rekey` says an item's band may have changed. A search within
    one band never walks past the other bands' candidates: the retention hints keep retained blocks
    in the bands of their priorities (kvstore/store/books/retention.py), so choosing a victim among
    unretained or retained blocks costs O(log n) however many are retained."""

    band: Callable[[Item], int] | None

    def rekey(self, item: Item) -> None:
        """``item``'s band may have changed: a candidate moves to its new band."""
        ...

    def pop_victim(self, eligible: Eligible | None = None, band: int | None = None) -> Item | None:
        """:meth:`EvictionPolicy.pop_victim` among the candidates of ``band`` (None: of every
        band, in the policy's one order)."""
        ...
