"""The local socket's framing written out by hand, for tests that speak to the sidecar without
kvstore's own channels (half-sent frames, bad hellos, raw requests)."""

from __future__ import annotations

import socket
import struct


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
