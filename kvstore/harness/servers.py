"""Real servers on free loopback ports, for tests and benchmarks.

Each helper is a context manager yielding a handle with ``url``/``port`` and ``stop()`` /
``start()`` (restart on the same port), so tests can inject faults::

    with redis_server() as r:          # redis-server --save "" --appendonly no
        r.stop(); ...; r.start()
    with redis_cluster(n=3) as c:      # 3 masters, no replicas, waits for cluster_state:ok
        c.url, c.ports
    with moto_server() as s3:          # python -m moto.server as a subprocess
        s3.url

Nothing here talks to the system Redis on 6379: every port is one :func:`free_port` found free.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
START_TIMEOUT_S = 30.0

# Credentials moto accepts; exported so tests and benchmarks build clients the same way.
MOTO_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port that is free right now, taken below the kernel's ephemeral range and
    never the same twice in one process. A port from ``bind(0)`` comes from the ephemeral range,
    where the kernel also places the local end of every outgoing connection (cluster nodes
    talking to each other, clients of moto and Redis): between the pick and the server's own
    bind, such a connection can take it ("Address already in use"). Below that range only an
    explicit bind can."""
    top = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(max(1024, top - 12000), top)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port found below {top}")


def _wait(
    predicate: Callable[[], bool],
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.05)
    _kill(proc)  # never leave a half-started server behind
    raise TimeoutError(f"{what}: not ready after {timeout}s")


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    proc.wait(timeout=10)


def _redis_cli(port: int, *args: str, host: str = "127.0.0.1") -> str:
    out = subprocess.run(
        [REDIS_CLI, "-h", host, "-p", str(port), *args],
        capture_output=True, text=True, timeout=30, check=False,
    )
    return out.stdout


@dataclass
class RedisServer:
    """One redis-server process (no persistence) on a fixed loopback port."""

    port: int
    workdir: Path
    extra_args: Sequence[str] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    host: str = "127.0.0.1"  # another address of this machine: a test host's bridge (kvstore.harness.hosts)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def _auth(self) -> list[str]:
        """redis-cli's password option when the server was started with ``--requirepass``."""
        args = list(self.extra_args)
        if "--requirepass" in args:
            return ["-a", args[args.index("--requirepass") + 1], "--no-auth-warning"]
        return []

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", self.host, "--protected-mode", "no",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir), "--logfile", "",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(lambda: self.cli("PING").strip() == "PONG", f"redis-server :{self.port}", self.proc)

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, not a clean shutdown)."""
        _kill(self.proc)
        self.proc = None

    def cli(self, *args: str) -> str:
        return _redis_cli(self.port, *self._auth, *args, host=self.host)


@contextlib.contextmanager
def redis_server(*extra_args: str, host: str = "127.0.0.1") -> Iterator[RedisServer]:
    """A single-node Redis on a free port; ``extra_args`` go to redis-server (e.g. --maxmemory)."""
    with tempfile.TemporaryDirectory(prefix="kvstore-redis-") as d:
        server = RedisServer(free_port(), Path(d), extra_args, host=host)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@dataclass
class RedisCluster:
    """``n`` Redis masters forming one cluster (no replicas)."""

    nodes: list[RedisServer]

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def state_ok(self) -> bool:
        return all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def start(self) -> None:
        """Restart the nodes (they keep their nodes.conf, so the cluster re-forms)."""
        for n in self.nodes:
            n.start()
        _wait(self.state_ok, "redis cluster state")


@contextlib.contextmanager
def redis_cluster(n: int = 3, host: str = "127.0.0.1") -> Iterator[RedisCluster]:
    with tempfile.TemporaryDirectory(prefix="kvstore-cluster-") as d:
        nodes = []
        for i in range(n):
            port, bus = free_port(), free_port()
            workdir = Path(d) / str(i)
            workdir.mkdir()
            nodes.append(RedisServer(port, workdir, (
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(bus), "--cluster-node-timeout", "5000",
            ), host=host))
        cluster = RedisCluster(nodes)
        try:
            for node in nodes:
                node.start()
            out = subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(f"{host}:{p}" for p in cluster.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60, check=False,
            )
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
            _wait(cluster.state_ok, "redis cluster state")
            yield cluster
        finally:
            cluster.stop()


@dataclass
class MotoServer:
    """moto's S3-compatible HTTP server as a subprocess (state is in memory: lost on stop)."""

    port: int
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1) as resp:
            return int(resp.status) == 200

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        env = {**os.environ, **{k.upper(): v for k, v in MOTO_CREDENTIALS.items()}}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
        _wait(self._ready, f"moto server :{self.port}", self.proc)

    def stop(self) -> None:
        _kill(self.proc)
        self.proc = None

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass


@contextlib.contextmanager
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()
