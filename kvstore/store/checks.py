"""A request's checks: what every :class:`~kvstore.store.block_store.BlockStore` call validates
before it changes anything.

The size of a batch (``server.max_batch_blocks``), its keys, a lease's or an allocation's TTL
against its cap, an Allocate's blocks (key, parent, size class, no key twice) and a Commit's slots
(each the allocation's own, under its key, listed once). Each check raises ``InvalidArgument``
naming the request's field; a call runs every check before its first change, so a rejected request
leaves no trace. Why one room: the messages and limits are the API's contract, read in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.config import Config
from kvstore.dram.slab import Slab
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, BlockKey, check_key
from kvstore.store.books.index import Allocation, Block


@dataclass(slots=True, frozen=True)
class BlockSpec:
    """One block of an Allocate: its key, its parent's key (b"" at the root) and its size."""

    key: bytes
    parent: bytes
    size: int


@dataclass(slots=True, frozen=True)
class CommitSpec:
    """One block of a Commit: its key, the slot allocated for it, the writer's checksum (None: none sent)."""

    key: bytes
    slot_id: int
    checksum: int | None


class Checks:
    """The checks of one store's requests, against its config's limits and its slab's size classes."""

    def __init__(self, config: Config, slab: Slab, clock: Callable[[], float]) -> None:
        self.config = config
        self.slab = slab
        self.clock = clock

    def batch(self, n: int, field: str) -> None:
        if n == 0:
            raise InvalidArgument(f"{field}: empty batch")
        limit = self.config.server.max_batch_blocks
        if n > limit:
            raise InvalidArgument(f"{field}: {n} blocks exceed the batch limit of {limit} (server.max_batch_blocks)")

    @staticmethod
    def keys(keys: Sequence[bytes], field: str) -> None:
        if set(map(len, keys)) <= {KEY_BYTES}:
            return
        for i, k in enumerate(keys):
            check_key(k, f"{field}[{i}]")

    def lease_deadline(self, ttl_ms: int) -> float:
        """When a lease of ``ttl_ms`` (0: the default) taken now ends; refused past the cap."""
        ttl = ttl_ms or self.config.index.lease_ttl_ms
        cap = self.config.index.max_lease_ttl_ms
        if ttl > cap:
            raise InvalidArgument(f"lease_ttl_ms: {ttl} exceeds the maximum of {cap} (index.max_lease_ttl_ms)")
        return self.clock() + ttl / 1000.0

    def blocks(self, specs: Sequence[BlockSpec], ttl_ms: int) -> tuple[list[BlockKey], list[int], int]:
        """An Allocate's blocks and TTL: their keys, their size classes, and the TTL in ms (0: the
        default)."""
        self.batch(len(specs), "blocks")
        seen: set[bytes] = set()
        classes: list[int] = []
        keys = []
        for i, s in enumerate(specs):
            keys.append(check_key(s.key, f"blocks[{i}].key"))
            if s.parent and len(s.parent) != KEY_BYTES:
                raise InvalidArgument(
                    f"blocks[{i}].parent: a block key is {KEY_BYTES} bytes (or empty), got {len(s.parent)}"
                )
            if s.key in seen:
                raise InvalidArgument(f"blocks[{i}].key: duplicate key in one request")
            seen.add(s.key)
            try:
                classes.append(self.slab.class_of(s.size))
            except InvalidArgument as exc:
                raise InvalidArgument(f"blocks[{i}].{exc}") from None
        cap = self.config.index.max_allocation_ttl_ms
        if ttl_ms > cap:
            raise InvalidArgument(f"ttl_ms: {ttl_ms} exceeds the maximum of {cap} (index.max_allocation_ttl_ms)")
        return keys, classes, ttl_ms or self.config.index.allocation_ttl_ms

    def slots(self, alloc_id: str, alloc: Allocation, specs: Sequence[CommitSpec]) -> list[tuple[Block, int | None]]:
        """A Commit's slots: each listed block with the checksum its writer sent, in the request's
        order."""
        self.batch(len(specs), "blocks")
        chosen: list[tuple[Block, int | None]] = []
        seen: set[int] = set()
        for i, s in enumerate(specs):
            b = alloc.blocks.get(s.slot_id)
            if b is None:
                raise InvalidArgument(f"blocks[{i}].slot_id: slot {s.slot_id} does not belong to allocation {alloc_id}")
            if b.key != s.key:
                raise InvalidArgument(f"blocks[{i}].key: slot {s.slot_id} was allocated for another key")
            if s.slot_id in seen:
                raise InvalidArgument(f"blocks[{i}].slot_id: slot {s.slot_id} listed twice")
            seen.add(s.slot_id)
            chosen.append((b, s.checksum))
        return chosen
