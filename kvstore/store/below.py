"""What the block store and the DRAM space ask of the tiers below DRAM: the :class:`Movers`
interface, and :class:`NoMovers`, the nothing-below of a DRAM-only store.

The real movers are :class:`kvstore.tiers.movers.Tiering`; the sidecar wires them in
(``BlockStore.tiering``). The state layer never imports the tiers: this Protocol is all it knows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.store.index import Block


class Movers(Protocol):
    """The tiers below DRAM and the work that moves blocks between them and DRAM."""

    @property
    def busy(self) -> bool:
        """Whether moves are in flight (their pins may be all that stands in a write's way)."""
        ...

    def down_mask(self) -> int:
        """Placement bits of the tiers that are down (lookups treat them as a miss)."""
        ...

    def touch(self, run: Sequence[Block]) -> None:
        """Hits on ``run``, for the policies of the tiers that hold its blocks."""
        ...

    def resume(self, b: Block, uses: int) -> None:
        """Another node remembered ``uses`` uses of ``b`` (the cluster's ghost): the policies of
        the tiers that hold it resume them (:meth:`~kvstore.policy.base.EvictionPolicy.resume`)."""
        ...

    def uses(self, b: Block | bytes) -> int:
        """The most uses a tier's policy counts or remembers of ``b`` (a Block, or a block key for
        its ghost), 0 when none keeps a count."""
        ...

    def ghost_size(self) -> int:
        """The most evicted blocks' counts one tier's policy keeps (0: none keeps any)."""
        ...

    def adopt(self, b: Block, mask: int) -> int:
        """Place ``b`` in the shared tiers of ``mask`` (written by another node of a cluster) that
        this node has and that are up; the placement bits it has there now."""
        ...

    def on_dram_evict(self, b: Block) -> None:
        """``b`` is about to leave DRAM: keep its bytes below when nothing there does."""
        ...

    def staging_batch(self) -> AbstractContextManager[None]:
        """Evictions inside copy their blocks out together when the block ends."""
        ...

    def committed(self, blocks: Sequence[Block]) -> list[asyncio.Future[None]]:
        """Freshly committed ``blocks``: the write-throughs started for them."""
        ...

    def written_through(self, blocks: Sequence[Block]) -> int:
        """How many of ``blocks`` every write-through tier holds."""
        ...

    async def promote(self, run: list[Block]) -> list[Block]:
        """Bring ``run``'s blocks that are only below DRAM up; the leading part now in DRAM."""
        ...

    async def writes_ended(self, blocks: Sequence[Block]) -> None:
        """Wait until no write-through in flight reads any of ``blocks`` (``Block.moving``)."""
        ...

    def forget(self, blocks: Sequence[Block]) -> Awaitable[None]:
        """Take ``blocks`` out of every lower tier's bookkeeping now (a delete); awaiting the
        result removes their copies."""
        ...

    async def flush(self) -> None:
        """Wait for the moves in flight."""
        ...

    def occupancy(self) -> dict[str, dict[str, object]]:
        """Each lower tier's occupancy, by name."""
        ...

    async def close(self) -> None: ...


class NoMovers:
    """A DRAM-only store: nothing below, nothing moves, nothing is ever down."""

    busy = False

    def down_mask(self) -> int:
        return 0

    def touch(self, run: Sequence[Block]) -> None:
        pass

    def resume(self, b: Block, uses: int) -> None:
        pass

    def uses(self, b: Block | bytes) -> int:
        return 0

    def ghost_size(self) -> int:
        return 0

    def adopt(self, b: Block, mask: int) -> int:
        return 0

    def on_dram_evict(self, b: Block) -> None:
        pass

    def staging_batch(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def committed(self, blocks: Sequence[Block]) -> list[asyncio.Future[None]]:
        return []

    def written_through(self, blocks: Sequence[Block]) -> int:
        return 0

    async def promote(self, run: list[Block]) -> list[Block]:
        return run

    async def writes_ended(self, blocks: Sequence[Block]) -> None:
        pass

    def forget(self, blocks: Sequence[Block]) -> Awaitable[None]:
        return nothing()

    async def flush(self) -> None:
        pass

    def occupancy(self) -> dict[str, dict[str, object]]:
        return {}

    async def close(self) -> None:
        pass


async def nothing() -> None:
    pass
