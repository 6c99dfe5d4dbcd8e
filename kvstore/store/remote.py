"""What the block store knows of the other nodes of a cluster: the :class:`Remote` interface, and
:class:`NoRemote`, the single node's nothing-beyond.

The real one is :class:`kvstore.cluster.node.ClusterNode`; the sidecar wires it in
(``BlockStore.remote``) when ``cluster.enabled``. The state layer never imports the cluster
package: this Protocol is all it knows, and the cluster works on the store only through
:mod:`kvstore.store.exchange`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.store.books.index import Block, NsEntry


MAX_HOLDERS = 256  # distinct nodes one run through others' blocks goes through: a Lookup answer indexes them
# in a byte each (LookupResponse.holders), and a fetch runs one task (and connection) per holder's run


@dataclass(slots=True, frozen=True)
class PeerBlock:
    """A block another node holds: which node, the placement bits of its copy there, its size and
    the checksum the node published (0: not sealed when it did)."""

    node: str
    tiers: int
    size: int
    checksum: int = 0


class Remote(Protocol):
    """The blocks the rest of the cluster holds beyond this node's own."""

    @property
    def active(self) -> bool:
        """Whether asking is worth a round trip (a directory is configured and reachable)."""
        ...

    async def find(
        self, ns: NsEntry, keys: Sequence[bytes], parent: bytes = b"", depth: int = 1
    ) -> tuple[int, list[PeerBlock]]:
        """The leading run of ``keys`` (the blocks after this node's own run) that the cluster
        holds, one directory round trip: how many leading ones a shared tier of this node holds
        (written there by another node; they are placed in this node's index on the way, so the
        caller's next local lookup finds them), then the blocks after those that other nodes hold."""
        ...

    async def fetch(self, ns: NsEntry, keys: Sequence[bytes], parent: bytes, depth: int) -> int:
        """Bring the leading run of ``keys`` that the cluster holds into this node: shared-tier
        copies placed in the index, other nodes' copies fetched into DRAM slots (checksum-verified);
        ``parent`` is the key before ``keys[0]`` (b"" at the root) and ``depth`` the 1-based
        position of ``keys[0]`` in its prompt. How
        many leading blocks are now local. A peer that is down, slow or sends bad bytes ends the
        run there: a miss, never an error."""
        ...

    def published(self, blocks: Sequence[Block]) -> asyncio.Future[None] | None:
        """A future done once the directory lists ``blocks`` (None: nothing to wait for)."""
        ...

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """Per live node (this one included), the leading run of ``keys`` it can serve, counted
        by where each block lies from that node (its own tiers by name, ``peer`` for another
        node's): what a router ranks nodes by (``kvstore.routing``). One directory round trip."""
        ...


class NoRemote:
    """A node on its own: nothing beyond it."""

    active = False

    async def find(
        self, ns: NsEntry, keys: Sequence[bytes], parent: bytes = b"", depth: int = 1
    ) -> tuple[int, list[PeerBlock]]:
        return 0, []

    async def fetch(self, ns: NsEntry, keys: Sequence[bytes], parent: bytes, depth: int) -> int:
        return 0

    def published(self, blocks: Sequence[Block]) -> asyncio.Future[None] | None:
        return None

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        return {}
