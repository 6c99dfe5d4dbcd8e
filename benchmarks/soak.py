"""Soak: many client processes doing mixed puts and gets through DRAM -> SSD -> Redis for
``--minutes``, with faults injected on a schedule; every read is checked against what was written.

What runs (everything on loopback, everything started here and cleaned up on exit, error or not):

* a ``redis-server`` (:func:`kvstore.harness.servers.redis_server`, no persistence) behind a small
  asyncio TCP proxy (:class:`DelayProxy`, a thread of this process) that can be switched to
  delaying every chunk it forwards (a slow Redis);
* one sidecar (``kvstore serve`` subprocess): a small DRAM slab, an SSD tier on a tmpfs mounted
  here (``--ssd-kib`` of capacity on a tmpfs a little larger, so that the tier's own accounting,
  not the file system, bounds it until the "SSD full" fault fills the file system), Redis
  enabled through the proxy, ``tiering.chain = ["ssd", "redis"]``, ``write_through = ["redis"]``;
* ``--processes`` client processes (``python -m benchmarks.soak --worker``), each with
  ``--clients`` threads, each thread its own :class:`~kvstore.client.SyncClient` (the sidecar's
  Unix socket), in a closed loop:

  - put (``--put-fraction`` of ops): a new chain of ``--chain`` blocks of ``--block-kib`` with
    ``put_blocks``; ``--durable-fraction`` of them with ``wait_write_through=True``;
  - get: ``get_blocks`` of a chain this process wrote (half of the time one of the thread's
    ``--recent`` newest chains, else any chain of a window), each returned block compared
    byte for byte with its expected content;
  - each thread keeps a window of its ``--window`` newest chains and deletes the oldest one
    beyond it (so Redis stays bounded while DRAM and SSD keep evicting).

  A block's bytes are a pure function of its key (PCG64 seeded by the key), so any reader can
  check any block: a read may miss (evicted, or lost with a Redis restart) but a returned block
  whose bytes differ from its key's is a **corrupt read**.

**Durable**: a put with ``wait_write_through=True`` whose reply says every block of the chain is
in Redis (``written_through == chain``, ``stored == chain``), with no Redis kill between the
start of the put and its reply (Redis keeps no data across its restart: the bench counts Redis
"epochs", bumped before each kill, and a block is durable only within its epoch). The writer
logs it (``W`` record) after the reply; the intent to delete a chain is logged (``D``) before
the Delete. **Lost durable blocks**: after each injected sidecar kill and restart (Redis up,
no delay), every block of every durable chain of the current epoch not deleted by then is
looked up in the new sidecar (which rebuilds its index from SSD and Redis at start); a block
past the matched run is lost. Another check runs at the end (``lost_durable_blocks_at_end``).

Fault schedule, in buckets of ``--minutes`` / ``--buckets`` (one minute each for a 10-minute run
with the default 10 buckets): bucket 0 is the warm-up, bucket 1 the fault-free baseline, then

====== =========================================================================================
 2.0    ``redis_kill``: redis-server SIGKILLed, restarted (same port, empty) at 2.3
 3.0    ``slow_redis``: the proxy adds ``--slow-ms`` per round trip until 3.6
 4.0    ``ssd_full``: the tmpfs under the SSD tier filled by a junk file until 4.6
 5.0    ``client_kill``: a client process SIGKILLed mid-run (its threads mid-put or mid-get),
        a new one started in its place
 6.0    ``sidecar_kill``: the sidecar SIGKILLed and restarted on the same data directory and
        ports; then the durable check
 7.0    ``redis_kill`` again (restarted at 7.1), 7.6 ``sidecar_kill`` again (+ durable check)
 8, 9   no fault: recovery (the last bucket is compared with bucket 1)
====== =========================================================================================

Reported (the JSON's top level besides the usual ``figures``/``ratios``): ``corrupt_reads``,
``lost_durable_blocks``, ``errors`` (client errors by ``op:ErrorClass``), ``buckets`` (per bucket:
ops/s, MiB/s, p50/p99 latency of puts and gets, hit ratio of gets, errors, the sidecar's RSS
(highest 1 s sample; its ``RssAnon`` and ``RssShmem`` beside it) and open fds (highest and median
sample, and by kind), the faults active, the sidecar's tier counters, ``ssd_books``: the bytes and
blocks the index places on the SSD, demotions still queued included, beside the block files there),
``ssd_books_at_end`` (once the clients are gone; figure ``ssd_orphan_files_at_end``: files no block
is placed in), ``faults`` (each injection, when and how long), ``targets`` (each of issue #21's
targets, met or not), ``sidecar`` (unexpected exits, warnings/errors of its logs by message).
``--plot F.png``: throughput, p99 and RSS/fds per bucket (matplotlib; without it the plot's data go
to ``F.csv``).

Run: ``kvstore bench soak --minutes 10 --json --plot docs/soak.png`` (root for the tmpfs; without
it the SSD tier sits on a plain directory and ``ssd_full`` is skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import mmap
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import CLOCK_TICK_S, process_cpu_s
from kvstore.keys import Namespace

KiB = 1024
MiB = 1 << 20
NS = Namespace(model="soak", kv_layout="raw", dtype="uint8", block_size=16)
FAULTS = ("redis_kill", "slow_redis", "ssd_full", "client_kill", "sidecar_kill")
REPO = Path(__file__).resolve().parents[1]
EPOCH = struct.Struct("<q")
TICK_S = 0.2
SAMPLE_S = 1.0
SHUTDOWN_TIMEOUT_S = 90.0  # the last sidecar's drain on SIGTERM, measured; killed past it
SLOW_SHUTDOWN_S = 15.0  # a drain still going after this gets a stack dump (py-spy, where installed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    p.add_argument("--buckets", type=int, default=10, help="report buckets (the fault schedule is in buckets)")
    p.add_argument("--processes", type=int, default=4, help="client processes")
    p.add_argument("--clients", type=int, default=8, help="client threads (SyncClient each) per process")
    p.add_argument("--block-kib", type=int, default=16)
    p.add_argument("--chain", type=int, default=4, help="blocks per put (one prefix chain)")
    p.add_argument("--window", type=int, default=48, help="chains each thread keeps; older ones are deleted")
    p.add_argument("--recent", type=int, default=4, help="half of the gets read one of the thread's newest chains")
    p.add_argument("--put-fraction", type=float, default=0.4)
    p.add_argument("--durable-fraction", type=float, default=0.5, help="puts with wait_write_through=True")
    p.add_argument("--dram-kib", type=int, default=8192, help="the sidecar's DRAM slab")
    p.add_argument("--page-kib", type=int, default=256, help="the slab's page")
    p.add_argument("--ssd-kib", type=int, default=16384, help="the SSD tier's capacity (file bytes)")
    p.add_argument("--slow-ms", type=float, default=50.0, help="latency the proxy adds per round trip")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of: " + ", ".join(FAULTS))
    p.add_argument("--plot", default="", help="PNG of throughput, p99 and RSS per bucket")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default="", help="copy the sidecars' logs and the clients' stderr into this directory")


# --- blocks: content is a function of the key ---------------------------------------------------


def chain_keys(run: str, wid: int, tid: int, seq: int, n: int) -> list[bytes]:
    """The keys of chain ``seq`` of thread ``tid`` of worker ``wid``: 32 bytes each, distinct per run."""
    base = f"{run}/{wid}/{tid}/{seq}".encode()
    return [hashlib.sha256(base + b"/" + str(i).encode()).digest() for i in range(n)]


def content(key: bytes, size: int) -> bytes:
    """The bytes of the block under ``key`` (every writer and reader computes the same)."""
    return np.random.Generator(np.random.PCG64(int.from_bytes(key[:8], "little"))).bytes(size)


def bad_blocks(keys: list[bytes], got: list[Any], size: int) -> list[int]:
    """Indices of the returned blocks (the leading run of ``keys``) whose bytes are not their key's."""
    bad = []
    for i, arr in enumerate(got):
        data = memoryview(arr).cast("B") if not isinstance(arr, bytes) else memoryview(arr)
        if len(data) != size or data != content(keys[i], size):
            bad.append(i)
    return bad


