"""The peer data path's wire format: what one node sends another to fetch blocks.

A raw TCP stream, not gRPC: block bytes go from the holder's DRAM slot (``sock_sendall`` of the
slot's memoryview) straight into the fetcher's slot (``sock_recv_into``), with no message to
build or parse around them (``kvstore bench cluster`` measures both ways).

    hello    fetcher -> holder   "KVP1" u16 token length, u16 node-id length, token, node id
             holder -> fetcher   "OK\\0\\0" (or the connection closes: a wrong token)
    request  fetcher -> holder   u32 n, namespace root (32 bytes), n block keys (32 bytes each)
    answer   holder -> fetcher   per block, in order: u8 status, u64 size, u64 checksum, then
                                 ``size`` bytes when the status is OK. The first status that is
                                 not OK ends the answer (the run is cut there).

All integers little-endian. A connection carries one request at a time, any number in turn.
"""

from __future__ import annotations

import asyncio
import socket
import struct

MAGIC = b"KVP1"
WELCOME = b"OK\0\0"
HELLO = struct.Struct("<4sHH")
REQUEST = struct.Struct("<I")
BLOCK = struct.Struct("<BQQ")  # status, size, checksum
ROOT_BYTES = KEY_BYTES = 32
OK, MISSING = 0, 1
MAX_TOKEN = MAX_NODE = 1024


class PeerProtocolError(ConnectionError):
    """The other end sent something this format does not allow: drop the connection."""


def hello(token: str, node: str) -> bytes:
    t, n = token.encode(), node.encode()
    return HELLO.pack(MAGIC, len(t), len(n)) + t + n


def request(root: bytes, keys: list[bytes]) -> bytes:
    return REQUEST.pack(len(keys)) + root + b"".join(keys)


async def recv_exactly(sock: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``sock`` (non-blocking, on the running loop); EOF first is an error."""
    loop = asyncio.get_running_loop()
    view = into
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


async def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    await recv_exactly(sock, memoryview(buf))
    return bytes(buf)
