"""The import of a file-layout directory under a real ``kvstore serve`` follows the rule of a restart
that loads (kvstore/movers/recovery.py): **the put wins**. A block demoted to the segment tier, or
deleted, while the import has not reached that key's older ``.blk`` file stays what the put or the
delete made it, after the import and after another restart.

Counted, not timed: the sidecar runs under a wrapper that holds the import after its first batch
(8 files) until the test creates a file, so "before the import reaches the key" is the key's
``.blk`` file still on disk, not a race."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import numpy as np

from kvstore.checksum import checksum
from kvstore.client import SyncClient
from kvstore.keys import BlockKey, Namespace, namespace_root, prefix_keys
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.ssd import SsdTier

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
BLOCK = 4096
BLOCKS = 64  # in the file layout's directory, each its own one-block prompt

# kvstore serve with the import of the file layout held after its first batch (of 8 files): it
# touches argv[1] then, and goes on once argv[2] exists.
HELD = """
import sys, time
from pathlib import Path
from kvstore.cli import main
from kvstore.tiers.segments import migrate

held, go = Path(sys.argv[1]), Path(sys.argv[2])
migrate.BATCH = 8
batch = migrate.import_batch
calls = []

def holding(*args):
    batch(*args)
    calls.append(1)
    if len(calls) == 1:
        held.touch()
        while not go.exists():
            time.sleep(0.01)

