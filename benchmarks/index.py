"""The SSD tier's index at scale (issue 41): puts, lookups, restart and disk per block, by layout.

For each count in ``--counts`` (blocks of ``--block-bytes``; small blocks are enough to scale the
count) and each layout (``segments``; ``files``, the one-file-per-block layout, only at the counts
in ``--files-counts``: a million files take minutes to create here), against raw baselines run in
the same process on the same bytes:

* ``puts_per_s``: blocks written through the tier in batches of 64 (as demotions write), against
  the same bytes written sequentially to one file in the same batches (``raw_puts_per_s``);
  ``--fsync``: both sync once a batch (default off: a killed process loses nothing either way);
* ``lookup_p50_us`` / ``lookup_p99_us``: ``contains_many`` of 2,048 random keys the tier holds,
  against a dict lookup of the same keys (the raw baseline of an in-memory index); ``lookup_cpu_*``:
  this thread's CPU time of the same calls (a wall p99 far above it is the host preempting the
  process). The tier's ``contains_many`` is not a Lookup's path (a sidecar answers from its books:
  ``books_lookup_*`` below; the tier's is its health probe's);
* ``restart_s``: the tier opened again on its directory (``restart_open_s``: from then on it
  answers reads) and scanned (``restart_scan_s``: every block listed as a ``BlockMeta``, as the
  sidecar's recovery reads it; ``*_cpu_s``: this process's CPU time of each), against reading
  the log's bytes sequentially (``segments``) or the same number of bytes (``files``: its
  headers, one page a block) from one file;
* ``load_s`` / ``load_cpu_us_per_block`` (``segments``): the tier opened and every block loaded
  into a sidecar's books in this process (the index, an SSD level with the default policy, the
  restart's recovery: kvstore.movers.recovery), wall seconds and CPU microseconds a block; then
  ``books_lookup_p50_us`` / ``books_lookup_p99_us`` on those books: what a Lookup of 2,048 random
  held keys does in the sidecar, without gRPC (``BlockStore.lookup``'s probes of the index: wall,
  and ``books_lookup_cpu_*`` this thread's CPU time), and ``books_lookup_touch_cpu_*``: the CPU
  time of the policy's share of those hits, which the sidecar applies off the request's path
  (its buffered touches, drained in the background or before an eviction);
* ``serve_restart_s``: ``kvstore serve`` started on that directory until its ready line (from then
  on it answers Lookups, a block not loaded yet a miss), minus a start on an empty one (measured
  once per run); ``serve_recovered_s``: until its recovered line (every block loaded into the
  index, kvstore.movers.recovery), minus the same; the sidecar's CPU time until then, less an empty
  start's, per block (``serve_recovered_cpu_us_per_block``: steadier than the wall seconds on a
  shared host); and the sidecar's ``RssAnon`` per block held then (``serve_rss_per_block_B``; the
  Python index's memory, issue 41 item 1, not this layout's);
* ``disk_bytes_per_block``: what the directory takes on the filesystem, against the payload;
* ``tier_index_bytes_per_block``: the segment tier's own in-memory index (its record array and
  its key dict); ``load_rss_per_block_B``: the RssAnon the in-process full load took (the tier's
  index and the books), per block.

``--log-only`` writes the tier's log alone (each block's put record naming its own slot, no bytes in
the segments: counts this disk cannot hold, issue 41 item 6) and measures the restart, the full
load, the lookups and the tier's index bytes on it. ``--rss-limit-gib`` (16) aborts the run when
the process's RssAnon passes it.

The page cache is warm (just written): a cold restart reads the log from the device (sequential).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Result, percentile
from benchmarks.ssd_layout import disk_bytes
from kvstore.config import Config
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import BlockKey, Namespace, namespace_root
from kvstore.movers.level import Level
from kvstore.movers.recovery import Recovery
from kvstore.policy import make_policy
from kvstore.stats.counters import Stats
from kvstore.store.books.index import SSD, Index
from kvstore.store.books.retention import Retention
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.file_io import DiskSettings
from kvstore.tiers.segments.log import PUT, RECORD
from kvstore.tiers.segments.slots import pages
from kvstore.tiers.segments.tier import SegmentTier
from kvstore.tiers.ssd import SsdTier
from kvstore.util.tuning import quiet_gc, restore_gc, trim_heap

NS = Namespace(model="bench-index", kv_layout="raw", dtype="float16", block_size=16)
BATCH = 64
LOOKUP_KEYS = 2048
LOOKUP_ROUNDS = 200


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--counts", default="100000,1000000", help="blocks, comma-separated")
    p.add_argument("--files-counts", default="100000", help="counts at which the file layout is measured too")
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--fsync", action="store_true", help="sync once a batch (tier and raw baseline)")
    p.add_argument("--no-serve", action="store_true", help="skip the kvstore serve restarts")
    p.add_argument("--dir", default="", help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--log-only", action="store_true",
                   help="write the segment tier's log only (records naming slots, no blocks' bytes: counts the "
                        "disk cannot hold); puts, disk and kvstore serve figures are skipped")
    p.add_argument("--rss-limit-gib", type=float, default=16.0, help="abort when this process's RssAnon exceeds it")


def make_tier(layout: str, root: Path, fsync: bool) -> Any:
    if layout == "segments":
        return SegmentTier(root, 1 << 44, DiskSettings(fsync=fsync))
    return SsdTier(root, 1 << 44, DiskSettings(fsync=fsync), recycle_bytes=0)


def metas(n: int, size: int) -> list[BlockMeta]:
    root = namespace_root(NS)
    return [BlockMeta(BlockRef(root, BlockKey(i.to_bytes(32, "big"))), b"", size, i, NS.label) for i in range(n)]


async def put_s(tier: Any, blocks: list[BlockMeta], payload: memoryview) -> float:
    t = time.perf_counter()
    for a in range(0, len(blocks), BATCH):
        await tier.put_many([(m, payload) for m in blocks[a : a + BATCH]])
    return time.perf_counter() - t


def raw_put_s(path: Path, n: int, payload: memoryview, fsync: bool) -> float:
    chunk = bytes(payload) * BATCH
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    t = time.perf_counter()
    try:
        for a in range(0, n, BATCH):
            os.write(fd, chunk[: (min(n, a + BATCH) - a) * len(payload)])
            if fsync:
                os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


async def lookups_us(tier: Any, blocks: list[BlockMeta]) -> tuple[list[float], list[float], list[float]]:
    """The tier's ``contains_many``: wall and this thread's CPU microseconds a round; the dict baseline's wall."""
    rng = random.Random(7)
    ours, cpu, raw = [], [], []
    index = {m.ref.ns + m.ref.key: i for i, m in enumerate(blocks)}
    for _ in range(LOOKUP_ROUNDS):
        refs = [m.ref for m in rng.sample(blocks, min(LOOKUP_KEYS, len(blocks)))]
        t, c = time.perf_counter(), time.thread_time()
        assert all(await tier.contains_many(refs))
        cpu.append((time.thread_time() - c) * 1e6)
        ours.append((time.perf_counter() - t) * 1e6)
        keys = [r.ns + r.key for r in refs]
        t = time.perf_counter()
        [k in index for k in keys]  # the raw baseline's work: one dict probe a key
        raw.append((time.perf_counter() - t) * 1e6)
    return ours, cpu, raw