# --- the worker process ----------------------------------------------------------------------------


class _Records:
    """One append-only file per worker; every line one ``os.write`` (whole lines survive a SIGKILL)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def __call__(self, *fields: object) -> None:
        os.write(self.fd, (" ".join(str(f) for f in fields) + "\n").encode())


class _Epoch:
    """The Redis epoch the orchestrator publishes in an 8-byte file (bumped before each Redis kill)."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), EPOCH.size, access=mmap.ACCESS_READ)

    def read(self) -> int:
        return int(EPOCH.unpack_from(self._map)[0])


def _client_loop(cfg: dict[str, Any], tid: int, windows: list[list[int]], rec: _Records, epoch: _Epoch,
                 stop: threading.Event) -> None:
    from kvstore.client import SyncClient
    from kvstore.errors import KVStoreError, Unavailable

    rng = random.Random(cfg["seed"] * 1_000_003 + cfg["wid"] * 1009 + tid)
    run, wid, n, size = cfg["run"], cfg["wid"], cfg["chain"], cfg["block_bytes"]
    window = windows[tid]
    undeleted: list[int] = []  # chains whose Delete failed or skipped leased blocks: tried again
    seq = 0
    client = SyncClient(cfg["url"])

    def delete(s: int) -> None:
        rec("D", tid, s)  # before the Delete: a chain that may be gone is never checked for durability
        try:
            _, skipped = client.delete(NS, chain_keys(run, wid, tid, s, n))
        except KVStoreError as exc:
            rec("E", f"{time.time():.3f}", "delete", type(exc).__name__)
            skipped = 1
        if skipped:
            undeleted.append(s)

    def put() -> None:
        nonlocal seq
        seq += 1
        keys = chain_keys(run, wid, tid, seq, n)
        blocks = [np.frombuffer(content(k, size), np.uint8) for k in keys]
        durable = rng.random() < cfg["durable_fraction"]
        e0 = epoch.read()
        window.append(seq)  # listed before the put: a read may find it (or not), never wrong bytes
        t = time.perf_counter()
        r = client.put_blocks(NS, keys, blocks, wait_write_through=durable)
        lat = time.perf_counter() - t
        rec("S", f"{time.time():.3f}", "put", f"{lat * 1e3:.3f}", n, r.stored)
        if durable and r.stored == n and r.written_through == n and epoch.read() == e0:
            rec("W", e0, tid, seq)
        while len(window) > cfg["window"]:
            delete(window.pop(0))
        if undeleted:
            delete(undeleted.pop(0))

    def get() -> None:
        owner = rng.randrange(len(windows))
        w = windows[owner]
        try:
            if rng.random() < 0.5:
                s = w[len(w) - 1 - rng.randrange(min(len(w), cfg["recent"]))]
            else:
                s = w[rng.randrange(len(w))]
        except (IndexError, ValueError):  # empty, or shrunk meanwhile
            return
        keys = chain_keys(run, wid, owner, s, n)
        t = time.perf_counter()
        got = client.get_blocks(NS, keys)
        lat = time.perf_counter() - t
        for i in bad_blocks(keys, got, size):
            rec("C", f"{time.time():.3f}", wid, owner, s, i, keys[i].hex())
        rec("S", f"{time.time():.3f}", "get", f"{lat * 1e3:.3f}", n, len(got))

    try:
        while not stop.is_set():
            op = "put" if rng.random() < cfg["put_fraction"] or not any(windows) else "get"
            try:
                put() if op == "put" else get()
            except KVStoreError as exc:
                rec("E", f"{time.time():.3f}", op, type(exc).__name__)
                if isinstance(exc, Unavailable):
                    stop.wait(0.2)  # the sidecar is restarting: the next call reconnects
            except Exception as exc:  # noqa: BLE001  # counted and reported, never fatal to the soak
                rec("E", f"{time.time():.3f}", op, "unexpected." + type(exc).__name__)
                rec("X", f"{time.time():.3f}", op, repr(exc)[:200].replace("\n", " "))
                stop.wait(0.2)
    finally:
        client.close()


def worker_main(cfg: dict[str, Any]) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rec = _Records(cfg["records"])
    epoch = _Epoch(cfg["epoch_file"])
    windows: list[list[int]] = [[] for _ in range(cfg["clients"])]
    threads = [
        threading.Thread(target=_client_loop, args=(cfg, tid, windows, rec, epoch, stop), name=f"soak-client-{tid}")
        for tid in range(cfg["clients"])
    ]
    for th in threads:
        th.start()
    while not stop.wait(0.5):
        pass
    for th in threads:
        th.join(30)
    return 0


# --- the slow-Redis proxy --------------------------------------------------------------------------


