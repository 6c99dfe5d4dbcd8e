"""A little realistic traffic for a sidecar: prompts sharing prefixes in two namespaces, lookups
that hit partly, and reload-vs-recompute reports shaped like the connector's."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.keys import Namespace, prefix_keys

NAMESPACES = (
    Namespace(model="tiny-llama", kv_layout="hf", dtype="float32", block_size=16),
    Namespace(model="tiny-llama", kv_layout="hf", dtype="float32", block_size=16, cache_salt="tenant-b"),
)
BLOCK_BYTES = 8192


def prompt(round_no: int, shared: int = 4, own: int = 2) -> list[int]:
    """``shared`` blocks common to every round, then ``own`` blocks unique to this round."""
    rng = np.random.default_rng(1000 + round_no)
    return list(range(16 * shared)) + [int(t) for t in rng.integers(10_000, 20_000, 16 * own)]


def decision(ns: Namespace, round_no: int, cached: int, prompt_blocks: int) -> dict[str, Any]:
    load_s = 0.0004 * cached + 0.0002 + (0.006 if round_no % 4 == 3 else 0.0)  # every 4th: a slow tier
    recompute_s = 0.0011 * cached + 0.0006 * (round_no % 3)
    loaded = cached if load_s < recompute_s else 0
    return {
        "namespace": ns.label, "prompt_blocks": prompt_blocks, "cached_blocks": cached, "loaded_blocks": loaded,
        "tier": "dram" if loaded else "", "predicted_load_s": load_s, "predicted_recompute_s": recompute_s,
        "actual_s": load_s if loaded else recompute_s, "outcome": "loaded" if loaded else "recomputed",
    }


def one_round(client: Any, round_no: int) -> None:
    """Lookup a prompt (reusing earlier rounds' shared blocks), report, then store it. ``client``
    is a :class:`kvstore.client.SyncClient`."""
    ns = NAMESPACES[round_no % 2]
    tokens = prompt(round_no)
    keys = prefix_keys(ns, tokens)
    cached = client.lookup(ns, keys).matched
    if cached:
        client.report([decision(ns, round_no, cached, len(keys))])
    blocks = [np.full(BLOCK_BYTES, (round_no * 7 + i) % 251, np.uint8) for i in range(len(keys))]
    client.put_blocks(ns, keys, blocks, checksums=True)
