"""The SSD tier under a real sidecar: private files, real-size accounting, eviction at the edge.

Each test starts an in-process sidecar on real sockets with an SSD directory and talks to it
over gRPC; another uid is a real child process."""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.movers.level import Level
from kvstore.server.sidecar import Sidecar
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.recycle import FREE_DIR
from kvstore.tiers.segments.tier import SegmentTier
from kvstore.tiers.ssd import SsdTier
from tests.conftest import small_config

NS = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16)
BLOCK = 4096
NOBODY = 65534


def chain(first_token: int, n: int) -> list[bytes]:
    return prefix_keys(NS, [first_token] * (n * NS.block_size))


def payloads(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def ssd_level(sc: Sidecar) -> Level:
    return next(lv for lv in sc.store.tiering.levels if lv.name == "ssd")


def placement(sc: Sidecar, keys: list[bytes]) -> list[str]:
    from kvstore.store.books.index import TOP_LABEL

    entry = sc.store.index.namespaces.get(NS.root)
    blocks = entry.blocks if entry is not None else {}
    return [TOP_LABEL[blocks[k].tiers] if k in blocks else "gone" for k in keys]


def block_files(root: Path) -> list[Path]:
    return [p for p in root.glob("*/*.blk")]


def assert_books_balance(sc: Sidecar, root: Path) -> None:
    """What the index places on the SSD is what the directory holds, byte for byte (the segment
    layout: what its log names, slot for slot)."""
    lv = ssd_level(sc)
    if isinstance(lv.tier, SegmentTier):
        held = {lv.ref(b) for b in lv.held}
        assert all(lv.tier.locate(ref) is not None for ref in held) and len(lv.tier) == len(held)
        assert lv.used == lv.tier.used_bytes == len(held) * BLOCK <= lv.capacity  # type: ignore[operator]
        return
    placed = {lv.tier.path_of(lv.ref(b)) for b in lv.held}
    files = block_files(root)
    assert placed == set(files)
    on_disk = sum(p.stat().st_size for p in files)
    assert lv.used == lv.tier.used_bytes == on_disk <= lv.capacity  # type: ignore[operator]  # the SSD's is set


# ---- files only the sidecar's user can read ----------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may walk through (pytest's tmp_path is 0700: nobody could reach
    the files whatever their modes), as a data directory under /var/lib or /srv would be."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-perm-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def read_as_nobody(paths: list[Path]) -> dict[str, str]:
    """List (a directory) or read (a file) each path as uid/gid 65534 without supplementary
    groups, with system tools (the interpreter may sit under root's 0700 home): "read", or the
    error the tool printed."""
    out = {}
    for path in paths:
        cmd = ["ls", str(path)] if path.is_dir() else ["head", "-c", "64", str(path)]
        got = subprocess.run(cmd, check=False, user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, cwd="/")
        out[str(path)] = "read" if got.returncode == 0 else got.stderr.decode().strip()
    return out


def denied(results: dict[str, str]) -> bool:
    return all("Permission denied" in r for r in results.values())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a child as another uid needs root (CI runs as root)")
async def test_demoted_blocks_are_unreadable_by_other_users(tmp_path, shared_dir):
    ssd = shared_dir / "ssd"
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.path": str(ssd), "ssd.capacity_bytes": 1 << 20,
                                    "ssd.layout": "files"})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(1, 4), chain(2, 64)
        await c.put_blocks(NS, a, payloads(4, 1))
        await c.put_blocks(NS, b, payloads(64, 2))  # the 64 slots of DRAM: a goes down to SSD
        await sc.store.tiering.flush()
        assert placement(sc, a) == ["ssd"] * 4
        await c.delete(NS, a[2:])  # two files go to the free pool, to be overwritten later
        kept = [ssd_level(sc).tier.path_of(BlockRef(NS.root, k)) for k in a[:2]]
        free = sorted((ssd / FREE_DIR).iterdir())
        assert len(free) == 2
        dirs = [ssd, kept[0].parent, ssd / FREE_DIR]
        assert [mode(p) for p in dirs] == [0o700] * 3
        assert [mode(p) for p in kept + free] == [0o600] * 4
        got = read_as_nobody([*dirs, *kept, *free])
        assert "read" not in got.values(), got
        # The directories and the kept blocks stay where they are; a free-pool file may be taken back
        # by the tier's I/O threads meanwhile (then it is gone, not readable): the others must say why.
        assert {p: r for p, r in got.items() if "Permission denied" not in r and p not in map(str, free)} == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="running a child as another uid needs root (CI runs as root)")
