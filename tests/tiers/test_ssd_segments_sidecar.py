"""The segment layout under a real ``kvstore serve``: killed (SIGKILL) while it writes to the SSD,
reuses slots and checkpoints its log, restarted, every block it finds reads back byte-exact; a
file-layout directory imported at start; the file layout refusing a segment directory."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.tiers.segments.tier import SegmentTier
from tests.conftest import REPO

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
BLOCK = 4096
CHAIN = 8  # blocks a prompt

# Puts prompt after prompt (first token i, CHAIN blocks) until killed; each block's bytes are a
# function of its key, so a reader can check any block it finds; the prompts done go to argv[2]
# (written beside it and renamed over it).
WRITER = f"""
import hashlib, os, sys, numpy as np
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.tiers.segments.tier import SegmentTier
ns = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
c = SyncClient(sys.argv[1])
for i in range(int(sys.argv[3]), 1_000_000):
    keys = prefix_keys(ns, [i] * (16 * {CHAIN}))
    c.put_blocks(ns, keys, [np.frombuffer(hashlib.sha256(k).digest() * {BLOCK // 32}, np.uint8) for k in keys])
    with open(sys.argv[2] + ".new", "w") as f:  # (replaced whole: a kill -9 between the open's
        f.write(str(i + 1))                      # truncation and the write left it empty once)
    os.replace(sys.argv[2] + ".new", sys.argv[2])
"""


def expected(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * (BLOCK // 32)


def config(tmp_path: Path, layout: str | None, capacity: int = 256 * BLOCK) -> list[str]:
    """``layout`` None: the config names none (the default)."""
    path = tmp_path / f"kvstore-{layout or 'default'}.toml"
    path.write_text(f"""
data_dir = "{tmp_path / 'data'}"
[dram]
capacity_bytes = {4 * 65536}
page_bytes = 65536
min_slot_bytes = {BLOCK}
[ssd]
{f'layout = "{layout}"' if layout else ""}
capacity_bytes = {capacity}
checkpoint_records = 64
""")
    return ["--config", str(path), "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]


def ssd_stats(http: str) -> dict:
    return json.loads(urllib.request.urlopen(f"http://{http}/stats").read())["tiers"]["ssd"]


def check_found(grpc: str, prompts: int) -> int:
    """Every block the sidecar finds, of the first ``prompts`` prompts, read back byte-exact; how many."""
    found = 0
    with SyncClient(grpc) as c:
        for i in range(prompts):
            keys = prefix_keys(NS, [i] * (16 * CHAIN))
            matched = c.lookup(NS, keys).matched
            got = c.get_blocks(NS, keys[:matched]) if matched else []
            assert [g.tobytes() for g in got] == [expected(k) for k in keys[: len(got)]], f"prompt {i}"
            found += len(got)
    return found


def check_directory(ssd: Path) -> int:
    """Every block the killed sidecar's SSD directory holds (as a restart reads it: the log's
    complete frames) read back with the bytes its key says; how many."""
    tier = SegmentTier(ssd, 1 << 30)
    try:
        metas = asyncio.run(_listed(tier))
        for meta in metas:
            into = memoryview(bytearray(meta.size))
            [(got, hashed)] = asyncio.run(tier.get_many_hashed([meta.ref], [into]))
            assert got == meta and hashed == meta.checksum and bytes(into) == expected(meta.ref.key), meta.ref.name
        return len(metas)
    finally:
        asyncio.run(tier.close())


async def _listed(tier: SegmentTier) -> list:
    return [m async for m in tier.scan()]


def test_kill_9_while_writing_reusing_and_checkpointing_then_every_found_block_is_exact(tmp_path, serve_process):
    """Three rounds: a writer fills 64 KiB of DRAM and a 1 MiB SSD (its blocks evicted, their slots
    reused, the log checkpointed every 64 records) until the SSD has taken 300 more demotions, then
    the sidecar is killed -9 mid-stream (``bytes_in``: bytes the SSD took). Every block the killed
    directory's log names reads back with the bytes its key says (the tier opened directly, as a
    restart opens it); each restarted sidecar finds blocks on the SSD, and every prefix it finds
    reads back byte-exact."""
    args = config(tmp_path, "segments")
    progress = tmp_path / "progress"
    progress.write_text("0")
    for round_ in range(3):
        sc = serve_process(args)
        before = ssd_stats(sc.http)
        if round_:
            assert before["blocks"] > 0  # the restart found the SSD's blocks
            check_found(sc.grpc, int(progress.read_text()))
        start = int(progress.read_text())
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, sc.grpc, str(progress), str(start)], cwd=REPO, stderr=subprocess.DEVNULL
        )
        try:
            for _ in range(600):
                now = ssd_stats(sc.http)
                if now["bytes_in"] - before["bytes_in"] >= 300 * BLOCK and now["evictions"] > 0:
                    break
                time.sleep(0.05)
            assert now["bytes_in"] - before["bytes_in"] >= 300 * BLOCK and now["evictions"] > 0
            sc.stop(signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait()
        assert check_directory(tmp_path / "data" / "ssd") > 0
    sc = serve_process(args)
    assert ssd_stats(sc.http)["blocks"] > 0
    assert check_found(sc.grpc, int(progress.read_text())) > 0


@pytest.mark.parametrize("layout", ["segments", None])
def test_a_file_layout_directory_is_imported_by_a_segments_sidecar(tmp_path, serve_process, layout):
    """A directory the file layout wrote (one file per block), then a sidecar of the segment layout
    on it -- named, or the default (``layout`` None: an upgrade that sets nothing): it imports every
    block (each read back byte-exact), leaves no block file, and says so on its log."""
    sc = serve_process(config(tmp_path, "files"))
    data = {}
    with SyncClient(sc.grpc) as c:
        for i in range(12):  # 96 blocks through 64 DRAM slots: the first ones go to the SSD's files
            keys = prefix_keys(NS, [i] * (16 * CHAIN))
            c.put_blocks(NS, keys, [np.frombuffer(expected(k), np.uint8) for k in keys])
            data.update({k: expected(k) for k in keys})
    for _ in range(100):
        if ssd_stats(sc.http)["blocks"] >= 32:
            break
        time.sleep(0.05)
    held = ssd_stats(sc.http)["blocks"]
    assert held >= 32
    sc.stop(signal.SIGTERM)
    ssd = tmp_path / "data" / "ssd"
    assert list(ssd.glob("*/*.blk"))

    sc = serve_process(config(tmp_path, layout))
    assert ssd_stats(sc.http)["blocks"] >= held  # (the planned stop may have drained more)
    assert not list(ssd.glob("*/*.blk")) and (ssd / "LAYOUT").exists()
    assert check_found(sc.grpc, 12) >= held
    sc.stop(signal.SIGTERM)
    assert "importing" in sc.logs()


def test_the_file_layout_refuses_a_segment_directory_with_what_to_do(tmp_path, serve_process):
    serve_process(config(tmp_path, "segments")).stop(signal.SIGTERM)
    with pytest.raises(RuntimeError, match=r'holds the segment layout.*set ssd.layout = "segments"'):
        serve_process(config(tmp_path, "files"))


# ``kvstore serve`` with one crash point armed: the sidecar kills itself (SIGKILL, no cleanup) at
# the given step of its ``nth`` log checkpoint, or halfway through writing a block into its
# ``nth`` reused slot (a deleted block's slot, handed out again), and runs unchanged until then.
KILLED_AT = """
import os, signal, sys
from kvstore.cli import main
from kvstore.tiers.segments import log as seglog
from kvstore.tiers.segments.files import SegmentFiles
from kvstore.tiers.segments.slots import Slots

point, nth = sys.argv[1], int(sys.argv[2])
real_rewrite, real_write, real_replace, real_fsync_dir = (
    seglog.IndexLog.rewrite, seglog.write_all, os.replace, seglog.fsync_dir)
real_take, real_slot_write = Slots.take, SegmentFiles.write
count = {"checkpoints": 0, "reused": 0}
rewriting, reused = [False], set()

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def rewrite(self, records):
    count["checkpoints"] += 1
    rewriting[0] = count["checkpoints"] == nth
    real_rewrite(self, records)

def write_all(fd, data):
    if rewriting[0] and point == "checkpoint_torn":  # half of index.log.new's first frame
        real_write(fd, memoryview(data)[: len(data) // 2 + 5])
        die()
    real_write(fd, data)

def replace(src, dst, **kw):
    if rewriting[0] and point == "checkpoint_written":  # index.log.new whole and synced, not renamed
        die()
    real_replace(src, dst, **kw)

def fsync_dir(root):
    if rewriting[0] and point == "checkpoint_renamed":  # renamed over index.log, the directory not synced
        die()
    real_fsync_dir(root)

def take(self, cls):
    high = self.high(cls)
    g = real_take(self, cls)
    if self.high(cls) == high:  # not new room: a freed slot handed out again
        reused.add((cls, g))
    return g

def slot_write(self, cls, g, data):
    if point == "reused_slot_torn" and (cls, g) in reused:
        count["reused"] += 1
        if count["reused"] == nth:  # half the new block's bytes over the old one's, then gone
            real_slot_write(self, cls, g, memoryview(data)[: len(data) // 2])
            die()
    return real_slot_write(self, cls, g, data)

seglog.IndexLog.rewrite, seglog.write_all, seglog.os.replace, seglog.fsync_dir = rewrite, write_all, replace, fsync_dir
Slots.take, SegmentFiles.write = take, slot_write
sys.exit(main(["serve", *sys.argv[3:]]))
"""


@pytest.mark.parametrize(
    ("point", "nth"),
    [("checkpoint_torn", 3), ("checkpoint_written", 3), ("checkpoint_renamed", 3), ("reused_slot_torn", 200)],
)
def test_killed_mid_checkpoint_or_mid_write_into_a_reused_slot_every_found_block_is_exact(
    tmp_path, serve_process, point, nth
):
    """A real ``kvstore serve`` (the layout by default: the config names none) killed -9 by itself
    at one step of its third log checkpoint -- half of ``index.log.new`` written; all of it
    written, not renamed; renamed, the directory not synced -- or halfway through writing a block
    into its 200th reused slot, while a writer keeps putting. By then more blocks were put than DRAM
    and the SSD together hold (the SSD evicted and its slots were handed out again). Every block the
    killed directory's log names reads back byte-exact, and the restarted sidecar finds blocks on the
    SSD and reads every prefix it finds byte-exact."""
    args = config(tmp_path, None)
    progress = tmp_path / "progress"
    progress.write_text("0")
    sc = serve_process(args, entry=("-c", KILLED_AT, point, str(nth)))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, sc.grpc, str(progress), "0"], cwd=REPO,
                              stderr=subprocess.DEVNULL)
    try:
        assert sc.proc.wait(timeout=300) == -signal.SIGKILL  # it reached the crash point
    finally:
        writer.kill()
        writer.wait()
    ssd = tmp_path / "data" / "ssd"
    assert (ssd / "LAYOUT").exists()
    if point in ("checkpoint_torn", "checkpoint_written"):
        assert (ssd / "index.log.new").exists()  # killed mid-checkpoint, as armed
    assert int(progress.read_text()) * CHAIN > 64 + 256  # more than DRAM's 64 slots and the SSD's 256
    assert check_directory(ssd) > 0
    assert not (ssd / "index.log.new").exists()  # the restart removed the unfinished checkpoint
    again = serve_process(args)
    assert ssd_stats(again.http)["blocks"] > 0
    assert check_found(again.grpc, int(progress.read_text())) > 0
