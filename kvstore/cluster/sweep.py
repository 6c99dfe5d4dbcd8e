"""The directory's bounded background sweep: void records are deleted even where no lookup meets them.

A lookup deletes every void record it meets (a past incarnation's, a lapsed lease's, a member's
that left or was forgotten: :meth:`~kvstore.cluster.node.ClusterNode.void`), but records of
prompts nobody asks for again would stay for ever: a node killed and restarted, or gone for good,
would leave all it held. So each node walks the directory's ``d:`` keys
(:meth:`~kvstore.cluster.directory.Directory.scan`), about ``keys_per_pass`` a pass, a pass every
heartbeat, and deletes the void records it reads (compare-and-delete: a record rewritten since
stays). A walk of D keys takes about D / keys_per_pass heartbeats; the directory's load is bounded
by that rate per node, and its size by what live nodes hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvstore.cluster.directory import SCAN_START, Directory, Record, ScanCursor


class Sweeper:
    def __init__(
        self, directory: Directory, void: Callable[[str, Record], bool], stats: Counter[str], keys_per_pass: int
    ) -> None:
        self.directory = directory
        self.void = void  # whether a node's record can be deleted (its node's life or lease is over)
        self.stats = stats
        self.keys_per_pass = keys_per_pass
        self._cursor: ScanCursor = SCAN_START

    async def step(self) -> int:
        """Read the next keys of the walk and delete their void records; how many went."""
        cursor, found = await self.directory.scan(self._cursor, self.keys_per_pass)
        stale = [(key, node, rec) for key, holders in found for node, rec in holders.items() if self.void(node, rec)]
        gone = await self.directory.forget_keys(stale) if stale else 0
        self._cursor = cursor
        self.stats["sweep_keys"] += len(found)
        self.stats["sweep_forgotten"] += gone
        if cursor == SCAN_START:
            self.stats["sweep_walks"] += 1
        return gone
