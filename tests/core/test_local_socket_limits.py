"""The local socket's limits (kvstore.server.local_server.LocalServer): deadlines, the hello's size, the connection cap.

Each test runs a sidecar process (`kvstore serve`) and talks to its Unix socket with raw frames. A
deadline is set small in config and the test waits, with a generous socket timeout, for the
sidecar's error frame and the close; nothing is timed.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import HELLO_MAX_BYTES
from tests.core.raw_frames import recv_frame, send_frame

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
ARGS = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--dram-bytes", str(8 << 20)]
WAIT_S = 30.0  # how long a test waits for the sidecar to close a connection: far beyond any deadline set here
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 4, 8
ECHO = pb.EchoRequest(payload=b"hi").SerializeToString()
ECHOED = (0, pb.EchoResponse(payload=b"hi").SerializeToString())


def _serve(serve_process, data_dir: Path, **env: str):
    return serve_process([*ARGS, "--data-dir", str(data_dir)], env={"KVSTORE_SSD__ENABLED": "false", **env})


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(WAIT_S)
    s.connect(str(path))
    return s




def _greet(path: Path) -> tuple[socket.socket, int]:
    """A connection and the status its hello (no token) was answered with."""
    s = _connect(path)
    with contextlib.suppress(BrokenPipeError):  # refused at once: the refusal is still there to read
        send_frame(s, "", b"")
    return s, recv_frame(s)[0]


def _greeted(path: Path) -> socket.socket:
    """A connection whose hello was answered OK."""
    s, status = _greet(path)
    assert status == 0
    return s


def _refused(s: socket.socket) -> tuple[int, str]:
    """The sidecar's error frame, then the close."""
    status, msg = recv_frame(s)
    assert recv_frame(s) == (-1, b"")
    s.close()
    return status, msg.decode()


def _healthz(sc) -> dict:
    return json.loads(urllib.request.urlopen(f"http://{sc.http}/healthz", timeout=WAIT_S).read())


def test_a_connection_that_never_says_hello_is_closed(serve_process, tmp_path: Path):
    sc = _serve(serve_process, tmp_path / "d", KVSTORE_SERVER__LOCAL_HELLO_TIMEOUT_S="0.2",
                KVSTORE_SERVER__LOCAL_FRAME_TIMEOUT_S="0.2")
    path = tmp_path / "d" / "kvstore.sock"
    idle = _greeted(path)  # greeted, then idle between calls: may stay open past both deadlines
    silent, partial = _connect(path), _connect(path)
    partial.sendall(struct.pack(">I", 1)[:2])  # half a hello's length
    for s in (silent, partial):
        status, msg = _refused(s)
        assert status == DEADLINE_EXCEEDED and msg == "hello: none within 0.2 s (server.local_hello_timeout_s)"
    send_frame(idle, "Echo", ECHO)
    assert recv_frame(idle) == ECHOED
    idle.close()
    with SyncClient(sc.grpc, local=False) as c:
        assert c.stats()["errors"]["DEADLINE_EXCEEDED"] == 2


def test_a_half_sent_frame_is_closed(serve_process, tmp_path: Path):
    _serve(serve_process, tmp_path / "d", KVSTORE_SERVER__LOCAL_FRAME_TIMEOUT_S="0.2")
    path = tmp_path / "d" / "kvstore.sock"
    body = bytes((4,)) + b"Echo" + ECHO
    header, halfway = _greeted(path), _greeted(path)
    header.sendall(struct.pack(">I", len(body))[:3])
    halfway.sendall(struct.pack(">I", len(body)) + body[:3])
    for s in (header, halfway):
        status, msg = _refused(s)
        assert status == DEADLINE_EXCEEDED
        assert msg == "frame: not complete within 0.2 s (server.local_frame_timeout_s)"
    whole = _greeted(path)  # a frame sent in full is answered as before
    send_frame(whole, "Echo", ECHO)
    assert recv_frame(whole) == ECHOED


def test_a_huge_hello_is_refused_before_its_bytes_are_sent(serve_process, tmp_path: Path):
    """Only the hello's length goes out: the refusal and the close come without the 60 MiB."""
    _serve(serve_process, tmp_path / "d", KVSTORE_SERVER__AUTH_TOKEN="s3cret")
    path = tmp_path / "d" / "kvstore.sock"
    s = _connect(path)
    s.sendall(struct.pack(">I", 60 << 20))
    assert _refused(s) == (RESOURCE_EXHAUSTED, f"hello: {60 << 20} bytes, limit {HELLO_MAX_BYTES}")
    s = _connect(path)
    send_frame(s, "", b"s3cret")  # the right token in a hello of ordinary size
    assert recv_frame(s) == (0, struct.pack(">I", 64 << 20))  # OK, and server.max_message_bytes


