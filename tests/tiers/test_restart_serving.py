"""A restart serves while it loads (issue 41 item 3): a real ``kvstore serve`` restarted on a
segment-layout directory is ready, and answers Lookups, while its recovery is still entering the
SSD's blocks batch by batch (``tiering.recover_batch``); a block not loaded yet is a miss; a put of
a key still loading wins (its bytes are what a read returns after the recovery; the loading record
is skipped, or placed as the block's SSD copy when the bytes agree); a delete of a key still
loading (or a drop of its namespace) removes it for good; once the recovery is done, every block
is found and reads back byte-exact.

Counted, not timed: the sidecar runs under a wrapper that holds the recovery after its first batch
until the test creates a file, so "before the recovery completes" is the count of batches /stats
reports (1 of 32), not a race."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from pathlib import Path

import numpy as np

from kvstore.client import SyncClient
from kvstore.keys import BlockKey, Namespace, prefix_keys
from tests.tiers.segment_dir import write_segment_dir

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
BLOCK = 4096
BLOCKS = 256  # each its own one-block prompt: what a Lookup finds does not depend on the log's order
BATCH = 8  # tiering.recover_batch: 32 batches

# kvstore serve with its recovery held after the first batch until the file argv[1] exists.
HELD = """
import asyncio, sys
from pathlib import Path
from kvstore.cli import main
from kvstore.movers.recovery import Recovery

go = Path(sys.argv[1])
between = Recovery.between

async def held(self, batches):
    while batches == 1 and not go.exists():
        await asyncio.sleep(0.01)
    await between(self, batches)

