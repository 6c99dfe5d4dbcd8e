"""The peer data path's hello: each side proves it holds the cluster token without sending it, and
the holder proves which incarnation of its node answers.

    fetcher -> holder   "KVP5" u16 name length, u8 flags, nonce (16 random bytes), the fetcher's node id
    holder -> fetcher   "KVP5" u16 name length, u8 flags, nonce (16 random bytes), the holder's node id,
                        u64 its incarnation,
                        proof (32) = HMAC(hello key, "holder", both nonces, both names, incarnation,
                        the holder's address, both flags)
    fetcher -> holder   proof (32) = HMAC(hello key, "fetcher", the same)
                        (only once the holder's proof checked out, and the holder is the node, the
                        incarnation and the address the fetcher meant: otherwise the fetcher closes
                        and sends nothing more)
    holder -> fetcher   "OK\\0\\0" (or the connection closes: a wrong proof)

The hello key is derived from the token (:class:`~kvstore.cluster.cluster_key.ClusterKey`); the
proofs are compared in constant time (:func:`~kvstore.util.tokens.token_matches`). Fresh nonces
on both sides make every proof good for one connection only: a recorded hello replays nowhere.
Nothing the fetcher sends before the holder proved itself says more than the fetcher's name (a
listener that is not a node learns no token and no namespace root: requests come after the hello).

The incarnation and the address: a fetcher dials the address of a member entry (sealed whole with
the entry's incarnation and expiry, :class:`~kvstore.cluster.cluster_key.ClusterKey`) to read
records of that incarnation, and talks only to that incarnation at that address. The address is
not sent: the holder's proof covers the one its own member entry names (``cluster.advertise_address``
or its listener's), the fetcher's check the one it dialled. A directory writer who puts back a
node's entry of a past life (its old address) and relays that address to where the node lives now
gets the node's current incarnation in the hello, and, were that the same (a clock stepped back
at a restart; a directory writer cannot move an incarnation, :meth:`kvstore.cluster.directory.Directory.heartbeat`),
a proof for the node's new address: either way the fetcher closes before it sends a request.

Flags: bit 0, :data:`ENCRYPT`, the side's ``cluster.peer_encryption``. The connection is
encrypted when either side set it (:mod:`kvstore.cluster.peer_frames`); both flags are under both
proofs, so a party on the path cannot clear one. Other bits: not a hello of this version (closed).

A peer of another version ("KVP1", the token in clear; "KVP2", no incarnation; "KVP3", answers
without the holder's retention; "KVP4", answer entries without a codec) is told nothing and
closed: old and new versions miss each other (docs/cluster.md, "Rolling updates").

Both sides then hold the connection's own key (:class:`~kvstore.cluster.cluster_key.Session`,
from the same nonces, names and incarnation): every request and every answer's head after the
hello carries its MAC (:mod:`kvstore.wire.peer`), or, encrypted, is sealed whole
(:mod:`kvstore.cluster.peer_frames`). A party on the path that relays one node's hello to another
can then cut or delay what passes, but not send a request of its own nor change what an answer
announces; it reads what passes only where neither side has ``cluster.peer_encryption`` on: see
docs/security.md.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct

from kvstore.cluster.cluster_key import NONCE_BYTES, PROOF_BYTES, ClusterKey, HelloTranscript, Session
from kvstore.util.tokens import token_matches
from kvstore.wire import peer as w

MAGIC = b"KVP5"  # 5: each entry of an answer names its bytes' codec (kvstore.wire.peer); 4: retention
GREETING = struct.Struct("<4sHB")  # magic, name length, flags (then the nonce and the name)
ENCRYPT = 1  # a flag: this side wants the connection encrypted
INCARNATION = struct.Struct("<Q")  # the holder's, after its name
MAX_NODE = 1024
HOLDER, FETCHER = b"holder", b"fetcher"  # whose proof


class HelloRefused(w.PeerProtocolError):
    """The other end did not prove it holds the cluster token (or is not the node meant)."""


def opening(name: str, nonce: bytes, flags: int = 0) -> bytes:
    """The first bytes a side sends: the magic, its flags, its nonce and its name."""
    n = name.encode()
    return GREETING.pack(MAGIC, len(n), flags) + nonce + n


async def _their_opening(sock: socket.socket) -> tuple[bytes, bytes, int]:
    """The other side's nonce, name and flags."""
    magic, n, flags = GREETING.unpack(await w.recv_bytes(sock, GREETING.size))
    if magic != MAGIC or n > MAX_NODE or flags & ~ENCRYPT:
        raise w.PeerProtocolError(f"not a kvstore peer hello ({magic!r}, a name of {n} bytes, flags {flags:#x})")
    rest = await w.recv_bytes(sock, NONCE_BYTES + n)
    return rest[:NONCE_BYTES], rest[NONCE_BYTES:], flags


