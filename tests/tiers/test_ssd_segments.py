"""The SSD tier's segment layout (kvstore/tiers/segments/tier.py) on a real directory: the on-disk
overhead, slot reuse and hole punching, the log's torn tail and checkpoint, restart, the import
of a file-layout directory, and the refusals."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import SsdConfig
from kvstore.errors import ConfigError, ResourceExhausted
from kvstore.tiers import build_tier
from kvstore.tiers.segments.log import LOG_NAME, RECORD, read_log
from kvstore.tiers.segments.tier import SegmentTier
from kvstore.tiers.ssd import SsdTier
from tests.tiers.conftest import make_block

KIB16 = 16 * 1024


@pytest.fixture
async def tiers():
    """Opens segment tiers (``tiers(path, capacity, **kw)``) and closes those still open at the end."""
    opened: list[SegmentTier] = []

    def make(path: Path, capacity: int, **kw) -> SegmentTier:
        tier = SegmentTier(path, capacity, **kw)
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        if not tier.closed:
            await tier.close()


def one_label(item):
    meta, data = item
    return type(meta)(meta.ref, meta.parent, meta.size, meta.checksum, "model-x"), data


def buffer(n: int) -> memoryview:
    return memoryview(bytearray(n))


def segment_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "seg").rglob("*.seg"))


async def reads_back(tier: SegmentTier, items) -> bool:
    for meta, data in items:
        into = buffer(meta.size)
        got = await tier.get_many_hashed([meta.ref], [into])
        if got != [(meta, meta.checksum)] or into != data:
            return False
    return True


async def test_a_16k_block_takes_its_16k_and_one_record(tmp_path: Path, tiers):
    """No header page: 512 blocks of 16 KiB take 512 x 16 KiB of segments plus 128 bytes of log
    each (and one frame header a batch): under 1 % beyond the payload. The file layout took 20 KiB."""
    tier = tiers(tmp_path / "ssd", 1 << 30)
    items = [one_label(make_block(i, KIB16)) for i in range(512)]
    for a in range(0, 512, 64):
        await tier.put_many(items[a : a + 64])
    payload = 512 * KIB16
    on_disk = sum(p.stat().st_size for p in (tmp_path / "ssd").rglob("*") if p.is_file())
    assert segment_bytes(tmp_path / "ssd") == payload
    assert (tmp_path / "ssd" / LOG_NAME).stat().st_size == 512 * RECORD.itemsize + 8 * RECORD.itemsize
    assert (on_disk - payload) / payload < 0.01
    assert tier.used_bytes == payload == 512 * tier.footprint(KIB16, "any label")
    await tier.close()


async def test_deleted_slots_are_reused_and_not_revived_by_a_restart(tmp_path: Path, tiers):
    root = tmp_path / "ssd"
    tier = tiers(root, 64 * KIB16)
    first = [make_block(i, KIB16) for i in range(64)]  # the whole capacity
    await tier.put_many(first)
    with pytest.raises(ResourceExhausted):
        await tier.put(*make_block(999, KIB16))
    await tier.delete_many([m.ref for m, _ in first[:16]])
    second = [make_block(100 + i, KIB16) for i in range(16)]
    await tier.put_many(second)  # into the 16 freed slots: the segment does not grow
    assert segment_bytes(root) == 64 * KIB16
    assert tier.used_bytes == 64 * KIB16 and tier.recycled_bytes == 0
    await tier.close()

    again = tiers(root, 64 * KIB16)
    found = {m.ref async for m in again.scan()}
    assert found == {m.ref for m, _ in first[16:] + second}  # no deleted block comes back
    assert await reads_back(again, first[16:] + second)
    await again.close()


async def test_a_put_of_another_size_punches_free_slots(tmp_path: Path, tiers):
    """Free 16 KiB slots count against the capacity; a 64 KiB block needs their room: four are
    punched out (their disk given back) and the put fits."""
    root = tmp_path / "ssd"
    tier = tiers(root, 8 * KIB16)
    small = [make_block(i, KIB16) for i in range(8)]
    await tier.put_many(small)
    await tier.delete_many([m.ref for m, _ in small[:4]])
    big = make_block(50, 4 * KIB16)
    await tier.put(*big)
    assert tier.used_bytes == 8 * KIB16 and tier.recycled_bytes == 0
    allocated = sum(p.stat().st_blocks * 512 for p in (root / "seg").rglob("*.seg"))
    assert allocated <= 8 * KIB16 + 4096 * 4  # (a filesystem may keep a page around a hole)
    assert await reads_back(tier, [*small[4:], big])
    await tier.close()


async def test_a_torn_log_tail_is_cut_and_the_rest_is_found(tmp_path: Path, tiers):
    root = tmp_path / "ssd"
    tier = tiers(root, 1 << 30)
    items = [make_block(i, 5000) for i in range(10)]
    await tier.put_many(items[:6])
    await tier.put_many(items[6:])
    await tier.close()
    log = root / LOG_NAME
    whole = log.stat().st_size
    with log.open("r+b") as f:  # the second frame's last record half written
        f.truncate(whole - 60)
    again = tiers(root, 1 << 30)
    assert {m.ref async for m in again.scan()} == {m.ref for m, _ in items[:6]}
    assert log.stat().st_size == 7 * RECORD.itemsize  # cut after the first frame
    assert await reads_back(again, items[:6])
    await again.put_many(items[6:])  # the slots the lost frame named are free again
    assert await reads_back(again, items)
    await again.close()


async def test_a_checkpoint_keeps_the_log_near_the_live_records(tmp_path: Path, tiers):
    root = tmp_path / "ssd"
    tier = tiers(root, 1 << 30, checkpoint_min=64)
    live = []
    for round_ in range(20):
        batch = [make_block(1000 * round_ + i, 4096) for i in range(16)]
        await tier.put_many(batch)
        live += batch
        await tier.delete_many([m.ref for m, _ in live[:8]])
        live = live[8:]
    assert tier.checkpoints > 0
    assert tier.log_records <= max(64, 2 * len(live)) + 16
    await tier.close()
    again = tiers(root, 1 << 30)
    assert {m.ref async for m in again.scan()} == {m.ref for m, _ in live}
    assert await reads_back(again, live)
    records, _ = read_log(root / LOG_NAME)
    assert len(records) == again.log_records
    await again.close()


async def test_an_overwritten_block_reads_its_new_bytes_after_a_restart(tmp_path: Path, tiers):
    root = tmp_path / "ssd"
    tier = tiers(root, 1 << 30)
    meta, _ = make_block(7, 8192)
    other = np.full(8192, 3, np.uint8)
    from kvstore.checksum import checksum

    newer = type(meta)(meta.ref, meta.parent, 8192, checksum(other), meta.label)
    await tier.put(*make_block(7, 8192))
    await tier.put(newer, memoryview(other))
    assert tier.used_bytes == 8192
    await tier.close()
    again = tiers(root, 1 << 30)
    assert [m async for m in again.scan()] == [newer]
    assert await reads_back(again, [(newer, memoryview(other))])
    await again.close()


async def test_a_file_layout_directory_is_imported(tmp_path: Path, tiers):
    """A directory the file layout wrote (with a deleted block in its free pool, and a temp file
    a crash left): every block is read back from segments, and no block file is left."""
    root = tmp_path / "ssd"
    old = SsdTier(root, 1 << 24)
    items = [make_block(i, 3000 + 4096 * (i % 3), parent=bytes([i]) * 32) for i in range(70)]
    await old.put_many(items)
    await old.delete(items[0][0].ref)
    await old.close()
    (root / f"{items[1][0].ref.ns.hex()[:16]}" / ".x.1.0.tmp").write_bytes(b"torn")
    tier = tiers(root, 1 << 24)
    found = {m.ref: m async for m in tier.scan()}
    assert found == {m.ref: m for m, _ in items[1:]}
    assert await reads_back(tier, items[1:])
    assert sorted(p.name for p in root.iterdir()) == ["LAYOUT", "index.log", "namespaces.log", "seg"]
    await tier.close()


async def test_the_file_layout_refuses_a_segment_directory(tmp_path: Path, tiers):
    tiers(tmp_path / "ssd", 1 << 20)
    with pytest.raises(ConfigError, match=r'ssd.path: .* segment layout.*ssd.layout = "segments"'):
        SsdTier(tmp_path / "ssd", 1 << 20)


async def test_the_layout_comes_from_the_config(tmp_path: Path):
    tier = build_tier("ssd", SsdConfig(path=str(tmp_path / "s"), layout="segments", checkpoint_records=100))
    await tier.close()
    assert isinstance(tier, SegmentTier) and tier.checkpoint_min == 100
    assert os.path.exists(tmp_path / "s" / "LAYOUT")


async def test_the_segment_layout_is_the_default_and_the_file_layout_is_named(tmp_path: Path):
    tier = build_tier("ssd", SsdConfig(path=str(tmp_path / "s")))
    await tier.close()
    assert isinstance(tier, SegmentTier) and os.path.exists(tmp_path / "s" / "LAYOUT")
    files = build_tier("ssd", SsdConfig(path=str(tmp_path / "f"), layout="files"))
    await files.close()
    assert isinstance(files, SsdTier) and not os.path.exists(tmp_path / "f" / "LAYOUT")


async def test_concurrent_puts_and_deletes_keep_the_books(tmp_path: Path, tiers):
    """Batches put and deleted at once (as demotions and evictions run) on a tier that is always
    nearly full: freed slots are taken again, the capacity is never exceeded, and a restart finds
    exactly the blocks the tier held, each byte-exact."""
    root = tmp_path / "ssd"
    tier = tiers(root, 48 * 8192)
    live: dict = {}

    async def wave(w: int) -> None:
        batch = [make_block(1000 * w + i, 5000 + i) for i in range(8)]
        await tier.put_many(batch)
        live.update({m.ref: (m, d) for m, d in batch})
        old = [r for r in list(live)[:8] if live[r][0].ref.key[:4] != batch[0][0].ref.key[:4]]
        for r in old:
            live.pop(r)
        await tier.delete_many(old)

    for start in range(0, 40, 4):
        await asyncio.gather(*(wave(w) for w in range(start, start + 4)))
        assert tier.used_bytes == len(live) * 8192 <= 48 * 8192
    await tier.close()
    again = tiers(root, 48 * 8192)
    assert {m.ref async for m in again.scan()} == set(live)
    assert await reads_back(again, list(live.values()))
    assert again.used_bytes == len(live) * 8192


async def test_a_restart_finds_each_namespace_root_its_own_blocks(tmp_path: Path, tiers):
    """Two namespace roots holding some of the same keys, some of one root's deleted: a restart
    (the log's records of two roots, tombstones among them) finds exactly the live blocks, each
    in its own root (the rows are keyed by root, then key: kvstore/tiers/segments/rows.py)."""
    root = tmp_path / "ssd"
    tier = tiers(root, 1 << 30)
    a = [make_block(i, 4096, ns=b"A" * 32) for i in range(20)]
    b = [make_block(i, 4096, ns=b"B" * 32) for i in range(10, 30)]  # keys 10..19 in both roots
    await tier.put_many(a + b)
    await tier.delete_many([m.ref for m, _ in a[10:15]])  # A's copies of shared keys: B's stay
    await tier.close()

    again = tiers(root, 1 << 30)
    live = a[:10] + a[15:] + b
    assert {m.ref async for m in again.scan()} == {m.ref for m, _ in live}
    assert await again.contains_many([m.ref for m, _ in a[10:15]]) == [False] * 5
    assert await reads_back(again, live)
