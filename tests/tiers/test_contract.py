"""Every registered tier implements every Tier / Recoverable method with the same signature,
and the registry imports a tier's dependencies only when that tier is built."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys

import pytest

from kvstore.config import RedisConfig, S3Config, SsdConfig
from kvstore.errors import ConfigError
from kvstore.tier_table import LOWER
from kvstore.tiers import build_tier, tier_class
from kvstore.tiers.base import Recoverable, Tier

PROTOCOL_METHODS = [
    (proto, name)
    for proto in (Tier, Recoverable)
    for name, member in vars(proto).items()
    if inspect.isfunction(member) and not name.startswith("_")
]


def test_protocol_surface_is_what_we_think():
    assert sorted(n for _, n in PROTOCOL_METHODS) == sorted(
        [
            "contains",
            "get",
            "put",
            "delete",
            "close",
            "contains_many",
            "get_many",
            "get_many_hashed",
            "put_many",
            "delete_many",
            "scan",
        ]
    )


@pytest.mark.parametrize("tier_name", sorted(LOWER))
@pytest.mark.parametrize(("proto", "method"), PROTOCOL_METHODS, ids=[n for _, n in PROTOCOL_METHODS])
def test_tier_implements_method_with_same_signature(tier_name, proto, method):
    cls = tier_class(tier_name)
    impl = getattr(cls, method, None)
    assert impl is not None, f"{cls.__name__} lacks {method}"
    want = getattr(proto, method)
    assert inspect.signature(impl) == inspect.signature(want), f"{cls.__name__}.{method}"
    if inspect.iscoroutinefunction(want):
        assert inspect.iscoroutinefunction(impl), f"{cls.__name__}.{method} must be async"
    if method == "scan":
        assert inspect.isasyncgenfunction(impl), f"{cls.__name__}.scan must be an async generator"


@pytest.mark.parametrize("tier_name", sorted(LOWER))
def test_tier_has_name_and_constructors(tier_name):
    cls = tier_class(tier_name)
    assert cls.name == tier_name
    assert callable(cls.from_config) and callable(cls.from_app_config)


def test_unknown_tier_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown tier 'tape'"):
        tier_class("tape")


def test_registry_is_lazy(tmp_path):
    code = (
        "import sys, kvstore.tiers, kvstore.tiers.verify, kvstore.config;"
        "bad = [m for m in ('redis', 'aioboto3', 'aiobotocore', 'kvstore.tiers.redis', 'kvstore.tiers.s3')"
        " if m in sys.modules];"
        "assert not bad, bad;"
        "kvstore.tiers.build_tier('ssd', kvstore.config.SsdConfig(path=sys.argv[1]));"
        "assert 'redis' not in sys.modules and 'aioboto3' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "ssd")], check=True)


def test_build_from_sections(tmp_path):
    default = build_tier("ssd", SsdConfig(path=str(tmp_path / "default")))
    asyncio.run(default.close())
    assert type(default).__name__ == "SegmentTier"
    assert type(build_tier("ssd", SsdConfig(path=str(tmp_path / "files"), layout="files"))).__name__ == "SsdTier"
    assert type(build_tier("redis", RedisConfig(url="redis://127.0.0.1:1/0"))).__name__ == "RedisTier"
    assert type(build_tier("s3", S3Config(endpoint_url="http://127.0.0.1:1"))).__name__ == "S3Tier"