def _flags(encrypt: bool) -> int:
    return ENCRYPT if encrypt else 0


async def greet(
    sock: socket.socket,
    key: ClusterKey,
    me: str,
    holder: str,
    incarnation: int,
    address: str,
    encrypt: bool = False,
) -> Session:
    """The fetcher's side, on a connected non-blocking ``sock`` (dialled at ``address``, the holder's
    member entry's): the connection's key (encrypted when this side asks, ``encrypt``, or the holder
    does), once both sides proved themselves; raises :class:`HelloRefused` when ``holder`` did not
    (or is another node, or another ``incarnation`` of it, or lives at another address)."""
    loop = asyncio.get_running_loop()
    mine, name, my_flags, at = os.urandom(NONCE_BYTES), me.encode(), _flags(encrypt), address.encode()
    await loop.sock_sendall(sock, opening(me, mine, my_flags))
    theirs, their_name, their_flags = await _their_opening(sock)
    flags = bytes([my_flags, their_flags])
    rest = await w.recv_bytes(sock, INCARNATION.size + PROOF_BYTES)
    (theirs_is,), proof = INCARNATION.unpack_from(rest), rest[INCARNATION.size :]
    if their_name != holder.encode():
        raise HelloRefused(f"the node at this address says it is {their_name[:64]!r}, not {holder[:64]!r}")
    hello = HelloTranscript(mine, theirs, name, their_name, theirs_is, at, flags)
    if not token_matches(proof, key.proof(HOLDER, hello)):
        raise HelloRefused(
            f"{holder[:64]!r} did not prove it holds the cluster token and lives at {address[:64]!r} (another "
            "token, or a relay from an address the node left)"
        )
    if theirs_is != incarnation:
        raise HelloRefused(
            f"{holder[:64]!r} at this address is incarnation {theirs_is}, not {incarnation}, which its member "
            "entry names (another life of the node: a member entry put back, or the node restarted since)"
        )
    await loop.sock_sendall(sock, key.proof(FETCHER, hello))  # (theirs_is is incarnation now)
    if await w.recv_bytes(sock, len(w.WELCOME)) != w.WELCOME:
        raise w.PeerProtocolError("the holder did not welcome us")
    encrypted = bool((my_flags | their_flags) & ENCRYPT)
    return key.session(hello, encrypted)


async def welcome(
    sock: socket.socket, key: ClusterKey, me: str, incarnation: int, address: str, encrypt: bool = False
) -> tuple[str, Session]:
    """The holder's side, on a connected non-blocking ``sock``, as this node's ``incarnation`` at
    ``address`` (the one its member entry names): the fetcher's name and the connection's key
    (encrypted when either side asks) once it proved itself (and was welcomed); raises
    :class:`HelloRefused` when its proof was wrong (nothing more is sent)."""
    loop = asyncio.get_running_loop()
    theirs, their_name, their_flags = await _their_opening(sock)
    mine, name, my_flags, at = os.urandom(NONCE_BYTES), me.encode(), _flags(encrypt), address.encode()
    flags = bytes([their_flags, my_flags])
    hello = HelloTranscript(theirs, mine, their_name, name, incarnation, at, flags)
    proof = key.proof(HOLDER, hello)
    await loop.sock_sendall(sock, opening(me, mine, my_flags) + INCARNATION.pack(incarnation) + proof)
    proof = await w.recv_bytes(sock, PROOF_BYTES)
    shown = their_name.decode(errors="replace")
    if not token_matches(proof, key.proof(FETCHER, hello)):
        raise HelloRefused(f"a peer calling itself {shown[:64]!r} did not prove it holds the cluster token")
    await loop.sock_sendall(sock, w.WELCOME)
    encrypted = bool((my_flags | their_flags) & ENCRYPT)
    return shown, key.session(hello, encrypted)
