"""Eviction policies, one small strategy per module, chosen by name.

``make_policy(name)`` is the one registry: name -> (module, class), imported lazily.
"""

from __future__ import annotations

import importlib

from kvstore.errors import ConfigError
from kvstore.policy.base import EvictionPolicy

_REGISTRY: dict[str, tuple[str, str]] = {
    "lru": ("kvstore.policy.lru", "LRUPolicy"),
    "credit": ("kvstore.policy.credit", "CreditLRUPolicy"),
}

# The server's default. `credit` (LRU plus bounded frequency credit, O(1) queues) is never below
# LRU on the two Mooncake traces and on the held-out generated shapes at 1-25% of the unique
# blocks, and it scores up to 1.12x LRU at 5% (conversation). It does not meet issue 4's 5%
# targets (1.25x LRU, 0.7x Belady); see docs/eviction.md. `index.policy = "lru"` restores LRU.
DEFAULT_POLICY = "credit"


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, **kwargs: object) -> EvictionPolicy:
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"index.policy: unknown policy {name!r}; allowed: {policy_names()}") from None
    policy: EvictionPolicy = getattr(importlib.import_module(module), cls)(**kwargs)
    return policy