async def test_the_segment_layouts_files_are_unreadable_by_other_users(tmp_path, shared_dir):
    """The segment layout: every file under the SSD directory (segments, both logs, ``LAYOUT``)
    is 0600 and every directory 0700; with the directories opened up, nobody else reads a file.
    (``LAYOUT`` was written 0644.)"""
    ssd = shared_dir / "ssd"
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.path": str(ssd), "ssd.capacity_bytes": 1 << 20,
                                    "ssd.layout": "segments"})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        await c.put_blocks(NS, chain(1, 4), payloads(4, 1))
        await c.put_blocks(NS, chain(2, 64), payloads(64, 2))  # the 64 slots of DRAM: the first 4 go down
        await sc.store.tiering.flush()
        assert placement(sc, chain(1, 4)) == ["ssd"] * 4 and isinstance(ssd_level(sc).tier, SegmentTier)
        everything = [ssd, *ssd.rglob("*")]
        files = [p for p in everything if p.is_file()]
        assert {p.name for p in files} >= {"LAYOUT", "index.log", "namespaces.log", "0.seg"}
        assert {str(p): mode(p) for p in everything} == {str(p): 0o700 if p.is_dir() else 0o600 for p in everything}
        for path in everything:
            if path.is_dir():
                path.chmod(0o755)  # the directories opened up: the files alone keep others out
        assert denied(read_as_nobody(files))


@pytest.mark.skipif(os.geteuid() != 0, reason="running a child as another uid needs root (CI runs as root)")
async def test_a_directory_an_older_version_left_readable_is_tightened_at_start(tmp_path, shared_dir, block):
    """0644 files in 0755 directories, as versions before 0600/0700 made them: the next start
    takes group and other permissions off every directory and file, and still serves them."""
    ssd = shared_dir / "ssd"
    old = SsdTier(ssd, 1 << 20)
    items = [block(i, BLOCK) for i in range(3)]
    await old.put_many(items)
    await old.delete(items[2][0].ref)  # one in the free pool
    await old.close()
    for path in [ssd, *ssd.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    loose = [p for p in ssd.rglob("*") if p.is_file()]
    assert len(loose) == 3 and set(read_as_nobody(loose).values()) == {"read"}

    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.path": str(ssd), "ssd.capacity_bytes": 1 << 20,
                                    "ssd.layout": "files"})
    async with Sidecar(cfg) as sc:
        assert len(ssd_level(sc).held) == 2  # both blocks recovered
        everything = [ssd, *ssd.rglob("*")]
        assert {str(p): mode(p) for p in everything} == {str(p): 0o700 if p.is_dir() else 0o600 for p in everything}
        for path in everything:
            if path.is_dir():
                path.chmod(0o755)  # the directories opened up again: the files alone keep others out
        assert denied(read_as_nobody(loose))
        into = memoryview(bytearray(BLOCK))
        assert await ssd_level(sc).tier.get(items[0][0].ref, into) == items[0][0] and into == items[0][1]


# ---- capacity: the real size of every file, and eviction instead of refusal --------------------