async def restart_s(layout: str, root: Path, n: int) -> tuple[float, float, float, float]:
    """Seconds to open the tier on its directory (ready to answer reads), then to list its
    blocks; wall clock, then this process's CPU time of each (steadier on a shared host)."""
    t, c = time.perf_counter(), time.process_time()
    tier = make_tier(layout, root, fsync=False)
    opened, opened_cpu = time.perf_counter() - t, time.process_time() - c
    found = 0
    t, c = time.perf_counter(), time.process_time()
    async for _ in tier.scan():
        found += 1
    listed, listed_cpu = time.perf_counter() - t, time.process_time() - c
    await tier.close()
    assert found == n, (found, n)
    return opened, listed, opened_cpu, listed_cpu


def rss_anon() -> int:
    """This process's RssAnon, bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@contextlib.contextmanager
def rss_guard(limit_gib: float) -> Iterator[None]:
    """While inside: abort the process (exit 3) if its RssAnon exceeds ``limit_gib`` (checked 5
    times a second by a thread, stopped and joined on the way out)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if rss_anon() > limit_gib * (1 << 30):
                print(f"index: RssAnon over {limit_gib} GiB, aborting", file=sys.stderr, flush=True)
                os._exit(3)

    thread = threading.Thread(target=watch, name="rss-guard", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def write_log(root: Path, n: int, size: int) -> None:
    """The segment tier's directory with the log records :func:`metas` would leave, and no
    segment bytes (``--log-only``): each block a put of its own slot, as the tier writes them."""
    tier = SegmentTier(root, 1 << 44, DiskSettings(fsync=False))
    ns = tier._ns.id_of(namespace_root(NS), NS.label, "")  # (the tier's own namespace log and record log)
    tier._ns.sync()
    cls = pages(size)
    per = tier.slots.per_segment(cls)
    for a in range(0, n, 1 << 16):
        i = np.arange(a, min(n, a + (1 << 16)), dtype=np.uint64)
        rec = np.zeros(len(i), RECORD)
        rec["op"], rec["cls"], rec["ns"], rec["seq"] = PUT, cls, ns, i
        keys = np.zeros((len(i), 32), np.uint8)
        keys[:, 24:] = i.astype(">u8").view(np.uint8).reshape(len(i), 8)  # (metas: i, 32 bytes big-endian)
        rec["key"] = keys.view("V32").reshape(len(i))
        rec["size"], rec["checksum"], rec["slot"], rec["seg"] = size, i, i, i // per
        tier._log.append(rec, sync=False)
    asyncio.run(tier.close())


Books = dict[str, list[float]]  # (books_lookups_us: each measure's samples, microseconds)


def books_lookups_us(index: Index, level: Level, n: int) -> Books:
    """A Lookup's work on the loaded books, in process (no gRPC), ``LOOKUP_ROUNDS`` rounds of
    ``LOOKUP_KEYS`` random held keys, each key a new bytes object as a request's are: the
    request's own path (``leading_run``: :meth:`BlockStore.lookup`'s probes of the index), wall
    and this thread's CPU time (``cpu``: what a preemption on a shared host does not inflate), and
    the policy's share of the hits, applied off the request's path as the sidecar's buffered
    touches are (``touch``: the level policy's ``access_many``, deepest first, as
    ``Below.touch``)."""
    rng = random.Random(7)
    ns = index.namespaces[namespace_root(NS)]
    policy = level.policy
    assert policy is not None
    out: Books = {"wall": [], "cpu": [], "touch": []}
    for _ in range(LOOKUP_ROUNDS):
        keys = [BlockKey(i.to_bytes(32, "big")) for i in rng.sample(range(n), min(LOOKUP_KEYS, n))]
        t, c = time.perf_counter(), time.thread_time()
        run = index.leading_run(ns, keys)
        c, t = time.thread_time() - c, time.perf_counter() - t
        out["wall"].append(t * 1e6)
        out["cpu"].append(c * 1e6)
        assert len(run) == len(keys)
        c = time.thread_time()
        policy.access_many(run[::-1])
        out["touch"].append((time.thread_time() - c) * 1e6)
    return out


async def full_load_s(root: Path, n: int) -> tuple[float, float, int, Books]:
    """Seconds to open the tier and load every block into a sidecar's books, in process: the
    index and an SSD level with the default policy, watched by a retention as the sidecar's are,
    entered by the restart's recovery (kvstore.movers.recovery) with the sidecar's collector
    settings; wall clock, this process's CPU time (``load_cpu_us_per_block``: per block), the
    RssAnon the tier and the books took (``load_rss_per_block_B``: per block), then the Lookups
    on those books (:func:`books_lookups_us`, under the same collector settings). The heap's free
    memory is given back first (:func:`trim_heap`): what the restart's scan left (freed, still
    resident) was reused by the load and missing from its RssAnon (at 3 M blocks 903 B a block
    measured, 1,105 B when trimmed first), and sat under the load's peak (3.9 GB, 3.4 GB)."""
    trim_heap()
    quiet_gc()
    try:
        rss = rss_anon()
        t, c = time.perf_counter(), time.process_time()
        tier = make_tier("segments", root, fsync=False)
        index = Index()
        policy = make_policy(Config().index.policy)
        Retention().watch(policy)
        level = Level("ssd", SSD, tier, index, Stats(), capacity=tier.capacity_bytes, policy=policy,
                      footprint=functools.lru_cache(maxsize=4096)(tier.footprint))
        found = await Recovery([level], index).run()
        took, cpu = time.perf_counter() - t, time.process_time() - c
        rss = rss_anon() - rss
        assert found == n, (found, n)
        books = books_lookups_us(index, level, n)
        await tier.close()
    finally:
        restore_gc()
    return took, cpu, rss, books


def raw_read_s(path: Path) -> float:
    t = time.perf_counter()
    np.fromfile(path, dtype=np.uint8)
    return time.perf_counter() - t


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (user and system, /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_start(data_dir: Path, layout: str) -> tuple[float, float, int, float]:
    """Seconds until ``kvstore serve`` is ready on ``data_dir``, until it has recovered every block,
    its RssAnon then (bytes), and the CPU seconds it has used by then."""
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(data_dir)]
    env = {"KVSTORE_DRAM__CAPACITY_BYTES": str(64 << 20), "KVSTORE_SSD__CAPACITY_BYTES": str(1 << 44),
           "KVSTORE_SSD__LAYOUT": layout, "KVSTORE_SERVER__LOCAL_SOCKET": "off"}
    t = time.perf_counter()
    sc = ServeProcess(args, env, recovered=False)
    ready = time.perf_counter() - t
    sc.wait_recovered()
    recovered = time.perf_counter() - t
    with open(f"/proc/{sc.proc.pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    cpu = cpu_s(sc.proc.pid)
    sc.stop()
    Path(sc.log.name).unlink(missing_ok=True)
    return ready, recovered, rss, cpu


def measure(
    res: Result, layout: str, n: int, tmp: Path, args: argparse.Namespace, empty: tuple[float, float, int, float]
) -> None:
    tag = f"{layout}_{n}"
    size = args.block_bytes
    data = tmp / tag
    root = data / "ssd"
    if args.log_only:
        measure_log_only(res, n, root, size)
        return
    blocks = metas(n, size)
    payload = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    tier = make_tier(layout, root, args.fsync)
    took = asyncio.run(put_s(tier, blocks, payload))
    raw = raw_put_s(tmp / "raw.bin", n, payload, args.fsync)
    res.figure(f"puts_per_s_{tag}", n / took, "blocks/s")
    res.figure(f"raw_puts_per_s_{tag}", n / raw, "blocks/s")
    res.ratio(f"puts_vs_raw_{tag}", raw / took)
    ours, cpu, base = asyncio.run(lookups_us(tier, blocks))
    lookup_figures(res, tag, ours, cpu)
    res.figure(f"raw_lookup_p50_us_{tag}", percentile(base, 50), "us")
    res.ratio(f"lookup_p50_vs_raw_{tag}", percentile(base, 50) / percentile(ours, 50))
    if layout == "segments":
        res.figure(f"tier_index_bytes_per_block_{tag}", tier.index_bytes() / n, "B")
    asyncio.run(tier.close())
    disk = disk_bytes(root) / n
    res.figure(f"disk_bytes_per_block_{tag}", disk, "B")
    res.ratio(f"payload_vs_disk_{tag}", size / disk)
    (tmp / "raw.bin").unlink()
    opened, listed, opened_cpu, listed_cpu = asyncio.run(restart_s(layout, root, n))
    restart = opened + listed
    if layout == "segments":
        raw_restart = raw_read_s(root / "index.log")
    else:
        raw_put_s(tmp / "raw.bin", n, memoryview(bytes(4096)), fsync=False)  # one header page a block
        raw_restart = raw_read_s(tmp / "raw.bin")
        (tmp / "raw.bin").unlink()
    res.figure(f"restart_s_{tag}", restart, "s")
    res.figure(f"restart_open_s_{tag}", opened, "s")
    res.figure(f"restart_scan_s_{tag}", listed, "s")
    res.figure(f"restart_open_cpu_s_{tag}", opened_cpu, "s")
    res.figure(f"restart_scan_cpu_s_{tag}", listed_cpu, "s")
    res.figure(f"raw_restart_s_{tag}", raw_restart, "s")
    if layout == "segments":
        load_figures(res, tag, root, n)
    res.ratio(f"restart_vs_raw_{tag}", raw_restart / restart)
    if not args.no_serve:
        ready, recovered, rss, cpu = serve_start(data, layout)
        res.figure(f"serve_restart_s_{tag}", ready - empty[0], "s")
        res.figure(f"serve_recovered_s_{tag}", recovered - empty[0], "s")
        res.figure(f"serve_recovered_cpu_us_per_block_{tag}", (cpu - empty[3]) / n * 1e6, "us")
        res.figure(f"serve_rss_per_block_B_{tag}", (rss - empty[2]) / n, "B")


def load_figures(res: Result, tag: str, root: Path, n: int) -> None:
    load, load_cpu, load_rss, books = asyncio.run(full_load_s(root, n))
    res.figure(f"load_s_{tag}", load, "s")
    res.figure(f"load_cpu_us_per_block_{tag}", load_cpu / n * 1e6, "us")
    res.figure(f"load_rss_per_block_B_{tag}", load_rss / n, "B")
    for name, samples in (("", books["wall"]), ("_cpu", books["cpu"]), ("_touch_cpu", books["touch"])):
        res.figure(f"books_lookup{name}_p50_us_{tag}", percentile(samples, 50), "us")
        res.figure(f"books_lookup{name}_p99_us_{tag}", percentile(samples, 99), "us")


def lookup_figures(res: Result, tag: str, wall: list[float], cpu: list[float]) -> None:
    """The tier's ``contains_many`` figures: wall p50/p99, and this thread's CPU time's (a wall
    p99 far above the CPU p99 is the host preempting the process, not the lookup's work)."""
    res.figure(f"lookup_p50_us_{tag}", percentile(wall, 50), "us")
    res.figure(f"lookup_p99_us_{tag}", percentile(wall, 99), "us")
    res.figure(f"lookup_cpu_p50_us_{tag}", percentile(cpu, 50), "us")
    res.figure(f"lookup_cpu_p99_us_{tag}", percentile(cpu, 99), "us")


async def sampled_lookups_us(tier: Any, n: int) -> tuple[list[float], list[float]]:
    """:func:`lookups_us` without a block list or the dict baseline (``--log-only``: at 10 M both
    would take gigabytes): the keys drawn by number."""
    rng = random.Random(7)
    root = namespace_root(NS)
    out, cpu = [], []
    for _ in range(LOOKUP_ROUNDS):
        refs = [BlockRef(root, BlockKey(i.to_bytes(32, "big"))) for i in rng.sample(range(n), min(LOOKUP_KEYS, n))]
        t, c = time.perf_counter(), time.thread_time()
        assert all(await tier.contains_many(refs))
        cpu.append((time.thread_time() - c) * 1e6)
        out.append((time.perf_counter() - t) * 1e6)
    return out, cpu


def measure_log_only(res: Result, n: int, root: Path, size: int) -> None:
    """``--log-only``: the log written directly, then the restart, the full load and the lookups."""
    tag = f"segments_{n}"
    write_log(root, n, size)
    opened, listed, opened_cpu, listed_cpu = asyncio.run(restart_s("segments", root, n))
    res.figure(f"restart_s_{tag}", opened + listed, "s")
    res.figure(f"restart_open_s_{tag}", opened, "s")
    res.figure(f"restart_scan_s_{tag}", listed, "s")
    res.figure(f"restart_open_cpu_s_{tag}", opened_cpu, "s")
    res.figure(f"restart_scan_cpu_s_{tag}", listed_cpu, "s")
    load_figures(res, tag, root, n)
    tier = make_tier("segments", root, fsync=False)
    ours, cpu = asyncio.run(sampled_lookups_us(tier, n))
    lookup_figures(res, tag, ours, cpu)
    res.figure(f"tier_index_bytes_per_block_{tag}", tier.index_bytes() / n, "B")
    asyncio.run(tier.close())


def run(args: argparse.Namespace) -> dict[str, object]:
    res = Result("index")
    base = Path(args.dir) if args.dir else None
    files_counts = {int(c) for c in args.files_counts.split(",") if c}
    with rss_guard(args.rss_limit_gib), tempfile.TemporaryDirectory(dir=base) as tmp_name:
        tmp = Path(tmp_name)
        empty = (0.0, 0.0, 0, 0.0)
        if not args.no_serve and not args.log_only:
            serve_start(tmp / "empty", "segments")  # (imports warm)
            empty = min(serve_start(tmp / "empty", "segments") for _ in range(2))
            res.figure("serve_ready_empty_s", empty[0], "s")
        for n in (int(c) for c in args.counts.split(",")):
            for layout in ("segments", "files") if n in files_counts and not args.log_only else ("segments",):
                measure(res, layout, n, tmp, args, empty)
                print(f"index: {layout} {n} done", file=sys.stderr, flush=True)
    if args.log_only:
        res.notes.update(log_only="the log's records only, no blocks' bytes: no puts, disk or serve figures")
    res.notes.update(block_bytes=args.block_bytes, fsync=args.fsync, page_cache="warm (just written)",
                     lookup=f"{LOOKUP_KEYS} random held keys, {LOOKUP_ROUNDS} rounds")
    return res.as_dict()
