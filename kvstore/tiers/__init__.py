"""Storage tiers below DRAM, built by name through one lazy registry.

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
from kvstore.tiers.base import BlockMeta, BlockRef, Recoverable, Tier, TierBase

# name -> (module, class). Add a tier here; nothing else branches on names.
TIERS: dict[str, tuple[str, str]] = {
    "ssd": ("kvstore.tiers.ssd", "SsdTier"),
    "redis": ("kvstore.tiers.redis", "RedisTier"),
    "s3": ("kvstore.tiers.s3", "S3Tier"),
}


class TierClass(Protocol):
    """A tier class as the registry uses it: its name and its two constructors (classmethods)."""

    name: str

    def from_config(self, cfg: Any) -> Tier: ...

    def from_app_config(self, config: Any) -> Tier: ...


def tier_class(name: str) -> TierClass:
    try:
        module, cls_name = TIERS[name]
    except KeyError:
        raise ConfigError(f"unknown tier {name!r} (known: {', '.join(sorted(TIERS))})") from None
    cls: TierClass = getattr(importlib.import_module(module), cls_name)
    return cls


def build_tier(name: str, config: Any) -> Tier:
    """A tier from the whole ``Config`` or from its own section."""
    from kvstore.config import Config

    cls = tier_class(name)
    if isinstance(config, Config):
        return cls.from_app_config(config)
    return cls.from_config(config)


__all__ = ["TIERS", "BlockMeta", "BlockRef", "Recoverable", "Tier", "TierBase", "TierClass", "build_tier", "tier_class"]
