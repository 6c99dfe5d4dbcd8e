"""The SSD tier's layout at scale: disk bytes per block and restart time per block, against raw baselines.

Two layouts (``--layouts``): ``files``, one file per block (``<ns>/<key>.blk``: a 4 KiB header page,
then the payload; :class:`SsdTier`), and ``segments``, the default (segment files of many blocks and
one index log of 128-byte records; :class:`SegmentTier`). For each layout and block size this suite
writes ``--blocks`` blocks through the tier (batches of 64, as demotions do) and measures (the
``segments`` figures' names carry ``segments_`` before the size):

* ``disk_bytes_per_block``: what the directory takes on the filesystem (``st_blocks`` of every file
  and directory) per block, against the payload (ratio ``payload_vs_disk``: 1.0 = no overhead);
* ``scan_us_per_block``: the tier's restart scan (files: every file opened, its header read;
  segments: the tier opened, its log read, and every block listed) per block,
  against a raw baseline doing the same job the compact way: the same blocks' metadata as one
  append-only log of fixed 128-byte records, read sequentially and decoded (``log_vs_scan``);
* ``serve_restart_us_per_block``: ``kvstore serve`` started on that data directory until its ready
  line and its recovered line (every block in its index), minus the same start on an empty one
  (measured in the same run), per block; the layout named, so the segment layout does not import
  the file layout's directory.

The page cache is warm (the files were just written; nothing here drops caches on a shared host):
a cold restart reads every header page from the device, one random 4 KiB read per block.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Result
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import BlockKey, Namespace, namespace_root
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.segments.tier import SegmentTier
from kvstore.tiers.ssd import SsdTier

NS = Namespace(model="bench-ssd-layout", kv_layout="raw", dtype="float16", block_size=16)
BATCH = 64
RECORD = np.dtype([("ns", "S32"), ("key", "S32"), ("parent", "S32"), ("size", "<u8"), ("checksum", "<u8"),
                   ("offset", "<u8"), ("tenant", "S8")])  # 128 bytes: what a compact index log would hold


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=20_000, help="blocks written per size")
    p.add_argument("--sizes", default="4096,16384,65536", help="block sizes in bytes, comma-separated")
    p.add_argument("--dir", default="", help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--layouts", default="files,segments", help="SSD layouts measured, comma-separated")


def disk_bytes(root: Path) -> int:
    """Bytes the filesystem allocated under ``root``: files and directories (st_blocks)."""
    total = os.stat(root).st_blocks * 512
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


async def write_blocks(tier: SsdTier | SegmentTier, n: int, size: int) -> list[BlockMeta]:
    root = namespace_root(NS)
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    metas = [BlockMeta(BlockRef(root, BlockKey(i.to_bytes(32, "big"))), b"", size, i, NS.label) for i in range(n)]
    for i in range(0, n, BATCH):
        await tier.put_many([(m, payload.data) for m in metas[i : i + BATCH]])
    return metas


async def scan_s(tier: SsdTier | SegmentTier) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    async for _ in tier.scan():
        n += 1
    return time.perf_counter() - t, n


def log_baseline_s(metas: list[BlockMeta], path: Path) -> float:
    """The compact layout's restart work: the metadata as one log of fixed records, written once,
    then read sequentially and decoded into columns (timed: the read and the decode)."""
    rec = np.zeros(len(metas), dtype=RECORD)
    rec["ns"] = [m.ref.ns for m in metas]
    rec["key"] = [m.ref.key for m in metas]
    rec["size"] = [m.size for m in metas]
    rec["checksum"] = [m.checksum for m in metas]
    rec["offset"] = np.arange(len(metas), dtype=np.uint64) * metas[0].size
    with open(path, "wb") as f:
        f.write(rec.tobytes())
        os.fsync(f.fileno())
    t = time.perf_counter()
    with open(path, "rb") as f:
        got = np.frombuffer(f.read(), dtype=RECORD)
    keys = {bytes(k): i for i, k in enumerate(got["key"])}  # the index a restart builds from it
    elapsed = time.perf_counter() - t
    assert len(keys) == len(metas)
    return elapsed


def serve_ready_s(data_dir: Path, layout: str = "segments") -> float:
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(data_dir)]
    env = {"KVSTORE_DRAM__CAPACITY_BYTES": str(64 << 20), "KVSTORE_SSD__CAPACITY_BYTES": str(1 << 40),
           "KVSTORE_SERVER__LOCAL_SOCKET": "off", "KVSTORE_SSD__LAYOUT": layout}
    t = time.perf_counter()
    sc = ServeProcess(args, env)
    ready = time.perf_counter() - t
    sc.stop()
    Path(sc.log.name).unlink(missing_ok=True)
    return ready


def open_tier(layout: str, path: Path) -> SsdTier | SegmentTier:
    return SsdTier(path, 1 << 40, recycle_bytes=0) if layout == "files" else SegmentTier(path, 1 << 40)


def run(args: argparse.Namespace) -> dict[str, object]:
    res = Result("ssd_layout")
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        empty = Path(tmp) / "empty"
        serve_ready_s(empty)  # (imports warm)
        empty_s = min(serve_ready_s(empty) for _ in range(2))
        res.figure("serve_ready_empty_s", empty_s, "s")
        for layout in args.layouts.split(","):
            tag = "" if layout == "files" else f"{layout}_"  # (the file layout's names as before)
            for size in (int(s) for s in args.sizes.split(",")):
                d = Path(tmp) / f"{layout}{size}"
                tier = open_tier(layout, d / "ssd")
                metas = asyncio.run(write_blocks(tier, args.blocks, size))
                disk = disk_bytes(d / "ssd") / args.blocks
                res.figure(f"disk_bytes_per_block_{tag}{size}", disk, "B")
                res.ratio(f"payload_vs_disk_{tag}{size}", size / disk)
                asyncio.run(tier.close())
                t0 = time.perf_counter()  # the restart: the tier opened again, then scanned
                tier = open_tier(layout, d / "ssd")
                opened = time.perf_counter() - t0
                scan, n = asyncio.run(scan_s(tier))
                assert n == args.blocks
                asyncio.run(tier.close())
                log_s = log_baseline_s(metas, Path(tmp) / f"log{size}")
                res.figure(f"scan_us_per_block_{tag}{size}", (opened + scan) / n * 1e6, "us")
                res.figure(f"log_us_per_block_{tag}{size}", log_s / n * 1e6, "us")
                res.ratio(f"log_vs_scan_{tag}{size}", log_s / (opened + scan))
                ready = serve_ready_s(d, layout)
                res.figure(f"serve_restart_us_per_block_{tag}{size}", (ready - empty_s) / n * 1e6, "us")
                shutil.rmtree(d)
    res.notes["blocks"] = args.blocks
    res.notes["page_cache"] = "warm (just written)"
    return res.as_dict()
