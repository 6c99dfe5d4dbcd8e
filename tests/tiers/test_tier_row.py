"""A tier is its backend file plus one row of kvstore/tier_table.py (issue #40, item 5).

This module is a whole new tier: ``AtticTier`` below (a directory of files, real bytes) and the
row that registers it. A real sidecar, on real sockets, then demotes to it, promotes from it,
reports it on the wire, counts it in /stats and takes a tenant quota for it, with no other
edit anywhere."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import tier_table
from kvstore.client import KVStoreClient
from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.index import TOP_LABEL, TierId
from kvstore.tier_table import TierRow
from kvstore.tiers.base import BlockMeta, BlockRef, TierBase, decode_header, encode_header, header_size
from kvstore.v1 import kvstore_pb2 as pb
from tests.conftest import small_config

NS = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16)
BLOCK = 4096


class AtticTier(TierBase):
    """A directory of block files (header, then the bytes): the whole backend of a new tier."""

    name = "attic"

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_config(cls, cfg: Any) -> AtticTier:
        return cls(Path(cfg))

    @classmethod
    def from_app_config(cls, config: Config) -> AtticTier:
        return cls(Path(config.data_dir) / "attic")

    def _path(self, ref: BlockRef) -> Path:
        return self.root / ref.name.replace("/", "-")

    async def contains(self, ref: BlockRef) -> bool:
        return self._path(ref).exists()

    async def get(self, ref: BlockRef, into: memoryview) -> BlockMeta | None:
        try:
            raw = self._path(ref).read_bytes()
        except FileNotFoundError:
            return None
        meta = decode_header(raw)
        start = header_size(raw)
        into[: meta.size] = raw[start : start + meta.size]
        return meta

    async def put(self, meta: BlockMeta, data: memoryview) -> None:
        tmp = self._path(meta.ref).with_suffix(".tmp")
        tmp.write_bytes(encode_header(meta) + bytes(data[: meta.size]))
        os.replace(tmp, self._path(meta.ref))

    async def delete(self, ref: BlockRef) -> None:
        self._path(ref).unlink(missing_ok=True)

    async def close(self) -> None:
        pass


ROW = TierRow("attic", bit=16, proto=9, backend=(__name__, "AtticTier"), load_cost=(50e6, 0.01))


@pytest.fixture
def attic() -> Iterator[TierRow]:
    tier_table.register(ROW)
    try:
        yield ROW
    finally:
        tier_table.unregister(ROW.name)


def placement(sc: Sidecar, keys: list[bytes]) -> list[str]:
    blocks = sc.store.index.namespaces[NS.root].blocks
    return [TOP_LABEL[blocks[k].tiers] if k in blocks else "gone" for k in keys]


async def test_a_tier_registered_from_a_test_module_demotes_and_promotes_through_a_sidecar(
    tmp_path: Path, attic: TierRow
) -> None:
    """64 DRAM slots, 96 blocks: the 32 oldest go down to the attic (its files hold their bytes),
    a Lookup names the attic on the wire, reading them back promotes them with the right bytes."""
    cfg = small_config(tmp_path, **{"tiering.chain": ["attic"], "tenants.attic_quota_bytes": 1 << 30})
    assert cfg.tenants.quota("attic") == (1 << 30, {})
    keys = prefix_keys(NS, list(range(96 * NS.block_size)))
    data = [np.full(BLOCK, i, np.uint8) for i in range(96)]
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        assert [(lv.name, lv.bit) for lv in sc.store.tiering.levels] == [("attic", 16)]
        for i in range(0, 96, 32):
            await c.put_blocks(NS, keys[i : i + 32], data[i : i + 32], first_parent=keys[i - 1] if i else b"")
        await sc.store.tiering.flush()
        where = placement(sc, keys)
        assert [where.count(t) for t in ("attic", "dram", "gone")] == [32, 64, 0]
        down = [i for i, w in enumerate(where) if w == "attic"]
        files = sorted((tmp_path / "data" / "attic").iterdir())
        assert len(files) == 32
        assert {f.read_bytes()[-BLOCK:] for f in files} == {bytes(data[i]) for i in down}

        found = await c.lookup(NS, keys)
        assert found.matched == 96 and [t for t, _ in found.blocks] == where  # the attic's proto value, named

        for i in down[:8]:  # each read brings the block up (and sends another down)
            (got,) = await c.get_blocks(NS, [keys[i]])
            assert np.array_equal(got, data[i])
        await sc.store.tiering.flush()
        assert [placement(sc, [keys[i]])[0] for i in down[:8]] == ["dram"] * 8
        stats = await c.stats()
        attic_stats = stats["tiers"]["attic"]
        assert attic_stats["enabled"] and attic_stats["errors"] == 0
        assert attic_stats["promotions"] == 8 and stats["tiers"]["dram"]["demotions"] >= 32


def test_the_proto_enum_and_the_replay_s_tier_ids_are_the_table_s_columns() -> None:
    """The wire's Tier enum stays (compatibility), and the replay names the built-in tiers by
    TierId: the table says each one's value and bit."""
    for row in tier_table.ROWS:
        assert pb.Tier.Value(f"TIER_{row.name.upper()}") == row.proto
    assert pb.TIER_PEER == tier_table.PEER_PROTO
    assert [(t.label, int(t)) for t in TierId] == [(r.name, r.bit) for r in tier_table.ROWS]


def test_a_row_that_clashes_is_refused_naming_what_clashes(attic: TierRow) -> None:
    with pytest.raises(ValueError, match="'ssd': taken"):
        tier_table.register(TierRow("ssd", 32, 10, ("x", "Y")))
    with pytest.raises(ValueError, match="bit 64 is not the next one"):
        tier_table.register(TierRow("cellar", 64, 10, ("x", "Y")))
    with pytest.raises(ValueError, match="proto value 9 is taken"):
        tier_table.register(TierRow("cellar", 32, 9, ("x", "Y")))
    assert tier_table.NAMES[-1] == "attic"


def test_an_unregistered_tier_in_the_chain_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiering\.chain: .*unknown tier 'attic' \(allowed: ssd, redis, s3\)"):
        small_config(tmp_path, **{"tiering.chain": ["attic"]})
    with pytest.raises(ConfigError, match=r"tenants\.attic_quota_bytes"):
        small_config(tmp_path, **{"tenants.attic_quota_bytes": 1})
