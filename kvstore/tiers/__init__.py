"""The tier backends below DRAM, built by name through one lazy registry: the backend column of
:mod:`kvstore.tier_table`. What moves blocks between DRAM and them is :mod:`kvstore.movers`.

``build_tier("redis", config)`` imports ``kvstore.tiers.redis`` only then, so redis-py and
aioboto3 load only when their tier is selected (as vLLM's kv_connector factory does).
``config`` is either the whole :class:`kvstore.config.Config` (the tier's section is taken by
name, and tier classes may read shared settings such as ``data_dir`` from it) or just the
tier's own section (``SsdConfig``, ``RedisConfig``, ``S3Config``).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from kvstore.errors import ConfigError
from kvstore.tier_table import BY_NAME, LOWER
from kvstore.tiers.base import BlockMeta, BlockRef, Recoverable, Tier, TierBase

# A tier is its backend module plus its row in kvstore/tier_table.py (its name, bit, proto value,
# (module, class), shared or not): nothing else branches on names.


class TierClass(Protocol):
    """A tier class as the registry uses it: its name and its two constructors (classmethods)."""

    name: str

    def from_config(self, cfg: Any) -> Tier: ...

    def from_app_config(self, config: Any) -> Tier: ...


def tier_class(name: str) -> TierClass:
    backend = BY_NAME[name].backend if name in BY_NAME else None
    if backend is None:
        raise ConfigError(f"unknown tier {name!r} (known: {', '.join(sorted(LOWER))})")
    module, cls_name = backend
    cls: TierClass = getattr(importlib.import_module(module), cls_name)
    return cls


def build_tier(name: str, config: Any) -> Tier:
    """A tier from the whole ``Config`` or from its own section."""
    from kvstore.config import Config

    cls = tier_class(name)
    if isinstance(config, Config):
        return cls.from_app_config(config)
    return cls.from_config(config)


__all__ = ["BlockMeta", "BlockRef", "Recoverable", "Tier", "TierBase", "TierClass", "build_tier", "tier_class"]