class DelayProxy:
    """A TCP proxy on loopback (asyncio, on a thread of its own) to ``upstream_port``; with
    ``delay_s`` set, every chunk is forwarded that much after it arrived (each direction: a round
    trip takes ``2 * delay_s`` longer), in order, without limiting throughput."""

    def __init__(self, upstream_port: int, port: int) -> None:
        self.upstream_port = upstream_port
        self.port = port
        self.delay_s = 0.0
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> None:
        ready = threading.Event()
        failed: list[BaseException] = []

        def main() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                server = loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
            except OSError as exc:
                failed.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                server.close()
                for w in list(self._writers):
                    w.close()
                for task in list(self._tasks):
                    task.cancel()
                loop.run_until_complete(self._drain(server))
                loop.close()

        self._thread = threading.Thread(target=main, name="kvstore-soak-proxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failed:
            raise failed[0]

    async def _drain(self, server: asyncio.Server) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            self._writers.discard(writer)
            writer.close()
            return
        self.connections += 1
        self._writers.add(up_w)
        self._track(self._pump(reader, up_w))
        self._track(self._pump(up_r, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def feed() -> None:
            try:
                while data := await reader.read(1 << 16):
                    queue.put_nowait((loop.time() + self.delay_s, data))
            except OSError:
                pass
            finally:
                queue.put_nowait(None)

        feeder = asyncio.ensure_future(feed())
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            feeder.cancel()
            self._writers.discard(writer)
            writer.close()  # the other side sees EOF: its pump ends too


# --- the orchestrator -------------------------------------------------------------------------------


@dataclass
class Worker:
    wid: int
    proc: subprocess.Popen[bytes]
    records: Path
    killed: bool = False


@dataclass
class Sample:
    t: float
    op: str
    lat_ms: float
    blocks: int
    got: int


@dataclass
class Parsed:
    samples: list[Sample] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    durable: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (wid, tid, seq) -> epoch
    deleted: set[tuple[int, int, int]] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)


def parse_records(workers: list[Worker], samples: bool = True) -> Parsed:
    """Every worker's records (a torn last line of a killed worker is skipped)."""
    out = Parsed()
    for w in workers:
        try:
            text = w.records.read_text(errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            f = line.split()
            try:
                if f[0] == "S" and samples and len(f) == 6:
                    out.samples.append(Sample(float(f[1]), f[2], float(f[3]), int(f[4]), int(f[5])))
                elif f[0] == "W" and len(f) == 4:
                    out.durable[(w.wid, int(f[2]), int(f[3]))] = int(f[1])
                elif f[0] == "D" and len(f) == 3:
                    out.deleted.add((w.wid, int(f[1]), int(f[2])))
                elif f[0] == "E" and len(f) == 4:
                    out.errors.append((float(f[1]), f"{f[2]}:{f[3]}"))
                elif f[0] == "C":
                    out.corrupt.append(line)
                elif f[0] == "X":
                    out.unexpected.append(line)
            except (ValueError, IndexError):
                continue
    return out


def _proc_rss_fds(pid: int) -> tuple[float, float, float, int] | None:
    """``pid``'s RSS, and its private (``RssAnon``) and shared-memory (``RssShmem``) parts, in MiB,
    and its open fds. ``RssShmem`` is the DRAM slab (a /dev/shm segment, counted once touched) and
    the movers' staging buffers (MAP_SHARED anonymous mmaps: shared memory to the kernel, private
    to the sidecar in effect)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in status.splitlines())
               if k in ("VmRSS", "RssAnon", "RssShmem")}
        return (kib["VmRSS"] / 1024, kib["RssAnon"] / 1024, kib["RssShmem"] / 1024,
                len(os.listdir(f"/proc/{pid}/fd")))
    except (OSError, KeyError, IndexError, ValueError):
        return None


def _machine_busy_s() -> float:
    """The machine's busy CPU time so far, in seconds summed over its cores (``/proc/stat``: user,
    nice, system, irq and softirq; not idle, iowait or steal, and not guest time, which user and
    nice count already)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = ticks[:7]
    return (user + nice + system + irq + softirq) * CLOCK_TICK_S


def _fd_kinds(pid: int, redis_port: int) -> dict[str, int]:
    """The open fds of ``pid`` by kind: TCP to Redis (``redis_port``), other TCP, Unix sockets
    (the local socket's clients and listener), files, pipes, anon inodes (epoll, eventfd), other."""
    kinds: Counter[str] = Counter()
    sockets: set[str] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
        elif target.startswith("anon_inode:"):
            kinds["anon_inode"] += 1
        elif target.startswith("pipe:"):
            kinds["pipe"] += 1
        elif target.startswith("/"):
            kinds["file"] += 1
        else:
            kinds["other"] += 1
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[9] in sockets:
                    sockets.discard(f[9])
                    remote = int(f[2].rsplit(":", 1)[1], 16)
                    if remote == redis_port:  # CLOSE_WAIT: Redis (the proxy) closed it, the sidecar has not yet
                        kinds["tcp_redis_close_wait" if f[3] == "08" else "tcp_redis"] += 1
                    else:
                        kinds["tcp_listen" if f[3] == "0A" else "tcp_other"] += 1
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
            f = line.split()
            if len(f) > 6 and f[6] in sockets:
                sockets.discard(f[6])
                kinds["unix"] += 1
    if sockets:
        kinds["socket_other"] += len(sockets)
    return dict(kinds)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.faults = [f for f in args.faults.split(",") if f]
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise SystemExit(f"unknown faults: {sorted(unknown)}; allowed: {', '.join(FAULTS)}")
        self.duration = args.minutes * 60
        self.bucket_s = self.duration / args.buckets
        self.block_bytes = args.block_kib * KiB
        self.run_id = os.urandom(4).hex()
        self.workers: list[Worker] = []
        self.next_wid = 0
        self.sidecars: list[Any] = []  # every ServeProcess started (the last one is the live one)
        self.sidecar: Any = None
        self.expected_exit = False
        self.sidecar_crashes: list[dict[str, Any]] = []
        self.client_crashes: list[dict[str, Any]] = []
        self.epoch = 0
        self.redis_up = True
        self.slow = False
        self.events: list[dict[str, Any]] = []  # faults injected: {"fault", "t_s", "duration_s", ...}
        self.active: dict[str, float] = {}  # fault -> start (relative)
        self.durable_checks: list[dict[str, Any]] = []
        self._check: threading.Thread | None = None
        self.fd_kinds: list[tuple[float, int, dict[str, int]]] = []  # (t, incarnation, fds by kind)
        # (t, RSS MiB, fds, sidecar incarnation, RssAnon MiB, RssShmem MiB)
        self.rss: list[tuple[float, float, int, int, float, float]] = []
        # (t, the soak's processes (pids), the sidecar's CPU s so far, theirs all told, the machine's busy s)
        self.cpu: list[tuple[float, tuple[int, ...], float, float, float]] = []
        self.tier_stats: list[tuple[float, dict[str, Any]]] = []
        self.books: list[tuple[float, dict[str, int]]] = []  # (t, the SSD's books: index vs files)
        self.t0 = 0.0
        self.mounted = False
        self.notes: list[str] = []
        self.quiet = bool(getattr(args, "json", False))

    # --- setup ------------------------------------------------------------------------------------

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[soak {self.now():7.1f}s] {msg}", file=sys.stderr, flush=True)

    def now(self) -> float:
        return time.time() - self.t0 if self.t0 else 0.0

    def setup(self, stack: contextlib.ExitStack) -> None:
        from kvstore.harness.servers import free_port, redis_server

        self.root = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
        stack.callback(shutil.rmtree, self.root, ignore_errors=True)
        self.mnt = self.root / "mnt"
        self.mnt.mkdir()
        ssd_bytes = self.args.ssd_kib * KiB
        # room for the tier's capacity plus its recycled files' slack and temp files of batches in flight
        self.tmpfs_bytes = ssd_bytes + max(4 * MiB, ssd_bytes // 2)
        if os.geteuid() == 0:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={self.tmpfs_bytes},mode=0700", "kvstore-soak", str(self.mnt)],
                capture_output=True, text=True, check=False,
            )
            self.mounted = done.returncode == 0
            if self.mounted:
                stack.callback(self._umount)
            else:
                self.notes.append(f"tmpfs mount failed ({done.stderr.strip()}): SSD on a plain directory")
        else:
            self.notes.append("not root: SSD on a plain directory, no tmpfs")
        if not self.mounted and "ssd_full" in self.faults:
            self.faults.remove("ssd_full")
            self.notes.append("ssd_full skipped (no tmpfs)")
        self.ssd_dir = self.mnt / "ssd"
        self.data_dir = self.root / "data"
        self.records_dir = self.root / "records"
        self.records_dir.mkdir()
        self.epoch_file = self.root / "redis_epoch"
        self.epoch_file.write_bytes(EPOCH.pack(0))

        self.redis = stack.enter_context(redis_server())
        self.proxy = DelayProxy(self.redis.port, free_port())
        self.proxy.start()
        stack.callback(self.proxy.stop)
        self.grpc_port, self.http_port = free_port(), free_port()
        self.url = f"grpc://127.0.0.1:{self.grpc_port}"
        stack.callback(self._remove_sidecar_logs)
        stack.callback(self._stop_sidecar)
        self._start_sidecar()
        stack.callback(self._stop_workers)
        stack.callback(self._join_check)

    def _umount(self) -> None:
        for args in (["umount", str(self.mnt)], ["umount", "-l", str(self.mnt)]):
            if subprocess.run(args, capture_output=True, check=False).returncode == 0:
                return

    def sidecar_env(self) -> dict[str, str]:
        a = self.args
        return {
            "KVSTORE_DRAM__PAGE_BYTES": str(a.page_kib * KiB),
            "KVSTORE_DRAM__MIN_SLOT_BYTES": "4096",
            "KVSTORE_SSD__ENABLED": "true",
            "KVSTORE_SSD__PATH": str(self.ssd_dir),
            "KVSTORE_SSD__CAPACITY_BYTES": str(a.ssd_kib * KiB),
            "KVSTORE_REDIS__ENABLED": "true",
            "KVSTORE_REDIS__URL": f"redis://127.0.0.1:{self.proxy.port}/0",
            "KVSTORE_REDIS__KEY_PREFIX": f"soak-{self.run_id}",
            "KVSTORE_TIERING__CHAIN": '["ssd", "redis"]',
            "KVSTORE_TIERING__WRITE_THROUGH": '["redis"]',
            "KVSTORE_INDEX__ALLOCATION_TTL_MS": "5000",  # a killed client's allocations come back soon
            "KVSTORE_INDEX__LEASE_TTL_MS": "5000",
            "KVSTORE_INDEX__REAPER_INTERVAL_MS": "200",
        }

    def _start_sidecar(self) -> float:
        from kvstore.harness.sidecar import ServeProcess

        t = time.perf_counter()
        sc = ServeProcess(
            ["--grpc-address", f"127.0.0.1:{self.grpc_port}", "--http-address", f"127.0.0.1:{self.http_port}",
             "--data-dir", str(self.data_dir), "--dram-bytes", str(self.args.dram_kib * KiB)],
            env=self.sidecar_env(),
        )
        self.sidecars.append(sc)
        self.sidecar = sc
        self.expected_exit = False
        return time.perf_counter() - t

    def _stop_sidecar(self) -> None:
        """SIGTERM, and the time the drain takes (up to :data:`SHUTDOWN_TIMEOUT_S`; then a stack
        dump with py-spy where it is installed, and SIGKILL)."""
        sc = self.sidecar
        if sc is not None and sc.proc.poll() is None:
            self.expected_exit = True
            t = time.perf_counter()
            sc.proc.send_signal(signal.SIGTERM)
            self.final_exit = None
            for wait in (SLOW_SHUTDOWN_S, SHUTDOWN_TIMEOUT_S - SLOW_SHUTDOWN_S):
                try:
                    self.final_exit = sc.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    if not hasattr(self, "shutdown_dump") and shutil.which("py-spy"):  # what the drain waits for
                        dump = subprocess.run(["py-spy", "dump", "--pid", str(sc.proc.pid)], capture_output=True,
                                              text=True, timeout=60, check=False)
                        self.shutdown_dump = (dump.stdout + dump.stderr)[-20000:]
            self.shutdown_s = round(time.perf_counter() - t, 2)
        for sc in self.sidecars:
            if sc.proc.poll() is None:
                sc.stop(signal.SIGKILL)

    def _remove_sidecar_logs(self) -> None:
        if self.args.logs:
            dest = Path(self.args.logs)
            dest.mkdir(parents=True, exist_ok=True)
            for i, sc in enumerate(self.sidecars):
                with contextlib.suppress(OSError):
                    shutil.copy(sc.log.name, dest / f"sidecar-{i + 1}.log")
            for err in self.records_dir.glob("*.err"):
                shutil.copy(err, dest / err.name)
        for sc in self.sidecars:
            with contextlib.suppress(OSError):
                os.unlink(sc.log.name)

    def _spawn_worker(self) -> Worker:
        a = self.args
        wid = self.next_wid
        self.next_wid += 1
        records = self.records_dir / f"w{wid}.rec"
        cfg = {
            "wid": wid, "run": self.run_id, "url": self.url, "clients": a.clients, "chain": a.chain,
            "block_bytes": self.block_bytes, "window": a.window, "recent": a.recent,
            "put_fraction": a.put_fraction, "durable_fraction": a.durable_fraction, "seed": a.seed,
            "records": str(records), "epoch_file": str(self.epoch_file),
        }
        with open(self.records_dir / f"w{wid}.err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.soak", "--worker", json.dumps(cfg)],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
            )
        w = Worker(wid, proc, records)
        self.workers.append(w)
        return w

    def _stop_workers(self) -> None:
        live = [w for w in self.workers if w.proc.poll() is None]
        for w in live:
            w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for w in live:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(10)

    # --- faults --------------------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str, Callable[[], None]]]:
        b = self.bucket_s
        plan: list[tuple[float, str, Callable[[], None]]] = []
        if "redis_kill" in self.faults:
            plan += [(2.0 * b, "redis_kill", self.redis_kill), (2.3 * b, "redis_restart", self.redis_restart),
                     (7.0 * b, "redis_kill", self.redis_kill), (7.1 * b, "redis_restart", self.redis_restart)]
        if "slow_redis" in self.faults:
            plan += [(3.0 * b, "slow_redis", self.slow_on), (3.6 * b, "slow_redis_off", self.slow_off)]
        if "ssd_full" in self.faults:
            plan += [(4.0 * b, "ssd_full", self.ssd_fill), (4.6 * b, "ssd_full_off", self.ssd_free)]
        if "client_kill" in self.faults:
            plan += [(5.0 * b, "client_kill", self.client_kill)]
        if "sidecar_kill" in self.faults:
            plan += [(6.0 * b, "sidecar_kill", self.sidecar_kill), (7.6 * b, "sidecar_kill", self.sidecar_kill)]
        return sorted(plan, key=lambda e: e[0])

    def _begin(self, fault: str, **info: Any) -> None:
        self.active[fault] = self.now()
        self.events.append({"fault": fault, "t_s": round(self.now(), 2), **info})
        self._say(f"fault {fault} {info or ''}")

    def _end(self, fault: str, **info: Any) -> None:
        start = self.active.pop(fault, None)
        for e in reversed(self.events):
            if e["fault"] == fault and "duration_s" not in e:
                e["duration_s"] = round(self.now() - (start if start is not None else e["t_s"]), 2)
                e.update(info)
                break
        self._say(f"end of {fault} {info or ''}")

    def _set_epoch(self, value: int) -> None:
        with open(self.epoch_file, "r+b") as f:  # in place: the workers' mappings see it
            f.write(EPOCH.pack(value))

    def redis_kill(self) -> None:
        self.epoch += 1
        self._set_epoch(self.epoch)  # before the kill: an ack after this is not durable
        self.redis_up = False
        self.redis.stop()
        self._begin("redis_kill")

    def redis_restart(self) -> None:
        self.redis.start()
        self.redis_up = True
        self._end("redis_kill")

    def slow_on(self) -> None:
        self.proxy.delay_s = self.args.slow_ms / 2000
        self.slow = True
        self._begin("slow_redis", added_rtt_ms=self.args.slow_ms)

    def slow_off(self) -> None:
        self.proxy.delay_s = 0.0
        self.slow = False
        self._end("slow_redis")

    def ssd_fill(self) -> None:
        junk = self.mnt / "junk"
        written = 0
        chunk = b"\xa5" * MiB
        with open(junk, "wb", buffering=0) as f:
            while True:
                try:
                    written += f.write(chunk)
                except OSError:  # ENOSPC: the file system is full
                    break
            with contextlib.suppress(OSError):  # and the last partial page
                while f.write(b"\xa5" * 4096):
                    written += 4096
        free = os.statvfs(self.mnt)
        self._begin("ssd_full", junk_bytes=written, free_bytes=free.f_bavail * free.f_frsize)

    def ssd_free(self) -> None:
        (self.mnt / "junk").unlink(missing_ok=True)
        self._end("ssd_full")

    def client_kill(self) -> None:
        live = [w for w in self.workers if w.proc.poll() is None and not w.killed]
        if not live:
            return
        w = random.Random(self.args.seed).choice(live)
        w.killed = True
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait(10)
        new = self._spawn_worker()
        self.events.append({"fault": "client_kill", "t_s": round(self.now(), 2), "killed_worker": w.wid,
                            "replacement": new.wid, "duration_s": 0.0})
        self._say(f"fault client_kill: worker {w.wid} killed, worker {new.wid} started")

    def sidecar_kill(self) -> None:
        self._join_check()  # a check in flight asks this sidecar: it finishes first
        old = self.sidecar
        self.expected_exit = True
        old.stop(signal.SIGKILL)
        t = self.now()
        self._begin("sidecar_kill", pid=old.proc.pid)
        restart_s = self._start_sidecar()
        self._end("sidecar_kill", restart_s=round(restart_s, 2))
        if self.redis_up and not self.slow:  # on a thread: the schedule and the sampling go on meanwhile
            self._check = threading.Thread(
                target=self.durable_check, args=(f"after sidecar_kill at {t:.1f}s",), name="kvstore-soak-check"
            )
            self._check.start()

    def _join_check(self) -> None:
        if self._check is not None:
            self._check.join()
            self._check = None

    # --- the durable check --------------------------------------------------------------------------

    def _stats(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/stats", timeout=5) as r:
                doc: dict[str, Any] = json.loads(r.read())
                return doc
        except (OSError, ValueError):
            return None

    def _ssd_books(self, doc: dict[str, Any]) -> dict[str, int]:
        """What the sidecar's index places on the SSD (``/stats``) beside the block files there now
        (``*/*.blk``; recycled files in ``.free`` not counted): a file no block is placed in is an
        orphan, room the tier counts as used and the movers as free."""
        ssd = doc.get("tiers", {}).get("ssd", {})
        files = size = 0
        for path in self.ssd_dir.glob("*/*.blk"):
            with contextlib.suppress(OSError):
                size += path.stat().st_size
                files += 1
        return {"index_bytes": int(ssd.get("used_bytes", 0)), "index_blocks": int(ssd.get("blocks", 0)),
                "file_bytes": size, "files": files}

    def _redis_tier_down(self) -> bool:
        doc = self._stats() or {}
        return bool(doc.get("tiers", {}).get("redis", {}).get("down", False))

    def durable_check(self, when: str) -> dict[str, Any]:
        """Every block of every durable chain of this Redis epoch that no writer meant to delete:
        looked up in the sidecar now; the blocks past the matched run are lost."""
        from kvstore.client import SyncClient
        from kvstore.errors import KVStoreError

        t = time.perf_counter()
        epoch = self.epoch
        parsed = parse_records(self.workers, samples=False)
        chains = [c for c, e in parsed.durable.items() if e == epoch and c not in parsed.deleted]
        n = self.args.chain
        short: dict[tuple[int, int, int], int] = {}
        with SyncClient(self.url) as client:

            def matched(c: tuple[int, int, int]) -> int | None:
                try:
                    return client.lookup(NS, chain_keys(self.run_id, *c, n)).matched
                except KVStoreError:
                    return None

            for c in chains:
                m = matched(c)
                if m is None or m < n:
                    short[c] = -1 if m is None else m
            deadline = time.monotonic() + 15
            while short and time.monotonic() < deadline:  # a lookup failed or Redis was marked down: again
                if not (any(m < 0 for m in short.values()) or self._redis_tier_down()):
                    break
                time.sleep(0.5)
                again: dict[tuple[int, int, int], int] = {}
                for c in short:
                    m = matched(c)
                    if m is None or m < n:
                        again[c] = -1 if m is None else m
                short = again
        deleted_since = parse_records(self.workers, samples=False).deleted  # deletes logged meanwhile
        lost_chains = {c: m for c, m in short.items() if c not in deleted_since and m >= 0}
        errors = sum(1 for c, m in short.items() if c not in deleted_since and m < 0)
        lost = sum(n - m for m in lost_chains.values())
        check = {
            "when": when, "epoch": epoch, "durable_chains": len(chains), "durable_blocks": len(chains) * n,
            "lost_blocks": lost, "unanswered_chains": errors, "seconds": round(time.perf_counter() - t, 2),
            "lost_examples": [f"w{c[0]}/t{c[1]}/s{c[2]}: {m}/{n}" for c, m in list(lost_chains.items())[:5]],
        }
        self.durable_checks.append(check)
        self._say(f"durable check {when}: {len(chains)} chains, {lost} blocks lost")
        return check

    # --- the run ------------------------------------------------------------------------------------

    def sample(self) -> None:
        sc = self.sidecar
        if sc is not None and sc.proc.poll() is None:
            got = _proc_rss_fds(sc.proc.pid)
            if got is not None:
                rss, anon, shmem, fds = got
                self.rss.append((self.now(), rss, fds, len(self.sidecars), anon, shmem))
            self._sample_cpu(sc.proc.pid)

    def _sample_cpu(self, sidecar: int) -> None:
        """CPU time so far of the sidecar, of the soak's processes all told (the sidecar, the
        clients, redis-server, this process with its proxy thread) and of the machine."""
        pids = [sidecar, os.getpid(), *(w.proc.pid for w in self.workers if w.proc.poll() is None)]
        if self.redis.proc is not None:
            pids.append(self.redis.proc.pid)
        try:
            own = [process_cpu_s(p) for p in pids]
        except OSError:  # one of them has just exited: no sample this second
            return
        self.cpu.append((self.now(), tuple(pids), own[0], sum(own), _machine_busy_s()))

    def watch(self) -> None:
        """An exit nobody asked for: the sidecar (restarted, counted) or a worker (replaced, counted)."""
        sc = self.sidecar
        if sc is not None and not self.expected_exit and sc.proc.poll() is not None:
            code = sc.proc.returncode
            tail = sc.logs().splitlines()[-20:]
            self.sidecar_crashes.append({"t_s": round(self.now(), 2), "exit_code": code, "log_tail": tail})
            self._say(f"sidecar exited unexpectedly ({code}); restarting")
            self._start_sidecar()
        for w in list(self.workers):
            if not w.killed and w.proc.poll() is not None:
                w.killed = True
                err = (self.records_dir / f"w{w.wid}.err").read_text(errors="replace")[-2000:]
                self.client_crashes.append({"t_s": round(self.now(), 2), "worker": w.wid,
                                            "exit_code": w.proc.returncode, "stderr_tail": err})
                self._say(f"worker {w.wid} exited unexpectedly ({w.proc.returncode}); replacing it")
                self._spawn_worker()

    def run(self) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            self.setup(stack)
            self.t0 = time.time()
            for _ in range(self.args.processes):
                self._spawn_worker()
            plan = self.schedule()
            next_sample = 0.0
            next_stats = 0.0
            while (now := self.now()) < self.duration:
                while plan and plan[0][0] <= now:
                    _, _, fn = plan.pop(0)
                    self._join_check()  # a durable check never overlaps a fault (a Redis kill would void it)
                    fn()
                if now >= next_sample:
                    self.sample()
                    next_sample = now + SAMPLE_S
                if now >= next_stats:
                    if (doc := self._stats()) is not None:
                        self.tier_stats.append((now, doc))
                        self.books.append((now, self._ssd_books(doc)))
                    if self.sidecar.proc.poll() is None:
                        kinds = _fd_kinds(self.sidecar.proc.pid, self.proxy.port)
                        self.fd_kinds.append((now, len(self.sidecars), kinds))
                    next_stats = now + self.bucket_s / 4
                self.watch()
                time.sleep(TICK_S)
            self.t_end = time.time()
            for _, name, fn in plan:  # a fault whose end fell past the run (the schedule slipped): ended now
                if name in ("redis_restart", "slow_redis_off", "ssd_full_off"):
                    fn()
            self.skipped = [name for _, name, _ in plan if name in FAULTS]
            self._say("stopping clients")
            self._join_check()
            self._stop_workers()
            self.final_check = self.durable_check("at the end") if self.redis_up else None
            time.sleep(2)  # demotions in flight land
            self.last_stats = self._stats()
            if self.last_stats is not None:  # clients gone, demotions drained (the final check waited)
                self.final_books = self._ssd_books(self.last_stats)
            self._stop_sidecar()
            self.sidecar_logs = self._sidecar_log_summary()
            return self.report()  # before the exit stack removes the records

    def _sidecar_log_summary(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for sc in self.sidecars:
            try:
                lines = Path(sc.log.name).read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if doc.get("level") in ("warning", "error", "critical"):
                    msg = re.sub(r"\d+", "N", str(doc.get("msg", "")).splitlines()[0] if doc.get("msg") else "")
                    last = str(doc.get("exc", "")).strip().splitlines()[-1:] or [""]
                    counts[f"{doc['level']}: {msg[:100]}" + (f" [{re.sub(r'[0-9]+', 'N', last[0])[:100]}]"
                                                              if last[0] else "")] += 1
        return dict(counts.most_common(30))

    # --- the report ----------------------------------------------------------------------------------

    def _tier_counters(self, t0: float, t1: float) -> dict[str, Any]:
        """Tier counters of the sidecar's /stats taken inside [t0, t1): the last doc's minus the
        first's (a restart resets them: then the last doc's own)."""
        docs = [d for t, d in self.tier_stats if t0 <= t < t1]
        if not docs:
            return {}
        last, first = docs[-1], docs[0]
        out: dict[str, Any] = {}
        for tier in ("dram", "ssd", "redis"):
            a, z = first.get("tiers", {}).get(tier, {}), last.get("tiers", {}).get(tier, {})
            keep = {}
            for k in ("evictions", "demotions", "demotions_skipped", "promotions", "hits", "errors", "misses",
                      "checksum_failures"):
                if k in z:
                    v = z[k] - a.get(k, 0)
                    keep[k] = v if v >= 0 else z[k]
            keep["down"] = z.get("down", False)
            out[tier] = keep
        return out

    def report(self) -> dict[str, Any]:
        parsed = parse_records(self.workers)
        nb, b = self.args.buckets, self.bucket_s
        t0 = self.t0
        buckets = []
        for i in range(nb):
            lo, hi = t0 + i * b, t0 + (i + 1) * b
            ss = [s for s in parsed.samples if lo <= s.t < hi]
            puts = [s for s in ss if s.op == "put"]
            gets = [s for s in ss if s.op == "get"]
            moved = sum(s.got for s in ss) * self.block_bytes
            rs = [r for r in self.rss if lo - t0 <= r[0] < hi - t0]

            def p(xs: list[Sample], q: float) -> float | None:
                return round(float(np.percentile([s.lat_ms for s in xs], q)), 2) if xs else None

            faults = sorted({e["fault"] for e in self.events
                             if e["t_s"] < hi - t0 and e["t_s"] + e.get("duration_s", 0) >= lo - t0})
            buckets.append({
                "bucket": i, "t_s": [round(i * b, 1), round((i + 1) * b, 1)],
                "ops_per_s": round(len(ss) / b, 2), "puts_per_s": round(len(puts) / b, 2),
                "gets_per_s": round(len(gets) / b, 2), "mib_per_s": round(moved / MiB / b, 3),
                "p50_ms": p(ss, 50), "p99_ms": p(ss, 99), "put_p99_ms": p(puts, 99), "get_p99_ms": p(gets, 99),
                "get_hit_ratio": round(sum(s.got for s in gets) / max(1, sum(s.blocks for s in gets)), 3),
                "errors": sum(1 for t, _ in parsed.errors if lo <= t < hi),
                "rss_mib": round(max(r[1] for r in rs), 1) if rs else None,
                "rss_anon_mib": round(max(r[4] for r in rs), 1) if rs else None,
                "rss_shmem_mib": round(max(r[5] for r in rs), 1) if rs else None,
                "fds": max(r[2] for r in rs) if rs else None,
                "fds_median": int(np.median([r[2] for r in rs])) if rs else None,
                "sidecar_incarnations": sorted({r[3] for r in rs}),
                "ssd_books": next((k for t, k in reversed(self.books) if lo - t0 <= t < hi - t0), {}),
                "fd_kinds": next((k for t, _, k in reversed(self.fd_kinds) if lo - t0 <= t < hi - t0), {}),
                "faults": faults, "tiers": self._tier_counters(lo - t0, hi - t0),
                **self._cpu_use(lo - t0, hi - t0, len(ss)),
            })
        errors = dict(Counter(k for _, k in parsed.errors).most_common())
        lost = sum(c["lost_blocks"] for c in self.durable_checks if c["when"] != "at the end")
        final = self.final_check
        corrupt = len(parsed.corrupt)
        targets = self._targets(buckets, corrupt, lost)
        total_ops = len(parsed.samples)
        books = getattr(self, "final_books", None)
        result: dict[str, Any] = {
            "suite": "soak",
            "figures": {
                "corrupt_reads": {"value": corrupt, "unit": "blocks"},
                "lost_durable_blocks": {"value": lost, "unit": "blocks"},
                "lost_durable_blocks_at_end": {"value": final["lost_blocks"] if final else -1, "unit": "blocks"},
                "durable_blocks_checked": {"value": sum(c["durable_blocks"] for c in self.durable_checks),
                                           "unit": "blocks"},
                "sidecar_crashes": {"value": len(self.sidecar_crashes), "unit": "unexpected exits"},
                "client_crashes": {"value": len(self.client_crashes), "unit": "unexpected exits"},
                "ops": {"value": total_ops, "unit": "ops"},
                "reads_verified_blocks": {"value": sum(s.got for s in parsed.samples if s.op == "get"),
                                          "unit": "blocks"},
                "client_errors": {"value": len(parsed.errors), "unit": "errors"},
                "ops_per_s": {"value": round(total_ops / self.duration, 2), "unit": "ops/s"},
                # block files on the SSD that no block of the index is placed in, once the clients are
                # gone (a lower bound: demotions still queued would count in the index's blocks)
                "ssd_orphan_files_at_end": {"value": max(0, books["files"] - books["index_blocks"]) if books else -1,
                                            "unit": "files"},
            },
            "ssd_books_at_end": books,
            "ratios": {},
            "corrupt_reads": corrupt,
            "lost_durable_blocks": lost,
            "errors": errors,
            "buckets": buckets,
            "faults": self.events,
            "faults_not_reached": getattr(self, "skipped", []),
            "durable_checks": self.durable_checks,
            "targets": targets,
            "sidecar": {"crashes": self.sidecar_crashes, "final_exit_code": getattr(self, "final_exit", None),
                        "final_shutdown_s": getattr(self, "shutdown_s", None),
                        "shutdown_stack_dump": getattr(self, "shutdown_dump", None),
                        "starts": len(self.sidecars), "log_warnings_errors": self.sidecar_logs},
            "clients": {"crashes": self.client_crashes, "processes_started": len(self.workers),
                        "unexpected_errors": parsed.unexpected[:10], "corrupt_examples": parsed.corrupt[:10]},
            "config": {k: v for k, v in vars(self.args).items() if k != "json"} | {
                "bucket_s": round(b, 2), "faults": self.faults, "tmpfs_bytes": self.tmpfs_bytes if self.mounted else 0,
                "run_id": self.run_id,
            },
            "notes": {"setup": self.notes} if self.notes else {},
        }
        if targets.get("throughput_last_vs_baseline", {}).get("value") is not None:
            result["ratios"]["throughput_last_vs_baseline"] = targets["throughput_last_vs_baseline"]["value"]
        if self.args.plot:
            result["plot"] = self.plot(buckets, self.args.plot)
        return result

    def _cpu_use(self, t0: float, t1: float, ops: int) -> dict[str, float | None]:
        """Where a bucket's throughput came from: the sidecar's CPU time per op (what an op costs
        it, whatever else runs), the cores the sidecar used, and the cores other jobs on the
        machine used meanwhile (the machine's busy time less the soak's own processes': what the
        soak competed with). From consecutive 1 s samples within ``[t0, t1)`` of the same
        processes (a pair across a restart or a replaced client is skipped)."""
        xs = [c for c in self.cpu if t0 <= c[0] < t1]
        pairs = [(a, b) for a, b in itertools.pairwise(xs) if a[1] == b[1]]
        span = sum(b[0] - a[0] for a, b in pairs)
        if not span:
            return {"sidecar_cpu_ms_per_op": None, "sidecar_cores": None, "other_jobs_cores": None}
        side = sum(b[2] - a[2] for a, b in pairs)
        others = sum((b[4] - a[4]) - (b[3] - a[3]) for a, b in pairs)
        ops_in_span = ops * span / (t1 - t0)
        return {
            "sidecar_cpu_ms_per_op": round(1000 * side / ops_in_span, 3) if ops_in_span else None,
            "sidecar_cores": round(side / span, 3),
            "other_jobs_cores": round(max(0.0, others / span), 3),
        }

    def _targets(self, buckets: list[dict[str, Any]], corrupt: int, lost: int) -> dict[str, Any]:
        t: dict[str, Any] = {
            "corrupt_reads_zero": {"met": corrupt == 0, "value": corrupt},
            "lost_durable_blocks_zero": {"met": lost == 0, "value": lost,
                                         "checks": len([c for c in self.durable_checks if c["when"] != "at the end"])},
            "no_unexpected_sidecar_exit": {"met": not self.sidecar_crashes, "value": len(self.sidecar_crashes)},
        }
        if len(buckets) >= 3:
            base = next((x for x in buckets[1:] if not x["faults"]), None)
            last = buckets[-1]
            if base is not None and base["ops_per_s"]:
                ratio = round(last["ops_per_s"] / base["ops_per_s"], 3)
                t["throughput_last_vs_baseline"] = {
                    "met": ratio >= 0.9, "value": ratio, "baseline_bucket": base["bucket"],
                    "last_faults": last["faults"],
                    # beside it, what tells the sidecar's cost from the machine's load: [baseline, last]
                    "sidecar_cpu_ms_per_op": [base["sidecar_cpu_ms_per_op"], last["sidecar_cpu_ms_per_op"]],
                    "other_jobs_cores": [base["other_jobs_cores"], last["other_jobs_cores"]],
                }
            # RSS: the bucket's highest sample; fds: the bucket's median sample (an SSD batch holds up to
            # 64 files open for a moment: the maximum is mostly where a sample fell)
            for key, name in (("rss_mib", "rss_flat"), ("fds_median", "fds_flat")):
                t[name] = self._flat(buckets, key)
        return t

    @staticmethod
    def _flat(buckets: list[dict[str, Any]], key: str) -> dict[str, Any]:
        """Within 10% of the first post-warm-up bucket, per sidecar process: its buckets after the
        warm-up (bucket 0) that it served alone; a process judged only when it served two or more."""
        per: dict[int, list[tuple[int, float]]] = {}
        for bk in buckets[1:]:
            if len(bk["sidecar_incarnations"]) == 1 and bk[key] is not None:
                per.setdefault(bk["sidecar_incarnations"][0], []).append((bk["bucket"], bk[key]))
        judged = {}
        for inc, vals in per.items():
            if len(vals) < 2:
                continue
            first = vals[0][1]
            hi, lo = max(v for _, v in vals) / first, min(v for _, v in vals) / first
            judged[str(inc)] = {"buckets": [b for b, _ in vals], "values": [v for _, v in vals],
                                "max_vs_first": round(hi, 3), "min_vs_first": round(lo, 3),
                                "met": hi <= 1.1 and lo >= 0.9}
        return {"met": bool(judged) and all(j["met"] for j in judged.values()), "per_sidecar": judged}

    def plot(self, buckets: list[dict[str, Any]], path: str) -> str:
        xs = [(x["t_s"][0] + x["t_s"][1]) / 2 / 60 for x in buckets]
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            csv = str(Path(path).with_suffix(".csv"))
            with open(csv, "w") as f:
                f.write("minute,ops_per_s,p99_ms,put_p99_ms,get_p99_ms,rss_mib,fds,faults\n")
                for x, bk in zip(xs, buckets):
                    f.write(f"{x:.2f},{bk['ops_per_s']},{bk['p99_ms']},{bk['put_p99_ms']},{bk['get_p99_ms']},"
                            f"{bk['rss_mib']},{bk['fds']},{'+'.join(bk['faults'])}\n")
            return csv
        fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        width = self.bucket_s / 60 * 0.8
        axes[0].bar(xs, [bk["ops_per_s"] for bk in buckets], width=width, color="tab:blue")
        axes[0].set_ylabel("ops/s")
        axes[0].set_title(f"kvstore bench soak: {self.args.processes} processes x {self.args.clients} clients, "
                          f"{self.args.minutes:g} min")
        for key, label in (("put_p99_ms", "put p99"), ("get_p99_ms", "get p99")):
            axes[1].plot(xs, [bk[key] if bk[key] is not None else math.nan for bk in buckets], "o-", label=label)
        axes[1].set_ylabel("p99 latency (ms)")
        axes[1].set_yscale("log")
        axes[1].legend(loc="upper left")
        ax2 = axes[2].twinx()
        for inc in sorted({r[3] for r in self.rss}):  # one line per sidecar process (restarts break it)
            rs = [r for r in self.rss if r[3] == inc]
            axes[2].plot([r[0] / 60 for r in rs], [r[1] for r in rs], "-", color="tab:red",
                         label="RSS (1 s samples)" if inc == 1 else None)
            ax2.plot([r[0] / 60 for r in rs], [r[2] for r in rs], ":", color="tab:gray",
                     label="open fds" if inc == 1 else None)
        axes[2].plot(xs, [bk["rss_mib"] or math.nan for bk in buckets], "o", color="tab:red", label="bucket max")
        axes[2].set_ylabel("sidecar RSS (MiB)")
        ax2.set_ylabel("sidecar open fds")
        axes[2].legend(loc="lower left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        axes[2].set_xlabel("minute")
        for e in self.events:
            a, z = e["t_s"] / 60, (e["t_s"] + max(e.get("duration_s", 0), self.bucket_s / 40)) / 60
            for ax in axes:
                ax.axvspan(a, z, color="orange", alpha=0.25)
            axes[0].text(a, 0, e["fault"], rotation=90, fontsize=7, va="bottom")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The soak; SIGTERM unwinds it like an error (everything started is stopped, unmounted, removed)."""
    previous = None
    if threading.current_thread() is threading.main_thread():

        def _terminate(*_: object) -> None:
            raise SystemExit("soak: terminated")

        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return Soak(args).run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--worker":
        return worker_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=(__doc__ or "").strip())
    p.add_argument("--json", action="store_true")
    add_arguments(p)
    result = run(p.parse_args(argv))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

