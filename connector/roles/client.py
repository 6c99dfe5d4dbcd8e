"""The part of the sidecar client the connector uses, as Protocols.

The connector runs inside engines, which call it synchronously, so it talks to
``kvstore.client.SyncClient`` (the thin sync bridge over the async client); anything with these
methods works, including test doubles.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from kvstore.client import SlotRef
from kvstore.keys import Namespace


class LookupResultLike(Protocol):  # read-only members: the client's LookupResult is frozen
    @property
    def matched(self) -> int: ...

    @property
    def blocks(self) -> list[tuple[str, int]]:  # (tier, size) per matched block
        ...

    @property
    def lease_id(self) -> str | None: ...


class AllocationLike(Protocol):
    def writable(self, cpu: bool = True) -> Iterator[tuple[int, np.ndarray]]: ...

    # the flags are passed only when set (test doubles may take none)
    def commit(self, *, wait_published: bool = False, wait_write_through: bool = False) -> Any: ...


class PlacedAllocationLike(AllocationLike, Protocol):
    """An allocation that also says where its slots lie (``SyncClient``'s), for the engine's
    block directory: the slots, and the checksums its Commit sent."""

    checksums: dict[int, int]  # index in the request -> checksum sent with the Commit

    def commit(
        self, *, checksums: bool = False, wait_published: bool = False, wait_write_through: bool = False
    ) -> Any: ...

    def slot_refs(self) -> dict[int, SlotRef]: ...


class LeaseLike(Protocol):
    @property
    def views(self) -> Sequence[np.ndarray]: ...


class ConnectorClient(Protocol):
    # keys are BlockKeys; typed bytes, as the clients take them
    def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResultLike: ...

    def allocate(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parents: Sequence[bytes] | None = None,
    ) -> AbstractContextManager[AllocationLike]: ...

    def acquire(self, ns: Namespace, keys: Sequence[bytes]) -> AbstractContextManager[LeaseLike]: ...

    def retain(self, ns: Namespace, keys: Sequence[bytes], retain_ms: int, retain_priority: int = 0) -> int: ...
