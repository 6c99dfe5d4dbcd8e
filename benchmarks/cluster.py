"""The cluster between hosts: peer fetch, directory writes and remote lookups, each against a raw
baseline measured in the same run between the same hosts.

Three hosts (network namespaces with a
private /dev/shm each, :class:`kvstore.harness.hosts.Hosts`), one redis-server on their bridge as
the directory. Sidecar A (``kvstore serve``, cluster on) runs in host 0 and holds the blocks;
sidecar B runs in host 1, sidecar C (the encrypted fetcher) in host 2. Every client is an agent
process on its sidecar's host (``nsenter`` into that sidecar's network and mount namespaces, so it
reaches the sidecar's local socket and maps its shared memory like an engine there); host 0's agent
also serves the baselines' bytes, host 1's receives them. Needs root (namespaces).

* ``peer_fetch_vs_raw_tcp``: one Prefetch on B of ``--blocks`` blocks only A holds (a directory
  lookup, a fetch over the peer data path straight into B's slots, a checksum check of every
  block) against a plain TCP server on host 0 sending the same blocks, with the peer wire's answer
  head (a count, then size and checksum per block) before them, from memory over ONE connection
  into pre-faulted, page-aligned buffers on host 1, with the peer path's own system calls
  (blocking ``sendmsg`` of every block, :func:`kvstore.wire.peer.send_buffers`; one
  blocking ``recv_into`` with ``MSG_WAITALL`` per block, :func:`~kvstore.wire.peer.recv_into_all`),
  so the ratio prices kvstore's own work (the Prefetch call, the directory lookup, slots, the
  checksum of every block), not a different way of using the socket. GB/s of the median round
  each, and of the best.
* ``peer_fetch_encrypted_vs_clear``: the same Prefetch of the same blocks from A by sidecar C on a
  third host, with ``cluster.peer_encryption`` on (A and B have it off: a connection is encrypted
  when either end asks, so C's are and B's are not), against B's clear fetch in the same round:
  what AES-256-GCM over every frame costs (``peer_fetch_encrypted_vs_raw_tcp`` beside it). C picks
  A among the holders (B holds a set too once it fetched it: the node ids break the tie, "a" first).
* ``grpc_stream_vs_raw_tcp``: the same blocks as a bare gRPC server-streaming call (one ``bytes``
  message per block, messages prebuilt on the server, message limits raised, each message copied
  into the same buffers) against the same raw TCP: why the peer path is raw TCP.
* ``peer_fetch_vs_mooncake``: the peer fetch against Mooncake's transfer engine (TCP protocol,
  P2P handshake) reading the same blocks into the same buffers, when ``mooncake-transfer-engine``
  is importable here; otherwise null, with the reason in ``notes.mooncake``.
* ``publish_vs_raw_redis``: :meth:`kvstore.cluster.directory.Directory.publish` of ``--records``
  records against redis-py pipelined HSETs of the same keys, fields and values in one pipeline of
  the same size (``execute_command("HSET", ...)``, redis-py's leanest call), on the same client
  object, from host 1.
* ``remote_lookup_p50_vs_local``: Lookup p50 on B of ``--lookup-keys`` blocks only A holds (one
  directory round trip) ÷ Lookup p50 on A of the same blocks (a local hit), each over gRPC from a
  client on that sidecar's host. This one is lower-is-better (remote ÷ local; target at most 2).

Every round of every figure uses blocks, keys or records of its own (a distinct request each
time); rounds follow one untimed warm-up round, and the sides alternate within each round so that
machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib.util
import json
import mmap
import os
import queue
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from benchmarks.common import Result, pages, percentile
from kvstore.cluster.cluster_key import MAC_BYTES, Session
from kvstore.keys import Namespace, prefix_keys
from kvstore.wire import peer as w

MiB = 1 << 20
NS = Namespace(model="bench-cluster", kv_layout="raw", dtype="uint8", block_size=1)
TOKEN = "bench-cluster-token"
LOOKUP_BLOCK = 4096
WARM_LOOKUPS = 10  # untimed lookups on each sidecar first, on key sets of their own
FETCH_SET, LOOKUP_SET = 1_000, 100_000  # key set ids: fetch round r uses FETCH_SET + r
SHM_BYTES = 1 << 30  # each test host's /dev/shm (kvstore.harness.hosts)
REQ = struct.Struct("<II")  # the baselines' request: key set id, blocks
STAMP = struct.Struct("<QQ")  # the first bytes of every block: its key set and index
GRPC_METHOD = "/kvstore.bench.Blocks/Fetch"
REPO = Path(__file__).resolve().parents[1]
AGENT = "from benchmarks.cluster import agent_main; agent_main()"
START_TIMEOUT_S = 60.0
FETCH_SIDES = ("peer", "peer_encrypted", "raw", "grpc", "mooncake")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--blocks", type=int, default=64, help="blocks per fetch (one Prefetch, one request of each baseline)"
    )
    p.add_argument("--block-bytes", type=int, default=MiB, help="bytes per block")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds after one warm-up, each on blocks of its own")
    p.add_argument("--records", type=int, default=4096, help="directory records per publish (one pipeline)")
    p.add_argument("--lookups", type=int, default=200, help="timed Lookups on each sidecar, each a distinct key set")
    p.add_argument("--lookup-keys", type=int, default=16, help="keys per Lookup")


def keys_of(set_id: int, n: int) -> list[bytes]:
    """The keys of one key set: a chain of ``n`` blocks whose first token is the set's id."""
    return prefix_keys(NS, [set_id] * n)


