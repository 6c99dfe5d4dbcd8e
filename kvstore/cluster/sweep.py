"""The directory's bounded background sweep: void records (and piles of forged fields) are deleted.

A lookup deletes every void record it meets (a past incarnation's, a lapsed lease's, a member's
that left or was forgotten: :meth:`~kvstore.cluster.membership.Membership.void`), but records of
prompts nobody asks for again would stay for ever: a node killed and restarted, or gone for good,
would leave all it held. So each node walks the directory's ``d:`` keys
(:meth:`~kvstore.cluster.directory.Directory.scan_keys`), about ``keys_per_pass`` a pass, a pass
every heartbeat, and deletes the void records it reads (compare-and-delete: a record rewritten
since stays). A walk of D keys takes about D / keys_per_pass heartbeats; the directory's load is
bounded by that rate per node, and its size by what live nodes hold.

It also deletes the fields whose MAC fails (written without the cluster token, moved from another
key or node, or by a version before the MAC) of a key that holds more fields than any block has
holders (:data:`~kvstore.cluster.directory.CROWDED`, when the walk first reads it): a directory
writer's pile, which nobody reads and nobody else would delete, so every walk would re-read
hundreds of thousands of them for ever. Compare-and-delete too; the rest of a crowded key's
forgeries go as the walk reads them. A key of a few such fields (a node given another token, a
node of an older version: one field a key) is left alone, as it costs what a key's holders cost:
no node deletes another's records for a mistake in its own configuration. A key is read in pieces
(``HSCAN`` with a ``COUNT``, :meth:`~kvstore.cluster.directory.Directory.read_fields`),
:data:`PIPELINE_KEYS` keys a round trip (the loop runs between them), at most ``keys_per_pass`` ×
:data:`FIELDS_PER_KEY` fields a pass; a key read in part goes on at the next pass where its HSCAN
left off, beside the walk, which goes on meanwhile (half of each pass's fields for each).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from kvstore.cluster.directory import CROWDED, SCAN_START, Directory, Piece, Record, ScanCursor

PIPELINE_KEYS = 64  # keys read in one round trip
FIELDS_PER_KEY = 16  # a pass reads at most keys_per_pass times this many fields
LONG_KEYS = PIPELINE_KEYS  # keys read in part followed at most: past this, the walk takes no new keys


class Sweeper:
    def __init__(
        self, directory: Directory, void: Callable[[str, Record], bool], stats: Counter[str], keys_per_pass: int
    ) -> None:
        self.directory = directory
        self.void = void  # whether a node's record can be deleted (its node's life or lease is over)
        self.stats = stats
        self.keys_per_pass = keys_per_pass
        self.fields_per_pass = keys_per_pass * FIELDS_PER_KEY
        self._cursor: ScanCursor = SCAN_START
        self._scanned = False  # the walk's SCAN is back at its start: the walk ends with its last keys
        # keys to read: (key, HSCAN cursor, whether it was crowded when read first); those the SCAN
        # gave, and those read in part (a long key: it goes on beside the walk, which does not wait)
        self._fresh: deque[tuple[bytes, int, bool]] = deque()
        self._long: deque[tuple[bytes, int, bool]] = deque()

    async def step(self) -> int:
        """Read the next keys of the walk (half the pass's fields at most) and the next pieces of
        long keys (the rest), and delete their void records and forged fields; how many went.
        What a pass cut short (its deadline) left is read next pass."""
        if not self._fresh and len(self._long) <= LONG_KEYS:
            self._cursor, keys = await self.directory.scan_keys(self._cursor, self.keys_per_pass)
            going = {k for k, _, _ in self._long}  # (read on where they are: not again from the start)
            self._fresh.extend((k, 0, False) for k in keys if k not in going)
            self._scanned = self._cursor == SCAN_START
        gone, read = await self._drain(self._fresh, self.fields_per_pass // 2)
        if self._scanned and not self._fresh:
            self.stats["sweep_walks"] += 1
            self._scanned = False
        more, _ = await self._drain(self._long, self.fields_per_pass - read)
        return gone + more

    async def _drain(self, keys: deque[tuple[bytes, int, bool]], budget: int) -> tuple[int, int]:
        """Read ``keys`` a pipeline at a time until about ``budget`` fields are read; a key read
        in part goes to the long keys. How many records went, how many fields were read."""
        gone = read = 0
        while keys and read < budget:
            batch = [keys.popleft() for _ in range(min(PIPELINE_KEYS, len(keys)))]
            try:
                pieces = await self.directory.read_fields([(k, at) for k, at, _ in batch])
            except BaseException:
                keys.extendleft(reversed(batch))  # (read again next pass)
                raise
            crowded = {k for k, _, was in batch if was}
            crowded.update(p.key for p in pieces if p.size > CROWDED)
            self._long.extend((p.key, p.cursor, p.key in crowded) for p in pieces if p.cursor)
            read += sum(p.fields for p in pieces)
            gone += await self._forget(pieces, crowded)
        return gone, read

    async def _forget(self, pieces: list[Piece], crowded: set[bytes]) -> int:
        """Delete the void records of ``pieces``, and the forged fields of those of ``crowded``
        keys; how many went."""
        stale = [(p.key, node, rec) for p in pieces for node, rec in p.holders.items() if self.void(node, rec)]
        forged = [(p.key, field, value) for p in pieces if p.key in crowded for field, value in p.forged]
        gone = await self.directory.forget_keys(stale) if stale else 0
        rejected = await self.directory.forget_fields(forged) if forged else 0
        self.stats["sweep_keys"] += sum(not p.cursor for p in pieces)
        self.stats["sweep_forgotten"] += gone
        self.stats["sweep_forged_forgotten"] += rejected
        return gone + rejected
