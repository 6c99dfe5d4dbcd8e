"""The local socket's framing written out by hand, for tests that speak to the sidecar without
kvstore's own channels (half-sent frames, bad hellos, raw requests)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator


def send_frame(s: socket.socket, name: str, payload: bytes) -> None:
    body = bytes((len(name),)) + name.encode() + payload
    s.sendall(struct.pack(">I", len(body)) + body)


def recv_frame(s: socket.socket) -> tuple[int, bytes]:
    """The next frame as (status, payload); (-1, b"") once the sidecar closed the connection."""
    head = s.recv(4, socket.MSG_WAITALL)
    if not head:
        return -1, b""
    body = s.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL)
    return body[0], body[1:]


def recv_call(s: socket.socket) -> tuple[str, bytes] | None:
    """The next request frame as (method name, payload); None once the client closed."""
    status, rest = recv_frame(s)  # a request's first byte is its name's length, not a status
    if status < 0:
        return None
    return rest[:status].decode(), rest[status:]


def send_answer(s: socket.socket, status: int, payload: bytes = b"") -> None:
    body = bytes((status,)) + payload
    s.sendall(struct.pack(">I", len(body)) + body)


@contextlib.contextmanager
def raw_server(path: str, handle: Callable[[socket.socket], None]) -> Iterator[list[socket.socket]]:
    """A stand-in for a sidecar at ``path`` that misbehaves on purpose: each connection it accepts
    is handed to ``handle`` (on one thread, one connection after another) and closed when that
    returns. Yields the connections accepted so far (a call sent again shows as one more)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    accepted: list[socket.socket] = []
    closing = threading.Event()

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                if closing.is_set():
                    return
                accepted.append(conn)
                conn.settimeout(30)  # a test that goes wrong ends, never hangs
                with contextlib.suppress(OSError):
                    handle(conn)

    thread = threading.Thread(target=serve, name="raw-sidecar")
    thread.start()
    try:
        yield accepted
    finally:
        closing.set()
        with socket.socket(socket.AF_UNIX) as wake:  # accept() returns, and the thread sees closing
            wake.connect(path)
            thread.join()
        listener.close()
