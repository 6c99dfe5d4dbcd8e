"""A process writing a segment tier dies (``os._exit``, no cleanup) at each step of a put batch,
of a checkpoint and of an import; the directory, opened again as a restart opens it, holds exactly the
committed blocks, each reading back byte-exact, and no deleted one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.tiers.segments.tier import SegmentTier
from tests.conftest import REPO
from tests.tiers.conftest import make_block

# The child: 12 blocks committed, 4 deleted, then the crash point armed and 12 more put in one
# batch (whose commit also starts a checkpoint: checkpoint_min=24).
CHILD = """
import asyncio, os, sys
from kvstore.tiers.segments import log as seglog
from kvstore.tiers.segments.tier import SegmentTier
from tests.tiers.conftest import make_block

point = sys.argv[2]
real_write, real_replace = seglog.write_all, os.replace

def die(*_a, **_k):
    os._exit(9)

def torn(fd, data):
    real_write(fd, memoryview(data)[: len(data) // 2 + 5])
    os._exit(9)

def log_then_die(fd, data):
    real_write(fd, data)
    if len(data) > 12 * 128:  # the second batch's frame: written whole, then the process is gone
        os._exit(9)

async def main():
    tier = SegmentTier(sys.argv[1], 1 << 24, checkpoint_min=24)
    await tier.put_many([make_block(i, 5000 + i) for i in range(12)])
    await tier.delete_many([make_block(i, 5000 + i)[0].ref for i in range(10)])
    if point == "slots_written":
        tier._files.sync = lambda touched: die()
    elif point == "torn_record":
        seglog.write_all = torn
    elif point == "record_written":
        seglog.write_all = log_then_die
    elif point == "checkpoint_written":
        seglog.os.replace = die
    elif point == "checkpoint_renamed":
        seglog.fsync_dir = die
    await tier.put_many([make_block(i, 5000 + i) for i in range(100, 112)])
    os._exit(0)

asyncio.run(main())
"""

OLD = [10, 11]
NEW = list(range(100, 112))


@pytest.mark.parametrize(
    ("point", "found"),
    [
        ("slots_written", OLD),  # data in the slots, no record: the batch is not there
        ("torn_record", OLD),  # half a frame: its crc fails, the log is cut before it
        ("record_written", OLD + NEW),  # the frame complete (the kernel has it): committed
        ("checkpoint_written", OLD + NEW),  # index.log.new complete, not renamed: the old log holds all
        ("checkpoint_renamed", OLD + NEW),  # renamed, the directory not synced: the new log holds all
    ],
)
async def test_a_crash_at_each_step_leaves_exactly_the_committed_blocks(tmp_path: Path, point: str, found: list[int]):
    root = tmp_path / "ssd"
    child = subprocess.run([sys.executable, "-c", CHILD, str(root), point], cwd=REPO, capture_output=True, text=True)
    assert child.returncode == 9, child.stderr
    tier = SegmentTier(root, 1 << 24)
    try:
        held = {m.ref: m async for m in tier.scan()}
        blocks = [make_block(i, 5000 + i) for i in found]
        assert held == {m.ref: m for m, _ in blocks}
        for meta, data in blocks:
            into = memoryview(bytearray(meta.size))
            assert await tier.get_many_hashed([meta.ref], [into]) == [(meta, meta.checksum)]
            assert into == data
        assert not (root / "index.log.new").exists()
        await tier.put_many([make_block(i, 5000 + i) for i in range(200, 240)])  # the books still add up
        assert tier.used_bytes == (len(found) + 40) * 8192
    finally:
        await tier.close()


IMPORTER = """
import asyncio, os, sys
from pathlib import Path
from kvstore.tiers.segments import migrate as segmigrate
from kvstore.tiers.segments.tier import SegmentTier

real_batch, batches = segmigrate.import_batch, []

def batch_then_die(tier, paths, into):
    if len(batches) == 1:  # the second batch: committed to segments, its files not yet unlinked
        Path.unlink = lambda self, missing_ok=False: os._exit(9)
    batches.append(paths)
    real_batch(tier, paths, into)

segmigrate.import_batch = batch_then_die

async def main():
    tier = SegmentTier(sys.argv[1], 1 << 24)
    async for _ in tier.scan():
        pass
    os._exit(0)

asyncio.run(main())
"""


async def test_a_crash_mid_import_loses_no_block_and_the_next_start_finishes_it(tmp_path: Path):
    """150 block files (three import batches); the importing process dies after the second batch
    is committed to segments and before its files are unlinked: the next start imports what is
    left, and every block is there once, byte-exact, with no block file left."""
    from kvstore.tiers.ssd import SsdTier

    root = tmp_path / "ssd"
    old = SsdTier(root, 1 << 24)
    items = [make_block(i, 3000 + i) for i in range(150)]
    await old.put_many(items)
    await old.close()
    child = subprocess.run([sys.executable, "-c", IMPORTER, str(root)], cwd=REPO, capture_output=True, text=True)
    assert child.returncode == 9, child.stderr
    assert 0 < len(list(root.glob("*/*.blk"))) < 150  # the first batch's files are gone, the rest not
    tier = SegmentTier(root, 1 << 24)
    try:
        held = {m.ref: m async for m in tier.scan()}
        assert held == {m.ref: m for m, _ in items}
        for meta, data in items:
            into = memoryview(bytearray(meta.size))
            assert await tier.get_many_hashed([meta.ref], [into]) == [(meta, meta.checksum)]
            assert into == data
        assert not list(root.glob("*/*.blk")) and len(tier) == 150
        assert tier.used_bytes == 150 * 4096
    finally:
        await tier.close()
