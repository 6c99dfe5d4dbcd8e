"""Calls to the sidecar that are sent now and answered later (:meth:`SyncClient.pipeline
<kvstore.client.sync.SyncClient.pipeline>`, as redis-py's ``Pipeline``): one connection to its
Unix socket (wire format: :mod:`kvstore.wire.framing`), on which answers come back in the order
the calls went out (the sidecar serves a connection's calls one after another).

A call on a request's path costs a round trip, and after an idle spell the sidecar must be woken
first: milliseconds on a busy host. Sent early, a call is answered while the caller gets on with
its own work; sent together, many calls cost one round trip. The engine connectors send a
request's ``Acquire`` on the engine's thread when the engine adds the request, and read the
answer when the engine asks how many tokens it can load; and a step's ``Release`` and ``Lookup``
calls all at once from their background thread, then read their answers.

Only where the sidecar's socket can be opened (its host; found through ``Hello``): elsewhere
:meth:`~kvstore.client.sync.SyncClient.pipeline` gives None and callers use the blocking calls.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import select
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from kvstore.client.calls import DEFAULT_TIMEOUT_S, AsyncCall, Calls
from kvstore.client.local_channel import after_failure, connect, within_limit
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import read_frame, request_frame, response, unavailable

log = logging.getLogger(__name__)

MAX_PENDING = 256  # calls in flight before a send waits for the oldest answer (the socket's buffers are finite)

Then = Callable[[Any], None]  # gets the response message, or the KVStoreError the call ended with


@dataclass(slots=True, eq=False)
class Call:
    """One call sent on a :class:`Pipeline`; ``done`` once its answer was read."""

    name: str
    then: Then | None = None
    response: Any = None
    error: KVStoreError | None = None
    done: bool = False


class Pipeline:
    """One connection; every method is thread-safe. A connection that breaks fails the calls in
    flight on it (``Unavailable``); the next :meth:`send` opens a new one."""

    def __init__(self, path: str, *, token: str = "", timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = path
        self._token = token.encode()
        self._timeout = timeout
        self._limit = 0  # the longest call frame the sidecar takes, from its last hello (0: not known)
        self._requests = Calls()
        self._sock: socket.socket | None = None
        self._pending: deque[Call] = deque()
        self._lock = threading.RLock()

    def connect(self) -> None:
        """Open the connection now (raises ``Unavailable`` or the sidecar's refusal)."""
        with self._lock:
            if self._sock is None:
                self._sock = self._open()

    def _open(self) -> socket.socket:
        try:
            sock, self._limit = connect(self.path, self._token, self._timeout)
        except OSError as exc:
            raise unavailable(self.path, exc) from None
        return sock

    def send(self, name: str, request: Message, then: Then | None = None) -> Call:
        """Send one call; its answer goes to ``then`` when read, else waits for :meth:`result`.
        A call that cannot be sent is done at once, with its error. As the blocking client's
        (:mod:`kvstore.client.local_channel`): a call over the sidecar's limit is refused before
        any of it is sent; one whose sending fails gets the answer the sidecar wrote before it
        closed, if one waits in the socket; it is sent once more only when nothing of it went out
        on a connection opened before (a restarted sidecar), else it fails ``Unavailable``."""
        call = Call(name, then)
        frame = request_frame(name, request)
        with self._lock:
            self.poll()
            while len(self._pending) >= MAX_PENDING:
                self._read_next()
            for attempt in (0, 1):
                reused, sent = self._sock is not None, False
                try:
                    if self._sock is None:
                        self._sock = self._open()
                    within_limit(frame, self._limit)
                    n = self._sock.send(frame)
                    sent = True
                    self._sock.sendall(memoryview(frame)[n:])
                    break
                except OSError as exc:
                    try:
                        answer = self._send_failed(exc, reused and attempt == 0 and not sent)
                    except KVStoreError as error:
                        self._finish(call, None, error)
                        return call
                    if answer is not None:
                        self._answer(call, *answer)
                        return call
                except KVStoreError as exc:
                    self._finish(call, None, exc)
                    return call
            self._pending.append(call)
        return call

    def lookup(self, ns: Namespace, keys: Sequence[bytes], then: Then | None = None) -> Call:
        """Send a ``Lookup`` (no lease): its answer (a ``LookupResponse``: ``matched``, ...) as :meth:`send`'s."""
        return self.send("Lookup", self._requests.lookup(ns, keys, 0), then)

    def acquire(
        self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int, then: Then | None = None,
        shards: Sequence[tuple[Namespace, Sequence[bytes]]] = (),
    ) -> Call:
        """Send an ``Acquire`` (packed; over ``shards`` too, when given): its answer (an
        ``AcquireResponse``, read with :func:`~kvstore.client.calls.acquired` or
        :func:`~kvstore.client.calls.acquired_shards`) as :meth:`send`'s."""
        return self.send("Acquire", self._requests.acquire(ns, keys, lease_ttl_ms, shards=shards), then)

    def release(self, lease_id: str, then: Then | None = None) -> Call:
        """Send a ``Release`` of ``lease_id``: its answer (a ``ReleaseResponse``) as :meth:`send`'s."""
        return self.send("Release", pb.ReleaseRequest(lease_id=lease_id), then)

    def _send_failed(self, exc: OSError, idle_break: bool) -> tuple[int, bytes] | None:
        """A send failed with ``exc``: the connection is dropped, and the calls in flight on it
        get the answers that wait in its socket (the sidecar wrote them before it closed), the
        rest ``Unavailable``. What the failed call comes to is
        :func:`~kvstore.client.local_channel.after_failure`'s decision: the answer after theirs,
        None to send it again, or ``Unavailable`` raised."""
        sock, self._sock = self._sock, None  # (an answer's callback that sends opens a new one)
        pending, self._pending = self._pending, deque()
        try:
            if sock is not None and not isinstance(exc, TimeoutError):
                sock.setblocking(False)  # what the sidecar wrote before it closed is in the socket already
                while pending:
                    try:
                        status, payload = read_frame(sock)
                    except OSError:
                        break
                    self._answer(pending.popleft(), status, payload)
            # (an answer before the failed call's is missing: so is its own)
            return after_failure(self.path, None if pending else sock, exc, idle_break)
        finally:
            self._drop(sock, pending, exc)

    def result(self, call: Call) -> Any:
        """The call's response (read now if it has not been); raises its error."""
        with self._lock:
            while not call.done:
                self._read_next()
        if call.error is not None:
            raise call.error
        return call.response

    def forget(self, call: Call, then: Then | None = None) -> None:
        """Nobody waits for ``call``: its answer goes to ``then`` (now, if it came already)."""
        with self._lock:
            if call.done:
                if then is not None:
                    _deliver(then, call.error or call.response)
            else:
                call.then = then or _ignore

    def poll(self) -> None:
        """Read the answers that have arrived, without waiting for more."""
        with self._lock:
            while self._pending and self._sock is not None and select.select([self._sock], [], [], 0)[0]:
                self._read_next()

    def drain(self) -> None:
        """Wait for every answer in flight."""
        with self._lock:
            while self._pending:
                self._read_next()

    def _read_next(self) -> None:
        try:
            if self._sock is None:  # calls are pending only on an open socket; treat a lost one as broken
                raise ConnectionResetError("local socket closed with answers pending")
            status, payload = read_frame(self._sock)
        except OSError as exc:
            self._broken(exc)
            return
        self._answer(self._pending.popleft(), status, payload)

    def _answer(self, call: Call, status: int, payload: bytes) -> None:
        """``call`` is done with the answer read for it: its response or its error (the sidecar's,
        or INTERNAL for an answer that cannot be decoded)."""
        try:
            answer = response(call.name, status, payload)
        except KVStoreError as exc:
            self._finish(call, None, exc)
        else:
            self._finish(call, answer, None)

    def _finish(self, call: Call, response: Any, error: KVStoreError | None) -> None:
        call.response, call.error, call.done = response, error, True
        if call.then is not None:
            _deliver(call.then, error or response)

    def _broken(self, exc: OSError) -> None:
        """The connection is gone: close it and fail every call in flight on it."""
        sock, self._sock = self._sock, None
        pending, self._pending = self._pending, deque()
        self._drop(sock, pending, exc)

    def _drop(self, sock: socket.socket | None, pending: deque[Call], exc: OSError) -> None:
        if sock is not None:
            sock.close()
        for call in pending:
            self._finish(call, None, unavailable(self.path, exc))

    def close(self) -> None:
        with self._lock:
            try:
                self.drain()
            finally:
                sock, self._sock = self._sock, None
                if sock is not None:
                    sock.close()


def _deliver(then: Then, answer: Any) -> None:
    try:
        then(answer)
    except Exception:
        log.exception("kvstore pipeline: answer callback failed")


def _ignore(answer: Any) -> None:
    return None


def open_pipeline(path: str, token: str) -> Pipeline | None:
    """A :class:`Pipeline` to the socket at ``path``, connected; None where it cannot be opened
    from here (another container) or the sidecar refuses it."""
    pipe = Pipeline(path, token=token)
    try:
        pipe.connect()
    except KVStoreError as exc:
        log.info("kvstore pipeline: %s not usable (%s)", path, exc)
        return None
    return pipe


class AsyncPipeline:
    """:class:`Pipeline` for the asyncio client (:meth:`KVStoreClient.pipeline
    <kvstore.client.aio.KVStoreClient.pipeline>`): each call starts at once, a task on the client's
    transport (over the local socket a connection of its own while it is in flight, so answers do
    not wait for one another), and is awaited when wanted. Every method runs on the client's loop."""

    def __init__(self, call: AsyncCall) -> None:
        self._call = call
        self._requests = Calls()
        self._calls: set[asyncio.Future[Any]] = set()

    def send(self, name: str, request: Message, then: Then | None = None) -> asyncio.Future[Any]:
        """Send one call; its answer (or its ``KVStoreError``) goes to ``then`` when it comes, else
        waits for :meth:`result`."""
        call = asyncio.ensure_future(self._call(name, request))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        if then is not None:
            self.forget(call, then)
        return call

    def lookup(self, ns: Namespace, keys: Sequence[bytes], then: Then | None = None) -> asyncio.Future[Any]:
        """:meth:`Pipeline.lookup`."""
        return self.send("Lookup", self._requests.lookup(ns, keys, 0), then)

    def acquire(
        self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int, then: Then | None = None,
        shards: Sequence[tuple[Namespace, Sequence[bytes]]] = (),
    ) -> asyncio.Future[Any]:
        """:meth:`Pipeline.acquire`."""
        return self.send("Acquire", self._requests.acquire(ns, keys, lease_ttl_ms, shards=shards), then)

    def release(self, lease_id: str, then: Then | None = None) -> asyncio.Future[Any]:
        """:meth:`Pipeline.release`."""
        return self.send("Release", pb.ReleaseRequest(lease_id=lease_id), then)

    async def result(self, call: asyncio.Future[Any]) -> Any:
        """The call's response; raises its error."""
        return await call

    def forget(self, call: asyncio.Future[Any], then: Then | None = None) -> None:
        """Nobody waits for ``call``: its answer goes to ``then`` (now, if it came already)."""
        call.add_done_callback(functools.partial(_settled, then or _ignore))

    async def drain(self) -> None:
        """Wait for every answer in flight (and those of calls their ``then`` sent)."""
        while self._calls:
            await asyncio.wait(list(self._calls))

    async def aclose(self) -> None:
        await self.drain()


def _settled(then: Then, call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        error = call.exception()
        _deliver(then, error if error is not None else call.result())
