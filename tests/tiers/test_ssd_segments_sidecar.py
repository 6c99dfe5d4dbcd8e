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


def config(tmp_path: Path, layout: str, capacity: int = 256 * BLOCK) -> list[str]:
    path = tmp_path / f"kvstore-{layout}.toml"
    path.write_text(f"""
data_dir = "{tmp_path / 'data'}"
[dram]
capacity_bytes = {4 * 65536}
page_bytes = 65536
min_slot_bytes = {BLOCK}
[ssd]
layout = "{layout}"
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


def test_a_file_layout_directory_is_imported_by_a_segments_sidecar(tmp_path, serve_process):
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

    sc = serve_process(config(tmp_path, "segments"))
    assert ssd_stats(sc.http)["blocks"] >= held  # (the planned stop may have drained more)
    assert not list(ssd.glob("*/*.blk"))
    assert check_found(sc.grpc, 12) >= held


def test_the_file_layout_refuses_a_segment_directory_with_what_to_do(tmp_path, serve_process):
    serve_process(config(tmp_path, "segments")).stop(signal.SIGTERM)
    with pytest.raises(RuntimeError, match=r'holds the segment layout.*set ssd.layout = "segments"'):
        serve_process(config(tmp_path, "files"))