migrate.import_batch = holding
sys.exit(main(["serve", *sys.argv[3:]]))
"""


def key(i: int) -> BlockKey:
    return prefix_keys(NS, [i] * 16)[0]


def content(k: bytes, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + k).digest() * (BLOCK // 32)


async def _fill_files(ssd: Path) -> None:
    tier = SsdTier(ssd, 1 << 30)
    root = namespace_root(NS)
    await tier.put_many([(BlockMeta(BlockRef(root, key(i)), b"", BLOCK, checksum(content(key(i))), NS.label),
                          memoryview(content(key(i)))) for i in range(BLOCKS)])
    await tier.close()


def config(tmp_path: Path) -> list[str]:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(f"""
data_dir = "{tmp_path / 'data'}"
[dram]
capacity_bytes = {4 * 65536}
page_bytes = 65536
min_slot_bytes = {BLOCK}
[index]
policy = "lru"
[ssd]
layout = "segments"
capacity_bytes = {1024 * BLOCK}
""")
    return ["--config", str(cfg), "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]


def not_imported(ssd: Path) -> list[int]:
    """The blocks whose ``.blk`` file the import has not reached (still on disk), in key order."""
    left = {p.stem for p in ssd.glob("*/*.blk")}
    return [i for i in range(BLOCKS) if key(i).hex() in left]


def tier_of(c: SyncClient, i: int) -> str | None:
    r = c.lookup(NS, [key(i)])
    return r.blocks[0][0] if r.matched else None


def test_a_put_or_a_delete_while_importing_wins_over_the_older_file(tmp_path, serve_process):
    """A file-layout directory of 64 blocks; a segments sidecar on it, its import held after 8. Two
    keys whose files are not imported yet: one put with new bytes and demoted to the SSD (fillers
    evict it from DRAM: the segment tier holds the new bytes), one deleted. After the import and
    the recovery, and again after a restart: the put key reads back the new bytes, the deleted one
    is gone, every other block reads back as the file layout held it. (Before: the import put the
    older file over the demoted block -- a checksum miss, the new bytes lost, the old ones back
    after the restart -- and brought the deleted key back at the restart.)"""
    ssd = tmp_path / "data" / "ssd"
    asyncio.run(_fill_files(ssd))
    held, go = tmp_path / "held", tmp_path / "go"
    sc = serve_process([str(held), str(go), *config(tmp_path)], entry=("-c", HELD), recovered=False)
    for _ in range(6000):  # (a wait, not a timed assertion: the wrapper says when it holds)
        if held.exists() or sc.proc.poll() is not None:
            break
        time.sleep(0.02)
    assert held.exists(), sc.logs()[-3000:]
    left = not_imported(ssd)
    assert len(left) == BLOCKS - 8, len(left)  # the first batch imported, the rest held
    put, deleted = left[0], left[1]
    new = content(key(put), b"new")
    with SyncClient(sc.grpc) as c:
        assert c.put_blocks(NS, [key(put)], [np.frombuffer(new, np.uint8)], checksums=True).stored == 1
        fillers = [prefix_keys(NS, [1000 + j] * 16)[0] for j in range(128)]  # DRAM holds 64: LRU demotes the put key
        for f in fillers:
            c.put_blocks(NS, [f], [np.frombuffer(content(f), np.uint8)], checksums=True)
        for _ in range(3000):  # (its demotion lands: a wait, not a timed assertion)
            if tier_of(c, put) == "ssd":
                break
            time.sleep(0.02)
        assert tier_of(c, put) == "ssd"
        assert c.delete(NS, [key(deleted)]) == (0, 0)  # (not loaded yet: no block deleted in the index)
        # the put's file still there (the import is held); the deleted key's unlinked by its delete
        assert set(not_imported(ssd)) == set(left) - {deleted}
        go.touch()
        sc.wait_recovered()
        assert not list(ssd.glob("*/*.blk"))
        assert c.lookup(NS, [key(put)]).matched == 1
        assert [g.tobytes() for g in c.get_blocks(NS, [key(put)])] == [new]
        assert c.lookup(NS, [key(deleted)]).matched == 0
    assert sc.stop() == 0
    logs = sc.logs()

    again = serve_process(config(tmp_path))
    rest = [i for i in range(BLOCKS) if i not in (put, deleted)]
    with SyncClient(again.grpc) as c:
        assert c.lookup(NS, [key(put)]).matched == 1
        assert [g.tobytes() for g in c.get_blocks(NS, [key(put)])] == [new]
        assert c.lookup(NS, [key(deleted)]).matched == 0
        assert [i for i in rest if c.lookup(NS, [key(i)]).matched] == rest
        assert [g.tobytes() for g in c.get_blocks(NS, [key(i) for i in rest])] == [content(key(i)) for i in rest]
    assert f"imported {BLOCKS - 2} blocks (0 dropped, 2 superseded" in logs, logs[-3000:]


def _file_layout_dir(root: Path, n: int) -> list[BlockRef]:
    """``n`` one-block prompts written by the file layout under ``root``; their refs."""
    ns_root, refs = namespace_root(NS), []

    async def write() -> None:
        tier = SsdTier(root, 1 << 30)
        for i in range(n):
            data = hashlib.sha256(i.to_bytes(8, "big")).digest() * (BLOCK // 32)
            ref = BlockRef(ns_root, prefix_keys(NS, [i + 1] * 16)[0])
            await tier.put_many([(BlockMeta(ref, b"", len(data), checksum(data), NS.label), memoryview(data))])
            refs.append(ref)
        await tier.close()

    asyncio.run(write())
    return refs


async def _keys_at_the_next_start(root: Path) -> list[bytes]:
    """The keys a segment tier started on ``root`` finds (its import run first, as at a restart)."""
    from kvstore.tiers.segments.tier import SegmentTier

    tier = SegmentTier(root, 1 << 30)
    keys = [row[1] for rows in [batch async for batch in tier.scan_rows()] for row in rows]
    await tier.close()
    return keys


def test_a_delete_before_the_import_ran_stays_a_delete_after_a_restart(tmp_path):
    """A sidecar stopped (or crashed) before its import reached a key it deleted: the next start's
    import does not bring the key back (before: the delete was only remembered in memory, and the
    key's ``.blk`` file stayed for the next start to import)."""
    from kvstore.tiers.segments.tier import SegmentTier

    refs = _file_layout_dir(tmp_path / "ssd", 3)

    async def run() -> list[bytes]:
        tier = SegmentTier(tmp_path / "ssd", 1 << 30)  # opened; its import runs with the recovery's scan
        await tier.delete_many([refs[1]])
        await tier.close()  # stopped before the scan: nothing imported
        return await _keys_at_the_next_start(tmp_path / "ssd")

    keys = asyncio.run(run())
    assert sorted(keys) == sorted([refs[0].key, refs[2].key]), keys


def test_an_import_that_fails_stops_remembering_deletes_and_still_unlinks_their_files(tmp_path, monkeypatch):
    """An import that fails (a disk error) ends the remembering of the deletes since the start (it
    grew with every delete for the life of the process before), and a delete after it still
    unlinks the key's file, so that the next start's import does not bring the key back."""
    from kvstore.tiers.segments import migrate
    from kvstore.tiers.segments.tier import SegmentTier

    refs = _file_layout_dir(tmp_path / "ssd", 3)

    def fail(*args: object) -> None:
        raise OSError(5, "EIO")

    async def run() -> list[bytes]:
        tier = SegmentTier(tmp_path / "ssd", 1 << 30)
        with monkeypatch.context() as m:
            m.setattr(migrate, "import_batch", fail)
            try:
                await migrate.import_files(tier)
            except OSError:
                pass
            else:
                raise AssertionError("the import did not fail")
        assert tier._deleted is None  # nothing remembered any more
        await tier.delete_many([refs[2]])
        assert tier._deleted is None
        await tier.close()
        return await _keys_at_the_next_start(tmp_path / "ssd")

    keys = asyncio.run(run())
    assert sorted(keys) == sorted([refs[0].key, refs[1].key]), keys