def _slot_bytes(size: int) -> int:
    """The sidecar's slot for a block of ``size`` bytes: its power-of-two size class."""
    return max(4096, 1 << (size - 1).bit_length())


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


# --- the driver: hosts, directory, sidecars and agents ---------------------------------------------


def _preflight(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit(
            "kvstore bench cluster needs root: it makes two test hosts (network namespaces with a private "
            "/dev/shm, kvstore.harness.hosts) and enters them with nsenter; run it as root"
        )
    missing = [t for t in ("ip", "nsenter", "unshare", "redis-server") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"kvstore bench cluster needs {', '.join(missing)} on the PATH")
    for name in ("blocks", "block_bytes", "rounds", "records", "lookups", "lookup_keys"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.block_bytes < STAMP.size:
        raise SystemExit(f"--block-bytes must be at least {STAMP.size}")


def _readline(stream: IO[str], timeout: float) -> str:
    """One line from a child's stdout pipe, or "" when it closes or says nothing for ``timeout`` s."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


def _tail(path: Path, n: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


class HostSidecar:
    """``kvstore serve`` with the cluster on, on one host, the way users run it."""

    def __init__(
        self, host: Any, name: str, workdir: Path, directory_url: str, dram: int, page: int, encrypt: bool = False
    ) -> None:
        from kvstore.util.tuning import ENV as MALLOC_ENV

        self.name = name
        self.log_path = workdir / f"sidecar-{name}.log"
        env = {
            **os.environ, **MALLOC_ENV, "PYTHONPATH": str(REPO),
            "KVSTORE_SSD__ENABLED": "false",
            "KVSTORE_DRAM__PAGE_BYTES": str(page),
            "KVSTORE_CLUSTER__ENABLED": "true",
            "KVSTORE_CLUSTER__DIRECTORY_URL": directory_url,
            "KVSTORE_CLUSTER__NODE_ID": name,
            "KVSTORE_CLUSTER__PEER_ADDRESS": f"{host.ip}:0",
            "KVSTORE_CLUSTER__TOKEN": TOKEN,
            "KVSTORE_CLUSTER__FETCH_TIMEOUT_S": "60",  # a slow machine must not turn the figure into misses
            "KVSTORE_CLUSTER__PEER_ENCRYPTION": "true" if encrypt else "false",
        }
        argv = [sys.executable, "-m", "kvstore", "serve", "--grpc-address", f"{host.ip}:0",
                "--http-address", f"{host.ip}:0", "--data-dir", str(workdir / name), "--dram-bytes", str(dram)]
        with open(self.log_path, "w") as log:
            self.proc: subprocess.Popen[str] = host.popen(
                argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=env
            )
        assert self.proc.stdout is not None
        line = _readline(self.proc.stdout, START_TIMEOUT_S)
        if not line:
            self.stop()
            raise RuntimeError(f"sidecar {name} did not start: {_tail(self.log_path)}")
        ready = json.loads(line)
        self.grpc: str = ready["grpc"]
        self.peer: str = ready["peer"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Agent:
    """A process of this module (:func:`agent_main`) on a sidecar's host, in its network and mount
    namespaces; :meth:`call` runs one operation there and returns its result."""

    def __init__(self, pid: int, name: str, workdir: Path) -> None:
        from kvstore.util.tuning import ENV as MALLOC_ENV

        self.name = name
        self.log_path = workdir / f"agent-{name}.log"
        env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(REPO)}
        with open(self.log_path, "w") as log:
            self.proc: subprocess.Popen[str] = subprocess.Popen(
                ["nsenter", "-t", str(pid), "-m", "-n", sys.executable, "-c", AGENT],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=env,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"agent-{name}-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> Any:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            self.proc.stdin.flush()
            line = self._lines.get(timeout=timeout)
        except (OSError, queue.Empty):
            line = None
        if line is None:
            code = self.proc.poll()
            raise RuntimeError(f"agent {self.name}: no answer to {op} (exit {code}): {_tail(self.log_path)}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"agent {self.name}: {op} failed:\n{reply['error']}")
        return reply["ok"]

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(json.dumps({"op": "quit", "args": {}}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()


class Bench:
    """Everything the suite starts, stopped in reverse order on the way out, error or not."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n, self.size, self.sets = args.blocks, args.block_bytes, args.rounds + 1
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Bench:
        try:
            self._start()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _start(self) -> None:
        from kvstore.harness.hosts import Hosts
        from kvstore.harness.servers import redis_server

        a = self.args
        page = max(4 * MiB, _slot_bytes(self.size))
        fetched = _round_up(self.sets * self.n * _slot_bytes(self.size), page)
        looked_up = _round_up((a.lookups + WARM_LOOKUPS) * a.lookup_keys * LOOKUP_BLOCK, page)
        dram_a, dram_b = fetched + looked_up + 4 * page, fetched + 4 * page
        if dram_a > SHM_BYTES - 16 * MiB:
            raise SystemExit(
                f"sidecar A would need a {dram_a >> 20} MiB slab; each test host's /dev/shm holds "
                f"{SHM_BYTES >> 20} MiB: use fewer --blocks, --rounds, --block-bytes or --lookups"
            )
        workdir = Path(self.stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-bench-cluster-")))
        self.hosts = self.stack.enter_context(Hosts(3))
        self.redis = self.stack.enter_context(redis_server(host=self.hosts.bridge_ip))
        self.a = HostSidecar(self.hosts[0], "a", workdir, self.redis.url, dram_a, page)
        self.stack.callback(self.a.stop)
        self.b = HostSidecar(self.hosts[1], "b", workdir, self.redis.url, dram_b, page)
        self.stack.callback(self.b.stop)
        self.c = HostSidecar(self.hosts[2], "c", workdir, self.redis.url, dram_b, page, encrypt=True)
        self.stack.callback(self.c.stop)
        self.holder = Agent(self.a.proc.pid, "holder", workdir)
        self.stack.callback(self.holder.stop)
        self.fetcher = Agent(self.b.proc.pid, "fetcher", workdir)
        self.stack.callback(self.fetcher.stop)
        self.encrypted = Agent(self.c.proc.pid, "fetcher-encrypted", workdir)  # C's: Prefetch only
        self.stack.callback(self.encrypted.stop)

    # --- 1, 2, 5: fetches ------------------------------------------------------------------------

    def fetch_rounds(self) -> tuple[dict[str, list[float]], dict[str, Any]]:
        """Seconds per timed round of each fetch side, and notes."""
        sets = [FETCH_SET + r for r in range(self.sets)]
        notes: dict[str, Any] = {}
        self.holder.call("fill", timeout=600, url=self.a.grpc, sets=sets, n=self.n, size=self.size, source=True)
        served = self.holder.call("serve", ip=self.hosts[0].ip)
        self.fetcher.call("setup", sets=sets, n=self.n, size=self.size, ip=self.hosts[0].ip, **served)
        self.encrypted.call("expect", n=self.n)
        sides = ["peer", "peer_encrypted", "raw", "grpc"]
        mooncake = _mooncake_missing()
        if mooncake is None:
            try:
                remote = self.holder.call("mooncake_serve", ip=self.hosts[0].ip)
                self.fetcher.call("mooncake_setup", ip=self.hosts[1].ip, **remote)
                sides.append("mooncake")
            except RuntimeError as exc:
                mooncake = f"installed, but its transfer engine did not start here: {_last_line(str(exc))}"
        notes["mooncake"] = mooncake or "measured: mooncake-transfer-engine's TransferEngine, tcp, P2P handshake"
        seconds: dict[str, list[float]] = {s: [] for s in sides}
        for r, set_id in enumerate(sets):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                if side in ("peer", "peer_encrypted"):
                    agent, sidecar = (self.fetcher, self.b) if side == "peer" else (self.encrypted, self.c)
                    got = agent.call("peer", url=sidecar.grpc, set_id=set_id)
                    if got["ready"] != self.n:
                        raise RuntimeError(f"Prefetch on {sidecar.name} of key set {set_id}: {got['ready']} of "
                                           f"{self.n} ready")
                else:
                    got = self.fetcher.call(side, set_id=set_id)
                if r:  # round 0 warms up every path (connections, first faults)
                    seconds[side].append(got["seconds"])
        check = self.fetcher.call("peer_check", url=self.b.grpc, set_id=sets[-1])
        if check["verified"] != self.n:
            raise RuntimeError(f"B's copies of key set {sets[-1]}: {check['verified']} of {self.n} blocks intact")
        cluster = check["cluster"]
        if cluster.get("blocks_fetched") != self.sets * self.n or cluster.get("checksum_failures"):
            raise RuntimeError(f"B's cluster counters after the fetches: {cluster}")
        notes["b_cluster_counters"] = {k: cluster[k] for k in ("directory_lookups", "blocks_fetched", "bytes_fetched",
                                                              "fetch_failures", "checksum_failures") if k in cluster}
        check = self.encrypted.call("peer_check", url=self.c.grpc, set_id=sets[-1])
        if check["verified"] != self.n or check["cluster"].get("blocks_fetched") != self.sets * self.n:
            raise RuntimeError(f"C's copies of key set {sets[-1]}: {check['verified']} of {self.n} blocks intact; "
                               f"its cluster counters: {check['cluster']}")
        return seconds, notes

    # --- 4: lookups ------------------------------------------------------------------------------

    def lookup_rounds(self) -> tuple[list[float], list[float], list[str]]:
        """Seconds per Lookup: on A (local hits) and on B (blocks only A holds); B's answers' tiers."""
        a = self.args
        k = a.lookup_keys
        sets = [LOOKUP_SET + j for j in range(WARM_LOOKUPS + a.lookups)]
        self.holder.call("fill", timeout=600, url=self.a.grpc, sets=sets, n=k, size=LOOKUP_BLOCK, source=False)
        warm, timed = sets[:WARM_LOOKUPS], sets[WARM_LOOKUPS:]
        local: list[float] = []
        remote: list[float] = []
        tiers: set[str] = set()
        chunks = [timed[i :: a.rounds] for i in range(a.rounds)]
        for r, chunk in enumerate([warm, *chunks]):
            if not chunk:
                continue
            calls = [("local", self.holder, self.a.grpc), ("remote", self.fetcher, self.b.grpc)]
            for name, agent, url in calls if r % 2 == 0 else calls[::-1]:
                got = agent.call("lookup", url=url, sets=chunk, keys=k)
                if r:
                    (local if name == "local" else remote).extend(got["seconds"])
                if name == "remote":
                    tiers.update(got["tiers"])
        return local, remote, sorted(tiers)

    # --- 3: directory writes -----------------------------------------------------------------------

    def publish_rounds(self) -> dict[str, list[float]]:
        got: dict[str, list[float]] = self.fetcher.call(
            "publish", timeout=600, url=self.redis.url, records=self.args.records, rounds=self.sets, size=self.size
        )
        return {side: s[1:] for side, s in got.items()}  # round 0: the warm-up


def _mooncake_missing() -> str | None:
    """Why Mooncake's transfer engine cannot be measured here (None: it is installed)."""
    try:
        found = importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "not installed here (pip install mooncake-transfer-engine-non-cuda; it also needs libibverbs1)"
    return None


def _last_line(text: str) -> str:
    lines = [s.strip() for s in text.strip().splitlines() if s.strip()]
    return lines[-1] if lines else text


def _measure(args: argparse.Namespace) -> tuple[Any, ...]:
    with Bench(args) as bench:
        fetch, notes = bench.fetch_rounds()
        local, remote, tiers = bench.lookup_rounds()
        publish = bench.publish_rounds()
    return fetch, notes, local, remote, tiers, publish


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through Bench: every process and namespace goes


def run(args: argparse.Namespace) -> dict[str, Any]:
    _preflight(args)
    res = Result("cluster")
    load = os.getloadavg()[0]
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        fetch, notes, local, remote, tiers, publish = _measure(args)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    nbytes = args.blocks * args.block_bytes
    names = {"peer": "peer_fetch", "peer_encrypted": "peer_fetch_encrypted", "raw": "raw_tcp", "grpc": "grpc_stream",
             "mooncake": "mooncake"}
    rate: dict[str, tuple[float, float]] = {}  # side -> GB/s of the median round, of the best
    for side, secs in fetch.items():
        name = names[side]
        median, best = percentile(secs, 50), min(secs)
        rate[side] = (nbytes / median / 1e9, nbytes / best / 1e9)
        res.figure(f"{name}_GBps", rate[side][0], "GB/s")
        res.figure(f"{name}_GBps_best", rate[side][1], "GB/s")
        res.figure(f"{name}_round_ms_p50", median * 1e3, "ms")
        res.figure(f"{name}_round_ms_best", best * 1e3, "ms")
    records: dict[str, tuple[float, float]] = {}
    for side, secs in publish.items():
        name = "publish" if side == "directory" else "raw_redis"
        records[side] = (args.records / percentile(secs, 50), args.records / min(secs))
        res.figure(f"{name}_records_per_s", records[side][0], "records/s")
        res.figure(f"{name}_records_per_s_best", records[side][1], "records/s")
    for name, secs in (("local_lookup", local), ("remote_lookup", remote)):
        res.figure(f"{name}_p50", percentile(secs, 50) * 1e3, "ms")
        res.figure(f"{name}_p99", percentile(secs, 99) * 1e3, "ms")
    res.figure("blocks_per_fetch", args.blocks, "blocks")
    res.figure("block_bytes", args.block_bytes, "bytes")
    res.figure("timed_rounds", args.rounds, "rounds")
    res.figure("records_per_publish", args.records, "records")
    res.figure("keys_per_lookup", args.lookup_keys, "keys")
    res.figure("lookups_per_sidecar", len(remote), "calls")

    res.ratio("peer_fetch_vs_raw_tcp", rate["peer"][0] / rate["raw"][0])
    res.ratio("peer_fetch_vs_raw_tcp_best", rate["peer"][1] / rate["raw"][1])
    res.ratio("peer_fetch_encrypted_vs_clear", rate["peer_encrypted"][0] / rate["peer"][0])
    res.ratio("peer_fetch_encrypted_vs_clear_best", rate["peer_encrypted"][1] / rate["peer"][1])
    res.ratio("peer_fetch_encrypted_vs_raw_tcp", rate["peer_encrypted"][0] / rate["raw"][0])
    res.ratio("grpc_stream_vs_raw_tcp", rate["grpc"][0] / rate["raw"][0])
    res.ratio("grpc_stream_vs_raw_tcp_best", rate["grpc"][1] / rate["raw"][1])
    res.ratio("publish_vs_raw_redis", records["directory"][0] / records["raw"][0])
    res.ratio("publish_vs_raw_redis_best", records["directory"][1] / records["raw"][1])
    res.ratio("remote_lookup_p50_vs_local", percentile(remote, 50) / percentile(local, 50))
    if "mooncake" in rate:
        res.ratio("peer_fetch_vs_mooncake", rate["peer"][0] / rate["mooncake"][0])
        res.ratio("peer_fetch_vs_mooncake_best", rate["peer"][1] / rate["mooncake"][1])
    else:
        res.ratios["peer_fetch_vs_mooncake"] = None  # type: ignore[assignment]  # not measured: notes.mooncake says why
    res.notes.update(notes)
    res.notes["rounds_ms"] = {names[s]: [round(x * 1e3, 3) for x in secs] for s, secs in fetch.items()}
    res.notes["remote_lookup_tiers"] = tiers
    res.notes["load_avg_1m"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}
    res.notes["ratios"] = ("X_vs_Y = X / Y of the median round (_best: of the best round), GB/s or records/s, "
                           "higher is better; remote_lookup_p50_vs_local = remote p50 / local p50, lower is better")
    res.notes["setup"] = (f"three network namespaces on one bridge (veth), redis-server on the bridge; {args.blocks} x "
                          f"{args.block_bytes} B blocks per fetch; peer path: one connection per holder per request, "
                          "blocking recv_into (MSG_WAITALL) into B's slots on an I/O thread + xxh3 check; raw TCP: one "
                          "blocking connection, the same answer head and system calls, no check; "
                          "gRPC: sync server/client, default flow control")
    return res.as_dict()


# --- the agents: one process on each sidecar's host ------------------------------------------------


def _block(pool: np.ndarray, set_id: int, i: int, out: memoryview | np.ndarray) -> None:
    """Block ``i`` of key set ``set_id``: random bytes of the pool, stamped with its set and index."""
    dst = np.frombuffer(out, dtype=np.uint8) if isinstance(out, memoryview) else out
    dst[:] = pool[i % len(pool)]
    dst[: STAMP.size] = np.frombuffer(STAMP.pack(set_id, i), dtype=np.uint8)


def _grpc_options(size: int) -> list[tuple[str, int]]:
    limit = size + MiB
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def _address_of(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


class AgentState:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # the clients' gRPC channels bind to it when made
        self.clients: dict[tuple[str, bool], Any] = {}
        self.sets: list[int] = []
        self.n = self.size = 0
        self.views: list[memoryview] = []  # holder: the baselines' source; fetcher: where they land
        self.mapping: mmap.mmap | None = None
        self.messages: list[bytes] = []  # holder: the gRPC messages, one per block
        self.raw: socket.socket | None = None
        self.grpc: Any = None  # holder: the server; fetcher: the channel
        self.fetch_stream: Callable[..., Any] | None = None
        self.mooncake: Any = None
        self.mooncake_remote: tuple[str, int, int] = ("", 0, 0)  # target, base address, stride

    def client(self, url: str, local: bool = True) -> Any:
        from kvstore.client import KVStoreClient

        c = self.clients.get((url, local))
        if c is None:
            c = self.clients[(url, local)] = KVStoreClient.from_url(url, local=local)
        return c

    def round(self, set_id: int) -> list[memoryview]:
        i = self.sets.index(set_id)
        return self.views[i * self.n : (i + 1) * self.n]

    def layout(self, sets: Sequence[int], n: int, size: int) -> None:
        """Page-aligned buffers for every block of every set, pre-faulted (as the sidecars' slabs are)."""
        self.sets, self.n, self.size = list(sets), n, size
        self.views, self.mapping = pages(len(sets) * n, size)
        np.frombuffer(self.mapping, dtype=np.uint8)[:: mmap.PAGESIZE] = 0

    def close(self) -> None:
        for c in self.clients.values():
            with contextlib.suppress(Exception):  # the agent is exiting: nothing to report to
                self.loop.run_until_complete(c.aclose())
        if self.raw is not None:
            self.raw.close()
        if self.grpc is not None:
            with contextlib.suppress(Exception):  # the agent is exiting
                if hasattr(self.grpc, "stop"):
                    self.grpc.stop(0)  # the holder's server
                else:
                    self.grpc.close()  # the fetcher's channel


def _op_fill(st: AgentState, url: str, sets: list[int], n: int, size: int, source: bool) -> dict[str, Any]:
    """Put every set's blocks into the sidecar at ``url`` (and, with ``source``, keep them here too:
    the bytes the baselines send)."""
    pool = np.frombuffer(np.random.default_rng(7).bytes(min(n, 16) * size), dtype=np.uint8).reshape(-1, size)
    if source:
        st.layout(sets, n, size)
    c = st.client(url)
    scratch = [np.empty(size, dtype=np.uint8) for _ in range(n)]
    for j, set_id in enumerate(sets):
        blocks = st.round(set_id) if source else scratch
        for i, b in enumerate(blocks):
            _block(pool, set_id, i, b)
        if source:
            st.messages += [bytes(b) for b in blocks]
        put = st.loop.run_until_complete(
            c.put_blocks(NS, keys_of(set_id, n), blocks, checksums=True, wait_published=j == len(sets) - 1)
        )
        if put.stored != n:
            raise RuntimeError(f"put of key set {set_id}: {put.stored} of {n} stored")
    return {}


def _op_serve(st: AgentState, ip: str) -> dict[str, Any]:
    """Start the baselines' servers: raw TCP (one connection at a time) and bare gRPC."""
    from concurrent import futures

    import grpc

    listener = socket.create_server((ip, 0))
    st.raw = listener

    def serve_raw() -> None:
        head = bytearray(REQ.size)
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = Session(bytes(32))  # the answer's head sealed as the peer path seals it (same bytes)
            with conn, contextlib.suppress(OSError):
                while True:
                    w.recv_into_all(conn, memoryview(head))
                    set_id, n = REQ.unpack(head)
                    views = st.round(set_id)[:n]
                    answer = w.answer_head([w.Entry(len(v), 0) for v in views], session)  # the peer path's answer
                    session.next()
                    w.send_buffers(conn, [memoryview(answer), *views])  # and its sends: sendmsg of all

    threading.Thread(target=serve_raw, name="raw-tcp-server", daemon=True).start()

    def fetch(request: bytes, context: Any) -> Any:
        set_id, n = REQ.unpack(request)
        base = st.sets.index(set_id) * st.n
        yield from st.messages[base : base + n]

    handler = grpc.method_handlers_generic_handler(
        "kvstore.bench.Blocks", {"Fetch": grpc.unary_stream_rpc_method_handler(fetch)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler], options=_grpc_options(st.size))
    grpc_port = server.add_insecure_port(f"{ip}:0")
    server.start()
    st.grpc = server
    return {"raw_port": listener.getsockname()[1], "grpc_port": grpc_port}


def _op_setup(
    st: AgentState, sets: list[int], n: int, size: int, ip: str, raw_port: int, grpc_port: int
) -> dict[str, Any]:
    import grpc

    st.layout(sets, n, size)
    st.raw = socket.create_connection((ip, raw_port), timeout=60)
    st.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    st.grpc = grpc.insecure_channel(f"{ip}:{grpc_port}", options=_grpc_options(size))
    grpc.channel_ready_future(st.grpc).result(timeout=30)
    st.fetch_stream = st.grpc.unary_stream(GRPC_METHOD)
    return {}


def _clear(views: list[memoryview]) -> None:
    """Wipe the stamps a previous side left, so that each side's check sees its own bytes."""
    for v in views:
        v[: STAMP.size] = bytes(STAMP.size)


def _check(views: list[memoryview], set_id: int, side: str) -> None:
    for i in (0, len(views) - 1):
        if bytes(views[i][: STAMP.size]) != STAMP.pack(set_id, i):
            raise RuntimeError(f"{side}: block {i} of key set {set_id} did not arrive")


def _op_raw(st: AgentState, set_id: int) -> dict[str, Any]:
    views = st.round(set_id)
    _clear(views)
    sock, head = st.raw, bytearray(w.COUNT.size + len(views) * w.ENTRY.size + MAC_BYTES)
    assert sock is not None
    t = time.perf_counter()
    sock.sendall(REQ.pack(set_id, len(views)))
    w.recv_into_all(sock, memoryview(head))
    for i, v in enumerate(views):
        size = w.Entry(*w.ENTRY.unpack_from(head, w.COUNT.size + i * w.ENTRY.size)).size
        if size != len(v):
            raise RuntimeError(f"raw TCP: block {i} of {size} bytes")
        w.recv_into_all(sock, v)  # the peer path's receive: recv_into with MSG_WAITALL
    seconds = time.perf_counter() - t
    _check(views, set_id, "raw TCP")
    return {"seconds": seconds}


def _op_grpc(st: AgentState, set_id: int) -> dict[str, Any]:
    views = st.round(set_id)
    _clear(views)
    assert st.fetch_stream is not None
    got = 0
    t = time.perf_counter()
    for msg in st.fetch_stream(REQ.pack(set_id, len(views)), timeout=120):
        views[got][:] = msg
        got += 1
    seconds = time.perf_counter() - t
    if got != len(views):
        raise RuntimeError(f"gRPC stream: {got} of {len(views)} blocks")
    _check(views, set_id, "gRPC stream")
    return {"seconds": seconds}


def _op_peer(st: AgentState, url: str, set_id: int) -> dict[str, Any]:
    c, keys = st.client(url), keys_of(set_id, st.n)
    t = time.perf_counter()
    ready = st.loop.run_until_complete(c.prefetch(NS, keys))
    return {"seconds": time.perf_counter() - t, "ready": ready}


def _op_expect(st: AgentState, n: int) -> dict[str, Any]:
    """An agent that only prefetches (C's): the blocks each key set has."""
    st.n = n
    return {}


def _op_peer_check(st: AgentState, url: str, set_id: int) -> dict[str, Any]:
    """Read B's copies of one key set through a lease (this host's shared memory), checksums checked."""

    async def check() -> tuple[int, dict[str, Any]]:
        c = st.client(url)
        async with c.acquire(NS, keys_of(set_id, st.n)) as lease:
            good = lease.verify()
            stamped = sum(bytes(v[: STAMP.size]) == STAMP.pack(set_id, i) for i, v in enumerate(lease.views[:good]))
        return stamped, (await c.stats())["cluster"]

    verified, cluster = st.loop.run_until_complete(check())
    return {"verified": verified, "cluster": cluster}


def _op_mooncake_serve(st: AgentState, ip: str) -> dict[str, Any]:
    from mooncake.engine import TransferEngine

    assert st.mapping is not None
    st.mooncake = TransferEngine()
    if (rc := st.mooncake.initialize(ip, "P2PHANDSHAKE", "tcp", "")) != 0:
        raise RuntimeError(f"TransferEngine.initialize: {rc}")
    base = _address_of(st.mapping)
    if (rc := st.mooncake.register_memory(base, len(st.mapping))) != 0:
        raise RuntimeError(f"TransferEngine.register_memory: {rc}")
    stride = _round_up(st.size, mmap.PAGESIZE)
    return {"target": f"{ip}:{st.mooncake.get_rpc_port()}", "base": base, "stride": stride}


def _op_mooncake_setup(st: AgentState, ip: str, target: str, base: int, stride: int) -> dict[str, Any]:
    from mooncake.engine import TransferEngine

    assert st.mapping is not None
    st.mooncake = TransferEngine()
    if (rc := st.mooncake.initialize(ip, "P2PHANDSHAKE", "tcp", "")) != 0:
        raise RuntimeError(f"TransferEngine.initialize: {rc}")
    if (rc := st.mooncake.register_memory(_address_of(st.mapping), len(st.mapping))) != 0:
        raise RuntimeError(f"TransferEngine.register_memory: {rc}")
    st.mooncake_remote = (target, base, stride)
    return {}


def _op_mooncake(st: AgentState, set_id: int) -> dict[str, Any]:
    assert st.mapping is not None
    views = st.round(set_id)
    _clear(views)
    target, remote_base, stride = st.mooncake_remote
    first = st.sets.index(set_id) * st.n
    local_base = _address_of(st.mapping)
    local = [local_base + (first + i) * stride for i in range(st.n)]
    remote = [remote_base + (first + i) * stride for i in range(st.n)]
    t = time.perf_counter()
    rc = st.mooncake.batch_transfer_sync_read(target, local, remote, [st.size] * st.n)
    seconds = time.perf_counter() - t
    if rc != 0:
        raise RuntimeError(f"TransferEngine.batch_transfer_sync_read: {rc}")
    _check(views, set_id, "mooncake")
    return {"seconds": seconds}


def _op_lookup(st: AgentState, url: str, sets: list[int], keys: int) -> dict[str, Any]:
    c = st.client(url, local=False)  # gRPC on both sidecars: the same transport

    async def lookups() -> tuple[list[float], set[str]]:
        seconds, tiers = [], set()
        for set_id in sets:
            ks = keys_of(set_id, keys)
            t = time.perf_counter()
            found = await c.lookup(NS, ks)
            seconds.append(time.perf_counter() - t)
            if found.matched != keys:
                raise RuntimeError(f"Lookup at {url} of key set {set_id}: matched {found.matched} of {keys}")
            tiers.update(tier for tier, _ in found.blocks)
        return seconds, tiers

    seconds, tiers = st.loop.run_until_complete(lookups())
    return {"seconds": seconds, "tiers": sorted(tiers)}


def _op_publish(st: AgentState, url: str, records: int, rounds: int, size: int) -> dict[str, list[float]]:
    """``rounds`` rounds of one Directory.publish and one raw pipeline of as many HSETs, each of
    fresh keys, on the directory's own Redis client; the first side alternates."""
    from kvstore.cluster.directory import Directory, Record
    from kvstore.config import ClusterConfig
    from kvstore.store.books.index import DRAM

    directory = Directory.from_config(ClusterConfig(directory_url=url, key_prefix="bench-publish"), "bench-node")
    field, root, incarnation = directory.node.encode(), NS.root, time.time_ns() // 1_000_000
    out: dict[str, list[float]] = {"directory": [], "raw": []}

    def fresh() -> tuple[list[bytes], list[Record]]:
        keys = [os.urandom(w.KEY_BYTES) for _ in range(records)]
        return keys, [Record(incarnation, DRAM, size, int.from_bytes(os.urandom(8), "little") | 1) for _ in keys]

    async def rounds_() -> None:
        client = directory.client
        last: dict[str, bytes] = {}
        for r in range(rounds):
            for side in ("directory", "raw") if r % 2 == 0 else ("raw", "directory"):
                keys, recs = fresh()
                if side == "directory":
                    puts = [(root, k, rec) for k, rec in zip(keys, recs)]
                    t = time.perf_counter()
                    await directory.publish(puts, [])
                else:
                    items = [(directory.key(root, k), directory.value(root, k, directory.node, rec))
                             for k, rec in zip(keys, recs)]
                    t = time.perf_counter()
                    pipe = client.pipeline(transaction=False)
                    for k, v in items:
                        pipe.execute_command("HSET", k, field, v)  # the leanest call: no hset() argument handling
                    await pipe.execute()
                out[side].append(time.perf_counter() - t)
                last[side] = directory.key(root, keys[-1])
        for side, key in last.items():
            if await client.hget(key, field) is None:  # type: ignore[misc]  # redis-py's async stubs
                raise RuntimeError(f"publish ({side}): the last record is not in the directory")

    try:
        st.loop.run_until_complete(rounds_())
    finally:
        st.loop.run_until_complete(directory.close())
    return out


OPS: dict[str, Callable[..., Any]] = {
    "fill": _op_fill, "serve": _op_serve, "setup": _op_setup, "raw": _op_raw, "grpc": _op_grpc,
    "peer": _op_peer, "peer_check": _op_peer_check, "expect": _op_expect, "mooncake_serve": _op_mooncake_serve,
    "mooncake_setup": _op_mooncake_setup, "mooncake": _op_mooncake, "lookup": _op_lookup, "publish": _op_publish,
}


def agent_main() -> None:
    """Answer the driver's operations, one JSON line in, one out, until "quit" or end of input.
    Replies go to a private copy of stdout; anything a library prints goes to stderr (the log)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    st = AgentState()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            reply = {"ok": OPS[req["op"]](st, **req["args"])}
        except Exception:  # noqa: BLE001 - every failure goes back to the driver, which raises it
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
    st.close()
    replies.flush()
    os._exit(0)  # native libraries' threads (gRPC, Mooncake) must not hold the exit
