"""Two hosts on this machine, one sidecar each, one cache: the cross-host prefill -> decode rig
the demo (``kvstore demo --cross-host``), the vLLM benchmark (``kvstore_xhost``) and the tests share.
Needs root (network namespaces)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from kvstore.harness.hosts import Hosts
from kvstore.harness.instance import repo_pythonpath
from kvstore.harness.servers import RedisCluster, RedisServer, redis_cluster, redis_server
from kvstore.harness.sidecar import REPO
from kvstore.util.tuning import ENV as MALLOC_ENV


class CrossHost:
    """Two separate hosts on this machine, one sidecar each, one cache: the cross-host P/D rig.

    Two network namespaces with private ``/dev/shm`` on a bridge (:class:`kvstore.harness.hosts.Hosts`),
    a ``kvstore serve`` on each (its own TOML config, gRPC/HTTP/peer ports on its host's address),
    forming one cluster through a ``redis-server`` on the bridge (the directory). With
    ``redis_tier="redis"``, that redis-server is also a Redis tier both sidecars write through to
    (``tiering.write_through = ["redis"]``); with ``redis_tier="cluster"`` a 3-master Redis Cluster on
    the bridge is both the directory and that shared tier; with ``None`` blocks move between the
    hosts only by peer fetch. A vLLM instance runs on host ``i`` with ``Instance(..., prefix=rig.nsenter(i))`` and
    reaches its sidecar at :meth:`url`. Needs root (namespaces); raises RuntimeError saying why not."""

    TOKEN = "kvstore-cross-host"

    def __init__(self, work: Path, *, redis_tier: Literal["redis", "cluster"] | None = None,
                 dram_bytes: int = 256 << 20, lease_ms: int = 3000, heartbeat_ms: int = 500) -> None:
        self._stack = contextlib.ExitStack()
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        try:
            if os.geteuid() != 0:
                raise RuntimeError("needs root: it creates network namespaces (ip netns) and mounts a /dev/shm "
                                   "per host")
            missing = [t for t in ("ip", "nsenter", "unshare") if shutil.which(t) is None]
            if missing:
                raise RuntimeError(f"needs {', '.join(missing)} (util-linux, iproute2) on PATH")
            self.hosts = self._stack.enter_context(Hosts(2, prefix="kvx"))
            bridge = self.hosts.bridge_ip
            self.redis: RedisServer | RedisCluster
            if redis_tier == "cluster":
                self.redis = self._stack.enter_context(redis_cluster(3, host=bridge))
            else:
                self.redis = self._stack.enter_context(redis_server(host=bridge))
            self.procs: list[subprocess.Popen[str]] = []
            self.ready: list[dict[str, str]] = []
            for i, name in enumerate(("a", "b")):
                self._start(i, name, redis_tier, dram_bytes, lease_ms, heartbeat_ms)
            time.sleep(2 * heartbeat_ms / 1000)  # each node has heard of the other
        except BaseException:
            self.close()
            raise

    def _start(self, i: int, name: str, redis_tier: Literal["redis", "cluster"] | None, dram_bytes: int,
               lease_ms: int, heartbeat_ms: int) -> None:
        host = self.hosts[i]
        cluster = "true" if redis_tier == "cluster" else "false"
        tier = f"""
[redis]
enabled = true
url = "{self.redis.url}"
cluster = {cluster}
key_prefix = "xhost-tier"
[tiering]
write_through = ["redis"]
""" if redis_tier else ""
        config = self.work / f"sidecar-{name}.toml"
        config.write_text(f"""data_dir = "{self.work / f"sidecar-{name}"}"
log_level = "warning"
[server]
grpc_address = "{host.ip}:0"
http_address = "{host.ip}:0"
[dram]
capacity_bytes = {dram_bytes}
[ssd]
enabled = false
[cluster]
enabled = true
directory_url = "{self.redis.url}"
directory_cluster = {cluster}
key_prefix = "xhost"
node_id = "{name}"
peer_address = "{host.ip}:0"
token = "{self.TOKEN}"
lease_ms = {lease_ms}
heartbeat_ms = {heartbeat_ms}
fetch_timeout_s = 2.0
{tier}""")
        log = (self.work / f"sidecar-{name}.log").open("a")
        self._stack.callback(log.close)
        proc: subprocess.Popen[str] = host.popen(
            [sys.executable, "-m", "kvstore", "serve", "--config", str(config)], stdout=subprocess.PIPE, stderr=log,
            text=True, cwd=REPO, env={**os.environ, **MALLOC_ENV, "PYTHONPATH": repo_pythonpath()},
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            log.flush()
            raise RuntimeError(f"sidecar {name} on {host.name} exited {proc.wait()}: "
                               f"{(self.work / f'sidecar-{name}.log').read_text()[-3000:]}")
        self.ready.append(json.loads(line))

    def url(self, i: int) -> str:
        """Host ``i``'s sidecar's gRPC address (reachable from that host; the connector then finds
        the sidecar's Unix socket and shared memory there)."""
        return self.ready[i]["grpc"]

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs)

    def nsenter(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``, in its sidecar's network and mount
        namespaces (its address, its /dev/shm)."""
        return ["nsenter", "-t", str(self.procs[i].pid), "-m", "-n", f"--wd={REPO}"]

    def stats(self, i: int) -> dict[str, Any]:
        """Host ``i``'s sidecar's ``/stats`` (over the bridge, from this namespace)."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.ready[i]['http']}/stats", timeout=10) as r:
            doc: dict[str, Any] = json.loads(r.read())
        return doc

    def cluster(self, i: int) -> dict[str, int]:
        """Host ``i``'s sidecar's cluster counters (blocks_fetched, blocks_lent, blocks_adopted, ...)."""
        return dict(self.stats(i).get("cluster", {}))

    def kill(self, i: int) -> None:
        """kill -9 host ``i``'s sidecar."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        for proc in getattr(self, "procs", []):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        self._stack.close()  # redis-server, then the hosts

    def __enter__(self) -> CrossHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
