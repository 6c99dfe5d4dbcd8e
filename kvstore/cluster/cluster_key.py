"""The keys derived from the cluster token, and what each authenticates.

The token (``cluster.token``) never leaves the process, and is never used as a key itself: three
keys are derived from it with HKDF-SHA256 (RFC 5869; salt :data:`LABEL`, one info string per use),
so a MAC of one kind can never pass for another:

- **Directory records** (the values of the ``d:`` hashes): a keyed BLAKE2b-128 MAC over the
  record's fields, the directory key it lies under (prefix, namespace root, block key) and the node
  it names (the hash field). A record moved to another key or another node's field, or with any
  field changed, fails it; a record of an older version (no MAC) is not one this version reads.
- **Member entries** (the ``members`` hash): the same MAC over the prefix, the node's name, its
  address, its incarnation and its lease's expiry, the whole entry
  (``2.<mac hex>@<host:port>|<incarnation>|<expiry ms>``; :data:`MEMBER_VERSION` first, under a key
  of its own, so an entry of an older version, whose MAC covered the address only, is not read).
  The node writes the whole entry; the directory's script writes it only when the incarnation is
  the one it decides and the expiry one it allows (:data:`kvstore.cluster.directory.HEARTBEAT`). A
  directory writer can put back an entry a node wrote, never another address, incarnation or expiry
  beside it.
- **The peer hello's proofs** (:mod:`kvstore.cluster.peer_hello`): HMAC-SHA256 over both sides'
  nonces and names, the holder's incarnation and its address (as its member entry names it), one
  role label for the holder's proof and another for the fetcher's; and, from the same inputs, the
  connection's own key (:class:`Session`), which seals each request and each answer's head on it,
  so a party that relayed the hello can neither send a request of its own on the connection nor
  change the sizes and checksums an answer announces.

Keyed BLAKE2b rather than HMAC-SHA256 for the records: a lookup checks one MAC per holder of every
key, and BLAKE2b's keyed mode (a MAC by design) costs about a third of HMAC's call here.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

LABEL = b"kvstore cluster key v1"  # HKDF's salt: the version of this derivation
MAC_BYTES = 16
NONCE_BYTES = 16
PROOF_BYTES = 32
MEMBER_VERSION = "2."  # the first characters of a member entry sealed whole (an older one has a bare MAC)
RECORD_VERSION = b"\x02"  # the first byte of an authenticated record (an older one has no version byte)
_LEN = struct.Struct("<H")


def hkdf(token: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``token`` with salt :data:`LABEL`: one 32-byte key for ``info``."""
    prk = hmac.digest(LABEL, token, "sha256")
    return hmac.digest(prk, info + b"\x01", "sha256")


def framed(*parts: bytes) -> bytes:
    """``parts`` each after its length: no two lists of parts give the same bytes."""
    return b"".join([_LEN.pack(len(p)) + p for p in parts])


def frame(part: bytes) -> bytes:
    """``framed(part)``, without the call's overhead (a lookup frames a key and a node per record)."""
    return _LEN.pack(len(part)) + part


@dataclass(frozen=True, slots=True)
class HelloTranscript:
    """What one peer hello said, which both proofs and the connection's key are bound to: both
    nonces, both names, the holder's incarnation and address (its member entry's), and the flags
    both sides said (the fetcher's, the holder's: one byte each)."""

    fetcher_nonce: bytes
    holder_nonce: bytes
    fetcher: bytes
    holder: bytes
    incarnation: int
    address: bytes
    flags: bytes

    def framed(self, role: bytes) -> bytes:
        """The bytes a side's proof (``role``: whose proof it is) is the MAC of."""
        life = self.incarnation.to_bytes(8, "little")
        return framed(role, self.fetcher_nonce, self.holder_nonce, self.fetcher, self.holder, life, self.address,
                      self.flags)


