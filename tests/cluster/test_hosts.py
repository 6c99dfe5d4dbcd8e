"""kvstore.harness.hosts with real namespaces: hosts reach each other and the root namespace over the
bridge, /dev/shm is private to each host, a cut link stops traffic, and close() leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvstore.harness.hosts import Hosts, cleanup_stale

PORT = 7070
# Echoes one message per connection until killed; prints "ready" once listening.
SERVER = f"""
import socket, sys
s = socket.create_server((sys.argv[1], {PORT}))
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(64))
    c.close()
"""
# Exit 0: echoed; 3: connect timed out; 4: any other error.
CLIENT = f"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], {PORT}), timeout=float(sys.argv[2])) as c:
        c.sendall(b"ping")
        sys.exit(0 if c.recv(64) == b"ping" else 4)
except TimeoutError:
    sys.exit(3)
except OSError as e:
    print(e, file=sys.stderr)
    sys.exit(4)
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with Hosts(2) as h:
        yield h


@pytest.fixture(scope="module")
def server(hosts: Hosts) -> Iterator[subprocess.Popen[str]]:
    proc = hosts[0].popen([sys.executable, "-c", SERVER, hosts[0].ip], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()
    proc.stdout.close()


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def connect_from(hosts: Hosts, i: int, timeout: float = 2.0) -> int:
    res = hosts[i].run([sys.executable, "-c", CLIENT, hosts[0].ip, str(timeout)], timeout=timeout + 10)
    return res.returncode


def test_addresses(hosts: Hosts) -> None:
    assert hosts.bridge_ip.endswith(".1")
    assert [h.ip for h in hosts.hosts] == [hosts.bridge_ip[:-1] + "2", hosts.bridge_ip[:-1] + "3"]
    assert hosts.host(1) is hosts[1]
    assert all(len(h.name) <= 15 for h in hosts.hosts)


def test_tcp_between_hosts_and_from_root(hosts: Hosts, server: subprocess.Popen[str]) -> None:
    assert connect_from(hosts, 1) == 0
    with socket.create_connection((hosts[0].ip, PORT), timeout=2) as c:
        c.sendall(b"ping")
        assert c.recv(64) == b"ping"


def test_dev_shm_is_private(hosts: Hosts) -> None:
    name = f"kvs-hosts-test-{os.getpid()}"
    writer = hosts[0].popen(
        ["sh", "-c", f"echo hi > /dev/shm/{name} && cat /dev/shm/{name} && exec sleep 30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "hi"  # the file exists where it was written
        seen = hosts[1].run(["ls", "-a", "/dev/shm"], capture_output=True, text=True, check=True, timeout=10)
        assert name not in seen.stdout.split()
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        writer.kill()
        writer.wait()
        if writer.stdout is not None:
            writer.stdout.close()


def test_link_down_cuts_traffic_and_link_up_restores_it(hosts: Hosts, server: subprocess.Popen[str]) -> None:
    assert connect_from(hosts, 1) == 0
    hosts[0].link_down()
    try:
        assert connect_from(hosts, 1, timeout=0.5) == 3
    finally:
        hosts[0].link_up()
    assert connect_from(hosts, 1) == 0


def test_close_removes_everything() -> None:
    h = Hosts(2)
    names = {x.name for x in h.hosts}
    assert names <= netns_names()
    assert all(link_exists(n) for n in [h.bridge, *names])
    h.close()
    assert not names & netns_names()
    assert not any(link_exists(n) for n in [h.bridge, *names])
    h.close()  # idempotent


def test_cleanup_stale_removes_what_a_killed_run_left() -> None:
    code = "import time; from kvstore.harness.hosts import Hosts; h = Hosts(1); print(h[0].name, h.bridge, flush=True)"
    code += "; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    netns, bridge = child.stdout.readline().split()
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert netns in netns_names() and link_exists(bridge)  # killed: nothing was closed
    cleanup_stale()
    assert netns not in netns_names()
    assert not link_exists(bridge) and not link_exists(netns)
