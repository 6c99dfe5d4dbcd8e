"""Health: the probe that brings a level marked down back up.

A tier that raises Unavailable is marked down by the mover that met it (:meth:`Level.mark_down`):
lookups treat its copies as a miss and no mover calls it. Once a second, :class:`Probe` asks each
down tier for a block; one that answers is up again. While any is down, the heap is trimmed every
``OUTAGE_TRIM_S``, and once more when it comes back.

Why trim: an outage's failed calls (their tracebacks, frames, dead connections) are garbage in
reference cycles that only a full collection frees, and left to pile up for the outage's length
they grow the heap to a peak it keeps (the soak's sidecar: ``RssAnon`` +6.7 MiB in an 18 s outage).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.errors import Unavailable
from kvstore.keys import BlockKey, NamespaceRoot
from kvstore.movers.level import Level
from kvstore.tiers.base import BlockRef
from kvstore.util.tasks import TaskHealth, cancel_and_wait, every
from kvstore.util.tuning import trim_heap

PROBE_TASK = "kvstore-tier-probe"
OUTAGE_TRIM_S = 5.0  # while a tier is down, the heap is trimmed this often (Probe.probe)


class Probe:
    """The background probe of the down levels of one chain."""

    def __init__(self, levels: Sequence[Level]) -> None:
        self.levels = levels
        self.task: asyncio.Task[None] | None = None
        self.outage_trims = 0  # heap trims while a tier was down
        self._trimmed = 0.0  # (loop time) the heap's last trim during an outage
        self._closing = False

    def start(self, health: TaskHealth) -> None:
        """Probe once a second from now on; ``health``: where the loop's errors go (counted, logged,
        reported by ``/readyz``)."""
        self._trimmed = asyncio.get_running_loop().time()
        # (stopped by _closing, not only by a cancel: a probe through redis-py can lose it, gh-86296)
        self.task = asyncio.create_task(
            every(PROBE_TASK, 1.0, self.probe, health, stop=lambda: self._closing), name=PROBE_TASK
        )

    async def stop(self) -> None:
        self._closing = True
        await cancel_and_wait([self.task])

    async def probe(self) -> None:
        """One pass: each down tier is probed; one that answers is up again (and the heap trimmed)."""
        probe = BlockRef(NamespaceRoot(bytes(32)), BlockKey(bytes(32)))
        now = asyncio.get_running_loop().time()
        if any(lv.down for lv in self.levels) and now - self._trimmed >= OUTAGE_TRIM_S:
            self._trimmed = now
            self.outage_trims += 1
            trim_heap()
        for lv in self.levels:
            if not lv.down:
                continue
            try:
                await lv.tier.contains(probe)
            except Unavailable:
                continue
            lv.mark_up()
            trim_heap()  # the outage's garbage (failed calls, dead connections): not kept at its peak
