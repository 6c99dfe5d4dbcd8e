"""The commits waiting for their blocks' records to be published (``Commit(wait_published=true)``).

A waiter is answered after the publisher's pass that wrote its blocks: success only when the
directory took every one of their records; an error when it refused one (its key of another type:
:class:`~kvstore.errors.FailedPrecondition`, trying again does not help) or could not be written
to (:class:`~kvstore.errors.Unavailable`: the records are kept and written when it is back, but
the commit does not wait that long). Never success for a block that was not published.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.errors import FailedPrecondition, KVStoreError, Unavailable
from kvstore.store.books.index import Block

Where = tuple[bytes, bytes]  # (namespace root, block key)


class PublishWaiters:
    def __init__(self) -> None:
        self._waiting: list[tuple[asyncio.Future[None], list[Where]]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, blocks: Sequence[Block]) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieved)  # (a commit cancelled meanwhile never reads the answer)
        self._waiting.append((fut, [(b.ns.root, b.key) for b in blocks]))
        return fut

    def take(self) -> list[tuple[asyncio.Future[None], list[Where]]]:
        """The waiters so far: those a pass starting now answers."""
        taken, self._waiting = self._waiting, []
        return taken

    def answer(
        self, waiters: list[tuple[asyncio.Future[None], list[Where]]], error: str = "",
        refused: dict[Where, str] | None = None,
    ) -> None:
        """Answer ``waiters`` after a pass that failed with ``error`` ("" where it ran) and in
        which the directory refused the records of ``refused`` (where -> why)."""
        refused = refused or {}
        for fut, where in waiters:
            if fut.done():
                continue
            exc: KVStoreError | None = None
            if error:
                exc = Unavailable(f"wait_published: the cluster directory was not written (the blocks are committed "
                                  f"on this node and published once it is back): {error}")
            elif bad := [w for w in where if w in refused]:
                exc = FailedPrecondition(f"wait_published: the cluster directory refused the records of {len(bad)} "
                                         f"of the {len(where)} blocks (committed on this node, not listed): "
                                         f"{refused[bad[0]]}")
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

    def fail_all(self, error: str) -> None:
        self.answer(self.take(), error)


def _retrieved(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()
