"""KV-aware routing: which node should serve a request, from where its prefix is cached and how busy each node is.

One pure function, :func:`rank`, shared by ``kvstore replay --routing prefix`` and the sidecar's
``Route`` RPC and ``/route`` (kvstore/server/service.py): given, per node, how many blocks of the
request's usable prefix it holds in each place, and each node's load, it returns the nodes best
first.

Scoring follows llm-d's KV-cache indexer and Dynamo's KV router: the longest consecutive cached
prefix, each block weighted by where it sits. Their published weights (as collected in the
project's shared notes on the field, CLUSTER.md, from llm-d/llm-d-kv-cache docs/architecture.md
and ai-dynamo/dynamo's router design docs):

* llm-d: a GPU hit 1.0, a CPU hit 0.8;
* Dynamo (prefill-cost estimate): a host-memory hit 0.75 and a disk hit 0.25 of a device hit.

kvstore never holds GPU memory, so its top tier (DRAM, host memory) is normalised to 1.0 and a
local SSD hit to Dynamo's disk/host ratio, 0.25 / 0.75 = 1/3. The other weights are this
project's assumption, not published figures: a block a peer node holds costs a network fetch
(``peer`` 0.5: dearer than local DRAM, cheaper than a local SSD read on a fast network); Redis and
S3 are shared by every node alike, so they add the same to every node and only weigh against load.

Load balancing is a hard cap: a node whose load would pass ``max_imbalance`` × the mean load
(counting the request being placed) is ranked after every node under the cap, so the busiest node
serves at most ``max_imbalance`` × the mean (never less than the mean rounded up, so small counts can
still be placed). Under the cap, the longest weighted prefix wins and ties go to the least loaded
node, then the lowest index. Ranking by the first block alone would send every request that shares
a root block (a system prompt) to one node; the cap and the least-loaded tie-break spread them.
A rendezvous-hash tie-break (so a returning prompt finds the node whose ``credit`` ghost remembers
it) was measured and not adopted: it moves both policies' hit rates ±4% with the node names and
puts LRU below the global cache under most namings (docs/cluster.md, "Rendezvous tie-break").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from kvstore.tier_table import ROUTE_WEIGHTS

# Each tier's route_weight (kvstore/tier_table.py: DRAM 1, the unit; SSD 1/3, Dynamo's disk 0.25 vs
# host memory 0.75; Redis 0.5 and S3 0.25, shared: equal for every node) and another node's copy
# (0.5).
TIER_WEIGHTS = ROUTE_WEIGHTS

MAX_IMBALANCE = 1.25  # the busiest node serves at most this × the mean

ROUTINGS = ("round-robin", "random", "prefix")  # the replay's ways to route: `prefix` is :func:`rank`


def prefix_score(prefix: Mapping[str, int], weights: Mapping[str, float] = TIER_WEIGHTS) -> float:
    """Weighted length of one node's usable prefix: ``prefix`` counts its blocks by where they sit."""
    try:
        return sum(weights[tier] * n for tier, n in prefix.items())
    except KeyError as exc:
        raise ValueError(f"prefix: unknown tier {exc.args[0]!r}; allowed: {sorted(weights)}") from None


def load_cap(loads: Sequence[float], max_imbalance: float = MAX_IMBALANCE) -> float:
    """The most load a node may reach by taking one more request."""
    n = len(loads)
    mean_after = (sum(loads) + 1) / n
    return max(max_imbalance * mean_after, math.ceil(mean_after))


def rank(prefixes: Sequence[Mapping[str, int]], loads: Sequence[float], max_imbalance: float = MAX_IMBALANCE,
         weights: Mapping[str, float] = TIER_WEIGHTS, tie: Callable[[int], float] | None = None) -> list[int]:
    """Node indices, best first, for one request.

    ``prefixes[i]`` counts node i's blocks of the request's usable prefix by place (``{"dram": 5,
    "peer": 3}``); ``loads[i]`` is node i's load (requests served, or in flight). ``tie(i)`` orders
    nodes equal in score and load (default: the lower index first)."""
    if len(prefixes) != len(loads):
        raise ValueError(f"rank: {len(prefixes)} prefixes for {len(loads)} loads")
    if not loads:
        return []
    cap = load_cap(loads, max_imbalance)
    scores = [prefix_score(p, weights) for p in prefixes]
    last = tie if tie is not None else float  # (float(i): the index itself)
    return sorted(range(len(loads)), key=lambda i: (loads[i] + 1 > cap, -scores[i], loads[i], last(i)))
