"""Separate "hosts" on one Linux machine, for multi-host tests (needs root and iproute2).

Each host is a network namespace joined by a veth pair to a bridge in the root namespace, all in
one free 10.X.Y.0/24: the bridge holds 10.X.Y.1 (where tests bind servers every host must reach,
such as redis) and host i holds 10.X.Y.(i+2). Commands started on a host also get a private mount
namespace with a fresh tmpfs on /dev/shm, so the only way bytes pass between hosts is the network,
and a test can cut a host's link mid-run::

    with Hosts(2) as hosts:
        server = hosts[0].popen([sys.executable, "-m", "kvstore", ...])
        hosts[1].run([...], check=True)
        hosts[0].link_down(); ...; hosts[0].link_up()

Names carry the creating pid (``kvs<pid>-a``, bridge ``kvs<pid>br``), so :func:`cleanup_stale`
can remove what a killed earlier run left behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

IFNAMSIZ = 15  # the longest interface name Linux accepts
_SETUP_TIMEOUT_S = 10.0
_instances = itertools.count()
# Runs "$@" (after $0, "sh") in a mount namespace of its own where /dev/shm is a fresh tmpfs.
_PRIVATE_SHM = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm && exec "$@"', "sh"]


def _cmd(argv: Sequence[str], check: bool = True) -> str:
    """Runs argv in the root namespace; with ``check``, a failure is a RuntimeError naming it."""
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        if not check:
            return ""
        raise RuntimeError(f"cannot create test hosts: `{' '.join(argv)}` failed: {e}") from e
    if check and res.returncode != 0:
        raise RuntimeError(
            f"cannot create test hosts: `{' '.join(argv)}` exited {res.returncode}: {res.stderr.strip()}"
        )
    return res.stdout


def _name_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}(\d+)(?:x\d+)?(?:-[a-z]|br)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def cleanup_stale(prefix: str = "kvs") -> None:
    """Deletes the namespaces, veths and bridges named by :class:`Hosts` whose pid no longer runs."""
    pattern = _name_re(prefix)
    for line in _cmd(["ip", "netns", "list"], check=False).splitlines():
        name = line.split(" ", 1)[0]
        m = pattern.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _cmd(["ip", "netns", "delete", name], check=False)
    for line in _cmd(["ip", "-o", "link", "show"], check=False).splitlines():
        parts = line.split(": ", 2)
        name = parts[1].split("@", 1)[0] if len(parts) > 1 else ""
        m = pattern.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _cmd(["ip", "link", "delete", name], check=False)


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network an address or route on this machine covers (the default route aside)."""
    out: list[ipaddress.IPv4Network] = []
    for line in _cmd(["ip", "-4", "-o", "addr", "show"]).splitlines():
        m = re.search(r"\binet (\S+)", line)
        if m:
            out.append(ipaddress.IPv4Network(m.group(1), strict=False))
    for line in _cmd(["ip", "-4", "route", "show", "table", "all"]).splitlines():
        tokens = line.split()  # "[type] destination ...": the destination is the first address
        if "default" in tokens[:2]:
            continue
        for token in tokens[:2]:
            with contextlib.suppress(ValueError):
                out.append(ipaddress.IPv4Network(token, strict=False))
                break
    return [n for n in out if n.prefixlen > 0]


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    used = _used_networks()
    for i in range(1 << 16):
        k = (seed + i) % (1 << 16)
        net = ipaddress.IPv4Network(f"10.{k >> 8}.{k & 255}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("cannot create test hosts: every 10.X.Y.0/24 is already in use on this machine")


class Host:
    """One namespace: ``name`` (the netns), ``ip`` and ``veth`` (the root-side end of its link)."""

    def __init__(self, name: str, ip: str, veth: str, started: list[subprocess.Popen[Any]]) -> None:
        self.name = name
        self.ip = ip
        self.veth = veth
        self._started = started

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.ip!r})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """The command line that runs argv in this host's namespaces."""
        return ["ip", "netns", "exec", self.name, *_PRIVATE_SHM, *argv]

    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Starts argv on this host; each wrapper execs the next, so the pid is argv's own.
        :meth:`Hosts.close` stops it if it still runs then."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.argv(argv), **popen_kwargs)
        self._started.append(proc)
        return proc

    def run(self, argv: Sequence[str], **run_kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Runs argv on this host to completion (``subprocess.run``'s keywords pass through)."""
        return subprocess.run(self.argv(argv), **run_kwargs)

    def link_down(self) -> None:
        """Cuts the host's cable: the root-side veth goes down, so nothing reaches or leaves the host
        (connections time out; inside, the interface stays configured)."""
        _cmd(["ip", "link", "set", self.veth, "down"])

    def link_up(self) -> None:
        """Plugs the cable back in and waits until the link carries traffic again."""
        _cmd(["ip", "link", "set", self.veth, "up"])
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), open(f"/sys/class/net/{self.veth}/operstate") as f:
                if f.read().strip() == "up":
                    return
            time.sleep(0.01)


class Hosts:
    """``n`` hosts on one bridge (see the module docstring); a context manager, or call :meth:`close`."""

    def __init__(self, n: int, prefix: str | None = None) -> None:
        if not 1 <= n <= 26:
            raise ValueError(f"Hosts(n) takes 1..26 hosts, not {n}")
        prefix = "kvs" if prefix is None else prefix
        if not re.fullmatch(r"[a-z]+", prefix):
            raise ValueError(f"prefix {prefix!r} must be lowercase letters (the pid follows it in every name)")
        k = next(_instances)
        tag = f"{prefix}{os.getpid()}" + (f"x{k}" if k else "")
        self.bridge = f"{tag}br"
        if len(self.bridge) > IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} makes interface names longer than {IFNAMSIZ} characters")
        self.hosts: list[Host] = []
        self._started: list[subprocess.Popen[Any]] = []
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._closed = False
        try:
            cleanup_stale(prefix)
            self.subnet = _free_subnet(os.getpid() * 97 + k)
            base = self.subnet.network_address
            self.bridge_ip = str(base + 1)
            self._make("link", self.bridge, f"ip link add name {self.bridge} type bridge stp_state 0 forward_delay 0")
            _cmd(f"ip addr add {self.bridge_ip}/24 dev {self.bridge}".split())
            _cmd(f"ip link set {self.bridge} up".split())
            for i in range(n):
                name = f"{tag}-{chr(ord('a') + i)}"
                host = Host(name, str(base + i + 2), name, self._started)
                self._make("netns", name, f"ip netns add {name}")
                self._make("link", name, f"ip link add {name} type veth peer name eth0 netns {name}")
                _cmd(f"ip link set {name} master {self.bridge} up".split())
                for step in ("link set lo up", f"addr add {host.ip}/24 dev eth0", "link set eth0 up"):
                    _cmd(f"ip -n {name} {step}".split())
                self.hosts.append(host)
            self._check_traffic()
        except BaseException:
            self.close()
            raise

    def _make(self, kind: str, name: str, command: str) -> None:
        _cmd(command.split())
        self._made.append((kind, name))

    def _check_traffic(self) -> None:
        """TCP to host 0 from the root namespace and from the last host must work. If it does not and
        bridged frames go through iptables (br_netfilter), that is switched off (machine-wide) and retried."""
        nf = "/proc/sys/net/bridge/bridge-nf-call-iptables"
        if self._traffic_flows():
            return
        if os.path.exists(nf):
            with open(nf, "w") as f:
                f.write("0")
            if self._traffic_flows():
                return
        raise RuntimeError(f"cannot create test hosts: no TCP traffic over bridge {self.bridge} ({self.subnet})")

    def _traffic_flows(self) -> bool:
        first, last = self.hosts[0], self.hosts[-1]
        serve = (
            f"import socket; s = socket.create_server(({first.ip!r}, 7)); print(flush=True); s.settimeout(5)\n"
            f"for _ in range({1 if len(self.hosts) == 1 else 2}): s.accept()[0].close()"
        )
        connect = f"import socket; socket.create_connection(({first.ip!r}, 7), timeout=2).close()"
        argv = ["ip", "netns", "exec", first.name, sys.executable, "-S", "-c", serve]
        server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            if server.stdout is None or not server.stdout.readline():
                return False
            socket.create_connection((first.ip, 7), timeout=2).close()
            if last is not first:
                argv = ["ip", "netns", "exec", last.name, sys.executable, "-S", "-c", connect]
                if subprocess.run(argv, capture_output=True, timeout=5).returncode != 0:
                    return False
            return server.wait(timeout=5) == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            if server.stdout is not None:
                server.stdout.close()

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def host(self, i: int) -> Host:
        return self.hosts[i]

    def close(self) -> None:
        """Stops the processes :meth:`Host.popen` started that still run, then deletes the
        namespaces, veths and bridge. Idempotent; whatever is already gone is skipped."""
        if self._closed:
            return
        self._closed = True
        for proc in self._started:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._started:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for kind, name in reversed(self._made):
            _cmd(["ip", kind, "delete", name], check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