Recovery.between = held
sys.exit(main(["serve", *sys.argv[2:]]))
"""


def key(i: int) -> BlockKey:
    return prefix_keys(NS, [i] * 16)[0]


def content(k: bytes, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + k).digest() * (BLOCK // 32)


def serve(tmp_path: Path, serve_process):
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(f"""
data_dir = "{tmp_path / 'data'}"
[dram]
capacity_bytes = {16 * 65536}
page_bytes = 65536
min_slot_bytes = {BLOCK}
[ssd]
layout = "segments"
capacity_bytes = {4 * BLOCKS * BLOCK}
[tiering]
recover_batch = {BATCH}
""")
    write_segment_dir(tmp_path / "data" / "ssd", NS, [(key(i), content(key(i))) for i in range(BLOCKS)])
    args = [str(tmp_path / "go"), "--config", str(cfg), "--grpc-address", "127.0.0.1:0",
            "--http-address", "127.0.0.1:0"]
    return serve_process(args, entry=("-c", HELD), recovered=False)


def recovery(http: str) -> dict:
    return json.loads(urllib.request.urlopen(f"http://{http}/stats").read())["recovery"]


def held_after_first_batch(http: str) -> dict:
    """The recovery once its first batch is in (ready comes before it: the loading task may not
    have run a batch yet when /readyz first answers). The held wrapper stops it there."""
    deadline = time.monotonic() + 120
    while True:
        doc = recovery(http)
        if doc["batches"] or time.monotonic() > deadline:
            return doc
        time.sleep(0.02)


def found(c: SyncClient) -> list[int]:
    return [i for i in range(BLOCKS) if c.lookup(NS, [key(i)]).matched]


def test_lookups_answer_while_recovering_and_every_block_is_found_after(tmp_path, serve_process):
    sc = serve(tmp_path, serve_process)
    assert json.loads(urllib.request.urlopen(f"http://{sc.http}/readyz").read())["ready"] is True
    held = held_after_first_batch(sc.http)
    assert held["recovering"] is True and held["batches"] == 1 and held["blocks"] == BATCH, held
    with SyncClient(sc.grpc) as c:
        early = found(c)
        assert len(early) == BATCH  # the first batch's blocks; the rest, not loaded yet, are misses
        assert recovery(sc.http)["batches"] == 1  # still held: these Lookups answered mid-recovery
        (tmp_path / "go").touch()
        assert sc.wait_recovered() == {"event": "recovered", "blocks": BLOCKS, "batches": BLOCKS // BATCH}
        assert recovery(sc.http) == {"recovering": False, "blocks": BLOCKS, "batches": BLOCKS // BATCH,
                                     "skipped": 0, "deleted": 0, "batch": BATCH}
        assert found(c) == list(range(BLOCKS))
        got = c.get_blocks(NS, [key(i) for i in range(BLOCKS)][:64])
        assert [g.tobytes() for g in got] == [content(key(i)) for i in range(64)]


def test_a_put_of_a_key_still_loading_wins(tmp_path, serve_process):
    """Two keys not loaded yet put while the recovery is held: one with other bytes (the put wins:
    its record is skipped), one with the same bytes (its record is placed as the block's SSD copy)."""
    sc = serve(tmp_path, serve_process)
    with SyncClient(sc.grpc) as c:
        loaded = set(found(c))
        other, same = [i for i in range(BLOCKS) if i not in loaded][:2]
        new = np.frombuffer(content(key(other), b"new"), np.uint8)
        assert c.put_blocks(NS, [key(other)], [new], checksums=True).stored == 1
        assert c.put_blocks(NS, [key(same)], [np.frombuffer(content(key(same)), np.uint8)], checksums=True).stored == 1
        (tmp_path / "go").touch()
        sc.wait_recovered()
        done = recovery(sc.http)
        assert done["skipped"] == 1 and done["blocks"] == BLOCKS - 1, done
        assert [g.tobytes() for g in c.get_blocks(NS, [key(other)])] == [content(key(other), b"new")]
        assert [g.tobytes() for g in c.get_blocks(NS, [key(same)])] == [content(key(same))]
        assert found(c) == list(range(BLOCKS))


def test_a_stop_while_recovering_ends_cleanly_and_the_next_start_loads_everything(tmp_path, serve_process):
    """SIGTERM while the recovery is held after its first batch: the stop cancels it (exit 0, no
    traceback); the directory is untouched, and the next start loads every block."""
    sc = serve(tmp_path, serve_process)
    assert recovery(sc.http)["recovering"] is True
    assert sc.stop() == 0
    assert "Traceback" not in sc.logs()
    (tmp_path / "go").touch()
    again = serve_process(sc.proc.args[3:], entry=("-c", HELD))
    assert again.recovered == {"event": "recovered", "blocks": BLOCKS, "batches": BLOCKS // BATCH}
    with SyncClient(again.grpc) as c:
        assert found(c) == list(range(BLOCKS))


def released_then_restarted(tmp_path: Path, sc, serve_process, doomed: int):
    """The held recovery released after ``doomed`` was deleted: its record is skipped when its
    batch comes (counted in ``deleted``) and every other block is found; then a stop and a restart,
    which loads every block but ``doomed``. The restarted sidecar, and the blocks it holds."""
    (tmp_path / "go").touch()
    sc.wait_recovered()
    done = recovery(sc.http)
    assert (done["blocks"], done.get("deleted")) == (BLOCKS - 1, 1), done
    rest = [i for i in range(BLOCKS) if i != doomed]
    with SyncClient(sc.grpc) as c:
        assert found(c) == rest
    assert sc.stop() == 0
    again = serve_process(sc.proc.args[3:], entry=("-c", HELD))
    assert again.recovered == {"event": "recovered", "blocks": BLOCKS - 1, "batches": BLOCKS // BATCH}
    with SyncClient(again.grpc) as c:
        assert found(c) == rest
    return again, rest


def test_a_delete_of_a_key_still_loading_removes_it_for_good(tmp_path, serve_process):
    """A key not loaded yet deleted while the recovery is held: its record is skipped when its batch
    comes (counted in ``deleted``), and the delete removed it from the SSD, so the next start does
    not find it either. (Before: the delete found nothing and the block came back with its batch.)"""
    sc = serve(tmp_path, serve_process)
    assert held_after_first_batch(sc.http)["batches"] == 1
    with SyncClient(sc.grpc) as c:
        loaded = set(found(c))
        doomed = min(set(range(BLOCKS)) - loaded)
        assert c.delete(NS, [key(doomed)]) == (0, 0)  # (not in the index yet: no block deleted there)
    again, rest = released_then_restarted(tmp_path, sc, serve_process, doomed)
    with SyncClient(again.grpc) as c:
        got = c.get_blocks(NS, [key(i) for i in rest[:32]])
        assert [g.tobytes() for g in got] == [content(key(i)) for i in rest[:32]]


def test_a_key_put_while_loading_then_deleted_stays_deleted(tmp_path, serve_process):
    """A key not loaded yet is put while the recovery is held (the put wins: it is in the index) and
    then deleted: its old SSD record is skipped when its batch comes and removed, so neither this
    start nor the next finds it. (Before: the delete tombstoned only keys the index did not hold, and
    the old record came back with its batch.)"""
    sc = serve(tmp_path, serve_process)
    assert held_after_first_batch(sc.http)["batches"] == 1
    with SyncClient(sc.grpc) as c:
        loaded = set(found(c))
        doomed = min(set(range(BLOCKS)) - loaded)
        new = np.frombuffer(content(key(doomed), b"new"), np.uint8)
        assert c.put_blocks(NS, [key(doomed)], [new], checksums=True).stored == 1
        assert c.delete(NS, [key(doomed)]) == (1, 0)
    released_then_restarted(tmp_path, sc, serve_process, doomed)


def test_a_namespace_dropped_while_loading_stays_dropped(tmp_path, serve_process):
    """``all_keys`` while the recovery is held after batch 1: the loaded blocks go at once, every
    record the loading reaches later is skipped and removed from the SSD (``deleted``); the next
    start loads nothing."""
    sc = serve(tmp_path, serve_process)
    assert held_after_first_batch(sc.http)["batches"] == 1
    with SyncClient(sc.grpc) as c:
        assert c.delete(NS, all_keys=True) == (BATCH, 0)
        (tmp_path / "go").touch()
        sc.wait_recovered()
        done = recovery(sc.http)
        assert (done["blocks"], done.get("deleted")) == (BATCH, BLOCKS - BATCH), done
        assert found(c) == []
    assert sc.stop() == 0
    again = serve_process(sc.proc.args[3:], entry=("-c", HELD))
    assert again.recovered == {"event": "recovered", "blocks": 0, "batches": 0}
