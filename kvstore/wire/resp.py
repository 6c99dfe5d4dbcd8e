"""The Redis tier's bulk data path: pipelined GET and SET of block chunks, straight between the
sockets and the sidecar's DRAM slots.

redis-py (with hiredis) copies each reply three times on its way to the caller: socket into the
stream reader's buffer, into hiredis's buffer, into a new ``bytes``; and the tier then copies
that into the slot. Here a bulk reply whose destination is known (a chunk of a block at a fixed
offset of its slot) is read with ``socket.recv_into`` straight into the slot: one copy, by the
kernel. Writes go out with ``sendmsg`` from the slot's memory. Each pipeline runs on a blocking
socket in a worker thread, so several pipelines receive in parallel and the event loop only
waits.

Everything else the tier does (existence checks, deletes, SCAN, the cluster's slot map and
redirects, reconnect probing) stays on redis-py. This speaks just enough RESP2 for that data
path: simple strings, errors, integers and bulk strings, with AUTH and SELECT on connect.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from kvstore.wire.stream import Buffer, recv_into, send_buffers

Command = Sequence[Buffer]
# a bulk string read with no destination arrives as a bytearray; simple strings (+OK) are bytes
Reply = Union[bytes, bytearray, int, None, "ErrorReply", "Overflow", list["Reply"]]

CLOSED = "redis closed the connection"
_READ_BYTES = 64 * 1024  # the line buffer; bulk payloads bypass it
_INLINE = 16 * 1024  # a command argument at least this long is sent from its own buffer


class ProtocolError(ConnectionError):
    """The byte stream is not RESP2 as expected: the connection cannot be used further."""


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A ``-ERR ...`` reply (``MOVED``, ``ASK``, ``OOM``, ``WRONGTYPE``, ...)."""

    message: str

    @property
    def code(self) -> str:
        return self.message.split(" ", 1)[0]


@dataclass(frozen=True, slots=True)
class Overflow:
    """A bulk reply longer than the buffer it was meant for; its bytes were read and dropped."""

    length: int


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to connect: one Redis node."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    db: int = 0
    timeout_s: float | None = None
    connect_timeout_s: float | None = None


def encode(commands: Sequence[Command]) -> list[Buffer]:
    """RESP2 arrays of bulk strings, as a list of buffers for ``sendmsg``: small parts joined,
    large arguments (block chunks) passed by reference, never copied."""
    out: list[Buffer] = []
    small: list[bytes] = []
    for cmd in commands:
        small.append(b"*%d\r\n" % len(cmd))
        for arg in cmd:
            n = len(arg) if not isinstance(arg, memoryview) else arg.nbytes
            small.append(b"$%d\r\n" % n)
            if n >= _INLINE:
                out.append(b"".join(small))
                out.append(arg)
                small = [b"\r\n"]
            else:
                small.append(bytes(arg))
                small.append(b"\r\n")
    if small:
        out.append(b"".join(small))
    return out


class Connection:
    """One blocking socket to one node; not thread-safe (a :class:`Pool` hands it to one thread)."""

    def __init__(self, ep: Endpoint) -> None:
        self.sock = socket.create_connection((ep.host, ep.port), timeout=ep.connect_timeout_s or ep.timeout_s)
        try:
            self.sock.settimeout(ep.timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._buf = bytearray(_READ_BYTES)
            self._view = memoryview(self._buf)
            self._lo = self._hi = 0
            hello: list[Command] = []
            if ep.password is not None:
                hello.append(
                    (b"AUTH", ep.username.encode(), ep.password.encode())
                    if ep.username
                    else (b"AUTH", ep.password.encode())
                )
            if ep.db:
                hello.append((b"SELECT", str(ep.db).encode()))
            for reply in self.execute(hello) if hello else ():
                if isinstance(reply, ErrorReply):
                    raise ConnectionRefusedError(f"redis {ep.host}:{ep.port}: {reply.message}")
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def execute(self, commands: Sequence[Command], into: Sequence[memoryview | None] | None = None) -> list[Reply]:
        """Send ``commands`` as one pipeline and read one reply each. Where ``into[i]`` is a
        buffer, a bulk reply to command ``i`` is read straight into it and the reply is its length
        (:class:`Overflow` when it does not fit); elsewhere a bulk reply is ``bytes``. Error
        replies are returned as :class:`ErrorReply`, not raised; socket failures raise."""
        self._send(encode(commands))
        dests = into if into is not None else [None] * len(commands)
        return [self._reply(d) for d in dests]

    # ---- wire ---------------------------------------------------------------------------------

    def _send(self, bufs: list[Buffer]) -> None:
        send_buffers(self.sock, bufs)

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):  # a partial line at the end: move it to the front
            self._buf[: self._hi - self._lo] = self._buf[self._lo : self._hi]
            self._hi -= self._lo
            self._lo = 0
            if self._hi == len(self._buf):
                raise ProtocolError(f"redis reply line over {len(self._buf)} bytes")
        n = self.sock.recv_into(self._view[self._hi :])
        if not n:
            raise ConnectionResetError(CLOSED)
        self._hi += n

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._lo, self._hi)
            if end >= 0:
                line = bytes(self._buf[self._lo : end])
                self._lo = end + 2
                return line
            self._fill()

    def _exactly(self, dest: memoryview) -> None:
        """Fill ``dest``: what the line buffer holds first, then the socket straight into it."""
        n = len(dest)
        have = min(n, self._hi - self._lo)
        dest[:have] = self._view[self._lo : self._lo + have]
        self._lo += have
        if have < n:
            recv_into(self.sock, dest[have:], CLOSED)

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, len(scratch))
            self._exactly(scratch[:step])
            n -= step

    def _crlf(self) -> None:
        while self._hi - self._lo < 2:
            self._fill()
        if self._buf[self._lo : self._lo + 2] != b"\r\n":
            raise ProtocolError("redis bulk reply not terminated by CRLF")
        self._lo += 2

    def _reply(self, dest: memoryview | None) -> Reply:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            if dest is None:
                data = bytearray(n)
                self._exactly(memoryview(data))
                self._crlf()
                return data
            if n > len(dest):
                self._skip(n)
                self._crlf()
                return Overflow(n)
            self._exactly(dest[:n])
            self._crlf()
            return n
        if kind == b"+":
            return rest
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"*":  # EXEC's replies
            n = int(rest)
            return None if n < 0 else [self._reply(None) for _ in range(n)]
        raise ProtocolError(f"unexpected redis reply type {kind!r}")


class Pool:
    """Idle connections to one node, shared by worker threads.

    A pooled connection may have died since its last use (the server restarted): a
    :class:`ConnectionError` on a reused connection is retried once on a new one, which is safe
    for the idempotent GETs and SETs of this path. A timeout is not retried."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def execute(self, commands: Sequence[Command], into: Sequence[memoryview | None] | None = None) -> list[Reply]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            try:
                return self._run(conn, commands, into)
            except ConnectionError:
                pass  # stale: try once on a fresh connection
        return self._run(Connection(self.ep), commands, into)

    def _run(
        self, conn: Connection, commands: Sequence[Command], into: Sequence[memoryview | None] | None
    ) -> list[Reply]:
        try:
            replies = conn.execute(commands, into)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if self._closed:
                conn.close()
            else:
                self._idle.append(conn)
        return replies

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
