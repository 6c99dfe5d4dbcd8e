"""Eviction and admission policies, one small strategy per module, chosen by name.

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

DEFAULT_POLICY = "credit"


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, **kwargs: object) -> EvictionPolicy:
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"index.policy: unknown policy {name!r}; allowed: {policy_names()}") from None
    return getattr(importlib.import_module(module), cls)(**kwargs)
