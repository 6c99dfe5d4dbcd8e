"""The peer data path's wire format: what one node sends another to fetch blocks.

A raw TCP stream, not gRPC: block bytes go from the holder's DRAM slots (one ``sendmsg`` of the
slots' memoryviews, :func:`send_all`) straight into the fetcher's slots (``sock_recv_into``), with
no message to build or parse around them (``kvstore bench cluster`` measures both ways).

    hello    fetcher -> holder   "KVP1" u16 token length, u16 node-id length, token, node id
             holder -> fetcher   "OK\\0\\0" (or the connection closes: a wrong token)
    request  fetcher -> holder   u32 n, namespace root (32 bytes), n block keys (32 bytes each)
    answer   holder -> fetcher   u32 m (the leading m <= n blocks the holder has), then m times
                                 (u64 size, u64 checksum), then the m blocks' bytes back to back

All integers little-endian. A connection carries one request at a time, any number in turn. The
fetcher knows every size before the first payload byte, so it checks them all up front and reads
each block straight into the slot it has for it.
"""

from __future__ import annotations

import asyncio
import socket
import struct

MAGIC = b"KVP1"
WELCOME = b"OK\0\0"
HELLO = struct.Struct("<4sHH")
REQUEST = struct.Struct("<I")
COUNT = struct.Struct("<I")  # blocks in the answer
ENTRY = struct.Struct("<QQ")  # size, checksum
ROOT_BYTES = KEY_BYTES = 32
MAX_TOKEN = MAX_NODE = 1024
IOV_MAX = 512  # buffers handed to one sendmsg (Linux allows 1024)


class PeerProtocolError(ConnectionError):
    """The other end sent something this format does not allow: drop the connection."""


def hello(token: str, node: str) -> bytes:
    t, n = token.encode(), node.encode()
    return HELLO.pack(MAGIC, len(t), len(n)) + t + n


def request(root: bytes, keys: list[bytes]) -> bytes:
    return REQUEST.pack(len(keys)) + root + b"".join(keys)


def answer_head(blocks: list[tuple[int, int]]) -> bytes:
    """The answer's head for blocks of these (size, checksum)."""
    return COUNT.pack(len(blocks)) + b"".join(ENTRY.pack(size, c) for size, c in blocks)


async def send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Send ``buffers`` in order, as few ``sendmsg`` calls as the socket takes (non-blocking, on the
    running loop): a run of small blocks goes in one system call, not one per block."""
    loop = asyncio.get_running_loop()
    views = [b for b in buffers if len(b)]
    i = 0
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i : i + IOV_MAX])
        except BlockingIOError:
            sent = 0
        if sent == 0:  # the send buffer is full: wait for it with the rest of this buffer
            await loop.sock_sendall(sock, views[i])
            i += 1
            continue
        while sent:
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


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