class ClusterKey:
    """What a node holding the cluster token can sign and check. Built once per node."""

    def __init__(self, token: str) -> None:
        secret = token.encode("utf-8", "surrogateescape")
        self._record = hkdf(secret, b"directory record")
        self._member = hkdf(secret, b"member entry v2")  # (v1's key sealed the address only)
        self._hello = hkdf(secret, b"peer hello")

    # --- directory records ----------------------------------------------------------------------

    def seal_record(self, fields: bytes, dir_key: bytes, node: bytes) -> bytes:
        """The directory value of a record's packed ``fields``, under ``dir_key`` in ``node``'s field."""
        mac = hashlib.blake2b(fields + framed(dir_key, node), key=self._record, digest_size=MAC_BYTES).digest()
        return RECORD_VERSION + fields + mac

    def open_record(self, value: bytes, dir_key: bytes, node: bytes) -> bytes | None:
        """The packed fields of a directory value sealed by :meth:`seal_record` for this key and
        node; None when it was not (forged, moved, altered, or of an older version)."""
        return self.open_framed(value, framed(dir_key, node))

    def open_framed(self, value: bytes, where: bytes) -> bytes | None:
        """:meth:`open_record` with the key and node already framed (``framed(dir_key, node)``: a
        lookup frames each key once, not once per holder, and pays about half per record)."""
        if len(value) <= 1 + MAC_BYTES or value[:1] != RECORD_VERSION:
            return None
        fields, mac = value[1:-MAC_BYTES], value[-MAC_BYTES:]
        want = hashlib.blake2b(fields + where, key=self._record, digest_size=MAC_BYTES).digest()
        return fields if hmac.compare_digest(mac, want) else None

    # --- member entries -------------------------------------------------------------------------

    def _member_mac(self, prefix: str, node: str, address: str, incarnation: int, expiry_ms: int) -> str:
        msg = framed(prefix.encode(), node.encode(), address.encode(), b"%d" % incarnation, b"%d" % expiry_ms)
        return hashlib.blake2b(msg, key=self._member, digest_size=MAC_BYTES).hexdigest()

    def seal_member(self, prefix: str, node: str, address: str, incarnation: int, expiry_ms: int) -> str:
        """``node``'s whole member entry: ``2.<mac hex>@<address>|<incarnation>|<expiry_ms>``."""
        mac = self._member_mac(prefix, node, address, incarnation, expiry_ms)
        return f"{MEMBER_VERSION}{mac}@{address}|{incarnation}|{expiry_ms}"

    def open_member(self, prefix: str, node: str, sealed: str, incarnation: int, expiry_ms: int) -> str | None:
        """The address of a member entry whose address part is ``sealed`` (``2.<mac hex>@<address>``)
        and whose incarnation and expiry are these; None when :meth:`seal_member` did not seal these
        together for this prefix and node (forged, moved to another node's name, one part changed or
        taken from another entry, or of an older version)."""
        version, mac, address = sealed[:2], sealed[2 : 2 + 2 * MAC_BYTES], sealed[3 + 2 * MAC_BYTES :]
        if version != MEMBER_VERSION or sealed[2 + 2 * MAC_BYTES : 3 + 2 * MAC_BYTES] != "@":
            return None
        want = self._member_mac(prefix, node, address, incarnation, expiry_ms)
        return address if hmac.compare_digest(mac.encode(), want.encode()) else None

    # --- the peer hello -------------------------------------------------------------------------

    def proof(self, role: bytes, hello: HelloTranscript) -> bytes:
        """A side's proof that it holds the token, for one ``hello`` (``role``: whose proof it is)."""
        return hmac.digest(self._hello, hello.framed(role), "sha256")

    def session(self, hello: HelloTranscript, encrypted: bool) -> Session:
        """The key of the connection that said ``hello``; ``encrypted``: whether its exchanges are
        sealed (:mod:`kvstore.cluster.peer_frames`)."""
        return Session(self.proof(SESSION, hello), encrypted)


SESSION = b"session"  # (a role of its own: the session key is never a proof either side sent)


class Session:
    """One peer connection's key, agreed in its hello: the MAC of each request (``b"request"``)
    and of each answer's head (``b"answer"``), numbered in turn (a connection carries one request
    at a time), so one can neither be forged, nor replayed on the connection, nor stand for
    another. Both ends call :meth:`next` once an exchange is over."""

    def __init__(self, key: bytes, encrypted: bool = False) -> None:
        self._key = key
        self._seq = 0
        self.encrypted = encrypted  # the exchanges are sealed whole instead (kvstore.cluster.peer_frames)

    def keys(self) -> tuple[bytes, bytes]:
        """The keys of an encrypted connection's two directions (fetcher to holder, holder to fetcher),
        each its own (HKDF of this connection's key), so no nonce is used under one key by both ends."""
        return hkdf(self._key, b"peer frames to the holder"), hkdf(self._key, b"peer frames to the fetcher")

    def seal(self, what: bytes, data: bytes) -> bytes:
        """The MAC of ``data`` as this exchange's ``what``."""
        msg = framed(self._seq.to_bytes(8, "little"), what, data)
        return hashlib.blake2b(msg, key=self._key, digest_size=MAC_BYTES).digest()

    def check(self, what: bytes, data: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(mac, self.seal(what, data))

    def next(self) -> None:
        self._seq += 1