async def test_blocks_with_long_labels_count_their_real_size_and_give_way(tmp_path):
    """An older version kept 60,000-character labels (the namespace fields were unbounded): each
    file of a 4 KiB block took 64 KiB. Recovered, they must count as 64 KiB each, so the SSD
    evicts them for new demotions instead of refusing every one as "ssd tier full" and losing
    the blocks that DRAM evicted."""
    ssd = tmp_path / "ssd"
    capacity = 1 << 20
    old = SsdTier(ssd, capacity)
    label = "x" * 60_000
    old_items = []
    for i in range(16):  # 16 x 64 KiB: the whole SSD
        data = np.full(BLOCK, i, np.uint8)
        ref = BlockRef(b"L" * 32, i.to_bytes(32, "big"))
        old_items.append((BlockMeta(ref, b"", BLOCK, checksum(data), label), memoryview(data)))
    await old.put_many(old_items)
    await old.close()
    assert sum(p.stat().st_size for p in block_files(ssd)) == capacity

    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.path": str(ssd), "ssd.capacity_bytes": capacity,
                                    "ssd.layout": "files"})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        assert ssd_level(sc).used == capacity  # the files' real size, not 8 KiB a block
        keys = [chain(100 + i, 16) for i in range(8)]
        data = [payloads(16, 100 + i) for i in range(8)]
        for k, d in zip(keys, data):  # 128 blocks through 64 DRAM slots: 64 go down to the SSD
            await c.put_blocks(NS, k, d)
        await sc.store.tiering.flush()
        stats = await c.stats()
        assert stats["tiers"]["ssd"]["errors"] == 0
        assert [placement(sc, k) for k in keys[:4]] == [["ssd"] * 16] * 4  # none lost
        for k, d in zip(keys[:4], data[:4]):
            assert [g.tobytes() for g in await c.get_blocks(NS, k)] == [x.tobytes() for x in d]
        assert stats["tiers"]["ssd"]["evictions"] >= 8  # 64 x 8 KiB needed half of the old files' room
        await sc.store.tiering.flush()  # (the reads promoted blocks, and pushed others down)
        assert_books_balance(sc, ssd)


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_promotion_churn_at_the_capacity_edge_evicts_instead_of_refusing(tmp_path, layout):
    """1 MiB of SSD under 4 MiB of DRAM, blocks read back at random: every promotion evicts a
    burst from DRAM bigger than the SSD. The SSD evicts its own blocks for each batch it writes;
    no demotion fails "ssd tier full", the index places exactly what the directory holds, and
    lookups and reads go on answering, with the right bytes."""
    ssd = tmp_path / "ssd"
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.path": str(ssd), "ssd.capacity_bytes": 1 << 20,
                                    "dram.capacity_bytes": 4 << 20, "dram.page_bytes": 1 << 20, "ssd.layout": layout})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        keys = [chain(i, 32) for i in range(48)]  # 6 MiB of 4 KiB blocks
        data = [np.full(BLOCK, i, np.uint8) for i in range(48)]
        for k, d in zip(keys, data):
            await c.put_blocks(NS, k, [d] * 32)
        rng = random.Random(9)
        for _ in range(60):
            i = rng.randrange(48)
            got = await c.get_blocks(NS, keys[i])
            assert all(np.array_equal(g, data[i]) for g in got)
        await sc.store.tiering.flush()
        stats = await c.stats()
        assert stats["tiers"]["ssd"]["errors"] == 0
        assert stats["tiers"]["ssd"]["evictions"] > 0 and stats["tiers"]["ssd"]["promotions"] > 0
        assert_books_balance(sc, ssd)
        for k, d in zip(keys, data):  # (each read pushes others down: what a lookup found may go meanwhile)
            assert (await c.lookup(NS, k)).matched >= 0
            assert all(np.array_equal(g, d) for g in await c.get_blocks(NS, k))


async def test_a_burst_bigger_than_the_ssd_fills_it_and_refuses_nothing(tmp_path):
    """128 DRAM evictions in a burst into a 256 KiB SSD (32 files of 8 KiB): one batch of them
    was bigger than the whole tier and was refused, with every block in it. The SSD writes
    batches that fit and evicts blocks of its own for each (which ones, its policy says); it
    ends full, every block it holds whole."""
    ssd = tmp_path / "ssd"
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.path": str(ssd), "ssd.capacity_bytes": 32 * 2 * BLOCK,
                                    "ssd.layout": "files"})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        keys, data = chain(7, 192), payloads(192, 7)
        for i in range(0, 192, 64):  # DRAM's 64 slots, then twice as many again: evicts 0..127 in a burst
            await c.put_blocks(NS, keys[i : i + 64], data[i : i + 64], first_parent=keys[i - 1] if i else b"")
        await sc.store.tiering.flush()
        stats = await c.stats()
        assert stats["tiers"]["ssd"]["errors"] == 0
        where = placement(sc, keys)
        assert [where.count(t) for t in ("dram", "ssd", "gone")] == [64, 32, 96]  # a full SSD, nothing refused
        assert stats["tiers"]["ssd"]["evictions"] == 96
        assert_books_balance(sc, ssd)
        tier = ssd_level(sc).tier
        for k, d in [(k, d) for k, d, t in zip(keys, data, where) if t == "ssd"]:
            into = memoryview(bytearray(BLOCK))
            assert await tier.get(BlockRef(NS.root, k), into) is not None and into == d.tobytes()
