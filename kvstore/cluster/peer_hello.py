"""The peer data path's hello: each side proves it holds the cluster token without sending it.

    fetcher -> holder   "KVP2" u16 name length, nonce (16 random bytes), the fetcher's node id
    holder -> fetcher   "KVP2" u16 name length, nonce (16 random bytes), the holder's node id,
                        proof (32) = HMAC(hello key, "holder", both nonces, both names)
    fetcher -> holder   proof (32) = HMAC(hello key, "fetcher", both nonces, both names)
                        (only once the holder's proof checked out, and the holder is the node the
                        fetcher meant: otherwise the fetcher closes and sends nothing more)
    holder -> fetcher   "OK\\0\\0" (or the connection closes: a wrong proof)

The hello key is derived from the token (:class:`~kvstore.cluster.cluster_key.ClusterKey`); the
proofs are compared in constant time (:func:`~kvstore.util.tokens.token_matches`). Fresh nonces
on both sides make every proof good for one connection only: a recorded hello replays nowhere.
Nothing the fetcher sends before the holder proved itself says more than the fetcher's name (a
listener that is not a node learns no token and no namespace root: requests come after the hello).
A version 1 peer ("KVP1", the token in clear) is told nothing and closed.

Both sides then hold the connection's own key (:class:`~kvstore.cluster.cluster_key.Session`,
from the same nonces and names): every request and every answer's head after the hello carries
its MAC (:mod:`kvstore.wire.peer`). A party on the path (or at an address a member entry
names) that relays one node's hello to another can then read what passes, and cut or delay it,
but not send a request of its own nor change what an answer announces. What it reads is in the
clear (no TLS on this path): see docs/security.md.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct

from kvstore.cluster.cluster_key import NONCE_BYTES, PROOF_BYTES, ClusterKey, Session
from kvstore.util.tokens import token_matches
from kvstore.wire import peer as w

MAGIC = b"KVP2"
GREETING = struct.Struct("<4sH")  # magic, name length (then the nonce and the name)
MAX_NODE = 1024
HOLDER, FETCHER = b"holder", b"fetcher"  # whose proof


class HelloRefused(w.PeerProtocolError):
    """The other end did not prove it holds the cluster token (or is not the node meant)."""


def opening(name: str, nonce: bytes) -> bytes:
    """The first bytes a side sends: the magic, its nonce and its name."""
    n = name.encode()
    return GREETING.pack(MAGIC, len(n)) + nonce + n


async def _their_opening(sock: socket.socket) -> tuple[bytes, bytes]:
    """The other side's nonce and name."""
    magic, n = GREETING.unpack(await w.recv_bytes(sock, GREETING.size))
    if magic != MAGIC or n > MAX_NODE:
        raise w.PeerProtocolError(f"not a kvstore peer hello ({magic!r}, a name of {n} bytes)")
    rest = await w.recv_bytes(sock, NONCE_BYTES + n)
    return rest[:NONCE_BYTES], rest[NONCE_BYTES:]


async def greet(sock: socket.socket, key: ClusterKey, me: str, holder: str) -> Session:
    """The fetcher's side, on a connected non-blocking ``sock``: the connection's key, once both
    sides proved themselves; raises :class:`HelloRefused` when ``holder`` did not (or is another
    node)."""
    loop = asyncio.get_running_loop()
    mine, name = os.urandom(NONCE_BYTES), me.encode()
    await loop.sock_sendall(sock, opening(me, mine))
    theirs, their_name = await _their_opening(sock)
    proof = await w.recv_bytes(sock, PROOF_BYTES)
    if their_name != holder.encode():
        raise HelloRefused(f"the node at this address says it is {their_name[:64]!r}, not {holder[:64]!r}")
    if not token_matches(proof, key.proof(HOLDER, mine, theirs, name, their_name)):
        raise HelloRefused(f"{holder[:64]!r} did not prove it holds the cluster token")
    await loop.sock_sendall(sock, key.proof(FETCHER, mine, theirs, name, their_name))
    if await w.recv_bytes(sock, len(w.WELCOME)) != w.WELCOME:
        raise w.PeerProtocolError("the holder did not welcome us")
    return key.session(mine, theirs, name, their_name)


async def welcome(sock: socket.socket, key: ClusterKey, me: str) -> tuple[str, Session]:
    """The holder's side, on a connected non-blocking ``sock``: the fetcher's name and the
    connection's key once it proved itself (and was welcomed); raises :class:`HelloRefused` when
    its proof was wrong (nothing more is sent)."""
    loop = asyncio.get_running_loop()
    theirs, their_name = await _their_opening(sock)
    mine, name = os.urandom(NONCE_BYTES), me.encode()
    await loop.sock_sendall(sock, opening(me, mine) + key.proof(HOLDER, theirs, mine, their_name, name))
    proof = await w.recv_bytes(sock, PROOF_BYTES)
    shown = their_name.decode(errors="replace")
    if not token_matches(proof, key.proof(FETCHER, theirs, mine, their_name, name)):
        raise HelloRefused(f"a peer calling itself {shown[:64]!r} did not prove it holds the cluster token")
    await loop.sock_sendall(sock, w.WELCOME)
    return shown, key.session(theirs, mine, their_name, name)