def test_over_the_cap_new_connections_are_refused_and_the_rest_keeps_serving(serve_process, tmp_path: Path):
    sc = _serve(serve_process, tmp_path / "d", KVSTORE_SERVER__LOCAL_MAX_CONNECTIONS="3")
    path = tmp_path / "d" / "kvstore.sock"
    keys = prefix_keys(NS, list(range(16)))
    with SyncClient(sc.grpc) as first:
        assert first.lookup(NS, keys).matched == 0 and first.transport == "local"  # connection 1
        held = [_greeted(path), _greeted(path)]  # 2 and 3
        for _ in range(5):
            status, msg = _refused(_connect(path))
            assert status == RESOURCE_EXHAUSTED
            assert msg == "local socket: too many connections (3 open, server.local_max_connections)"
        with SyncClient(sc.grpc) as late:  # refused on the socket: carries on over gRPC
            assert late.lookup(NS, keys).matched == 0 and late.transport == "grpc"
        assert _healthz(sc) == {"status": "ok"}
        assert first.lookup(NS, keys).matched == 0 and first.transport == "local"  # still served
        send_frame(held[0], "Echo", ECHO)
        assert recv_frame(held[0]) == ECHOED
        assert first.stats()["errors"]["RESOURCE_EXHAUSTED"] == 6
        held.pop().close()
    again = _greeted_once_room(path)
    send_frame(again, "Echo", ECHO)
    assert recv_frame(again) == ECHOED


def _greeted_once_room(path: Path) -> socket.socket:
    """A greeted connection, once the sidecar has noticed that others closed (retried until then)."""
    for _ in range(int(WAIT_S / 0.05)):
        with contextlib.suppress(BlockingIOError):  # the listen queue is full
            s, status = _greet(path)
            if status == 0:
                return s
            s.close()
            assert status == RESOURCE_EXHAUSTED
        time.sleep(0.05)
    raise AssertionError(f"no room on {path} after {WAIT_S} s")


@contextlib.contextmanager
def _open_file_limit(soft: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE lowered to ``soft`` meanwhile: a sidecar started in it inherits it."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_a_flood_of_idle_connections_leaves_descriptors_to_grpc(serve_process, tmp_path: Path):
    """A sidecar limited to 256 open files, 600 greeted idle connections (clients that never close
    them): the cap (default 256) is held to half the limit, so gRPC, /healthz and the SSD tier still
    get descriptors, and the refusals are logged in a few lines, not one each."""
    with _open_file_limit(256):
        sc = _serve(serve_process, tmp_path / "d", KVSTORE_SSD__ENABLED="true")
    path = tmp_path / "d" / "kvstore.sock"
    keys = prefix_keys(NS, list(range(16 * 8)))
    blocks = [np.full(4096, i, np.uint8) for i in range(8)]
    with SyncClient(sc.grpc) as pooled:
        assert pooled.lookup(NS, keys).matched == 0 and pooled.transport == "local"
        flood, refused = [], 0
        for _ in range(600):
            s, status = _greet(path)
            if status == 0:
                flood.append(s)
            else:
                assert status == RESOURCE_EXHAUSTED
                refused += 1
                s.close()
        assert len(flood) == 127 and refused == 600 - 127  # 128 with the pooled client's
        with SyncClient(sc.grpc, local=False) as fresh:  # a new gRPC channel: a new descriptor
            assert fresh.put_blocks(NS, keys, blocks).stored == 8
            assert fresh.lookup(NS, keys).matched == 8
        assert _healthz(sc) == {"status": "ok"}
        assert pooled.lookup(NS, keys).matched == 8 and pooled.transport == "local"
        for s in flood:
            s.close()
    logs = sc.logs()
    assert sum("local socket" in line for line in logs.splitlines()) <= 3, logs[-4000:]


def test_out_of_descriptors_the_accept_loop_backs_off_and_recovers(serve_process, tmp_path: Path):
    """The open-file limit lowered under a running sidecar (its cap was set from the old one) and 300
    connections: accepts fail with EMFILE; the accept loop waits and says so every 10 s, not once
    per failure, and accepts again once connections close."""
    sc = _serve(serve_process, tmp_path / "d")
    path = tmp_path / "d" / "kvstore.sock"
    with SyncClient(sc.grpc, local=False) as remote:
        remote.stats()  # its channel is open before the descriptors run out
        resource.prlimit(sc.proc.pid, resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        flood = []
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):  # the listen queue is full
                s.connect(str(path))
                s.send(struct.pack(">I", 1) + b"\0")  # a hello
            flood.append(s)
        fds = Path(f"/proc/{sc.proc.pid}/fd")
        for _ in range(int(WAIT_S / 0.05)):
            if len(list(fds.iterdir())) >= 64:
                break
            time.sleep(0.05)
        time.sleep(2)  # out of descriptors meanwhile: time for a loop that retries at once to log thousands of lines
        assert "index" in remote.stats()
        lines = [line for line in sc.logs().splitlines() if "accept" in line]
        assert 1 <= len(lines) <= 2, lines[:3]  # one warning per 10 s (two if this machine is very slow)
        assert "local socket: accept failed ([Errno 24] Too many open files)" in lines[0]
        for s in flood:
            s.close()
        again = _greeted_once_room(path)
        send_frame(again, "Echo", ECHO)
        assert recv_frame(again) == ECHOED
