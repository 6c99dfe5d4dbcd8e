"""How long the cluster's ghost keeps a use count: about as long as the node's own ghost would.

A node that lets a block go leaves the block's use count in the directory (a ``g:`` key,
kvstore/cluster/directory.py) for the next node that stores it (:meth:`EvictionPolicy.resume`).
How long that count is worth keeping depends on how fast the cache turns over, which no fixed
time fits: in the replay of the two Mooncake traces (8 nodes × 1%, ``credit``, prefix routing) a
fixed 150 s kept the most hits on synthetic and lost 2% there at 600 s, while conversation wanted
20 minutes or more (docs/cluster.md, "The cluster's ghost"). A node's own ghost is bounded by
count instead (``ghost`` × its capacity; kvstore/policy/credit.py), which scales with the
turnover by itself. :class:`GhostSpan` gives the directory's copy the same reach in time: the
node's ghost holds ``entries`` counts and takes one per block it lets go, so a count stays in it
for ``entries / rate`` seconds at the node's current let-go rate. That is the time to live of
every ``g:`` key the node writes, never more than ``cluster.ghost_ttl_s`` (the ceiling, also the
value while the node has not let enough go to know its rate) and never under :data:`MIN_TTL_S`.

One rule for the sidecar (kvstore/cluster/publisher.py, wall seconds) and the replay
(kvstore/sim/cluster.py, the trace's timestamps), so both keep the same counts for the same time:
it lives with the policies, which both may use.
"""

from __future__ import annotations

import math

# A count worth leaving: every count a policy keeps. A block stored once that comes back is the
# reuse credit's ghost exists for (in the replay, writing only counts of 2 or more kept about a
# third of the gain on synthetic: docs/cluster.md, "The cluster's ghost").
GHOST_MIN_USES = 1
RATE_TAU_S = 30.0  # the let-go rate is a moving average over about this long
MIN_TTL_S = 1.0


class GhostSpan:
    """A node's let-go rate (an exponentially weighted moving average of events, time constant
    :data:`RATE_TAU_S`) and the time to live it gives the counts the node leaves behind."""

    __slots__ = ("at", "rate", "seen_s")

    def __init__(self) -> None:
        self.rate = 0.0  # blocks let go per second
        self.at: float | None = None  # when the rate was last brought up to date
        self.seen_s = 0.0  # how long the rate has been measured

    def let_go(self, blocks: int, now_s: float) -> None:
        """``blocks`` blocks left this node at ``now_s`` (seconds, any monotonic origin)."""
        if self.at is not None and now_s > self.at:
            dt = now_s - self.at
            self.rate *= math.exp(-dt / RATE_TAU_S)
            self.seen_s += dt
        if self.at is None or now_s > self.at:
            self.at = now_s
        self.rate += blocks / RATE_TAU_S

    def ttl_s(self, entries: float, ceiling_s: float) -> float:
        """How long a count this node leaves now should last: ``entries`` (the size of the ghost
        the count left) over the let-go rate, within [:data:`MIN_TTL_S`, ``ceiling_s``]. Until the
        rate has been measured for :data:`RATE_TAU_S` (it starts from 0 and would read low, so
        the time long) the ceiling; 0 for a space with no ghost (``entries`` 0)."""
        if entries <= 0:
            return 0.0
        if self.seen_s < RATE_TAU_S or self.rate <= 0:
            return ceiling_s
        return min(ceiling_s, max(MIN_TTL_S, entries / self.rate))
