"""Calls to the sidecar that are sent now and answered later: one connection to its Unix socket
(wire format: :mod:`kvstore.framing`), on which answers come back in the order the calls went
out (the sidecar serves a connection's calls one after another).

A call on a request's path costs a round trip, and after an idle spell the sidecar must be woken
first: milliseconds on a busy host. Sent early, a call is answered while the engine gets on with
its own work. The scheduler side sends a request's ``Acquire`` on the engine's thread when the
engine adds the request, and reads the answer when the engine asks how many tokens it can load (a
background thread would first have to wait for the engine's thread to let go of the GIL, up to
the interpreter's 5 ms switch interval, before it could send anything). The worker side sends a
step's ``Release`` and hit ``Lookup`` calls all at once from its background thread, then reads
their answers: one round trip for all of them.

Only where the sidecar's socket can be opened (its host; found through ``Hello``): elsewhere
:class:`PipelineSlot` gives None and callers use their blocking client.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from kvstore.client import DEFAULT_TIMEOUT_S
from kvstore.client.local_channel import LocalChannel, after_failure, within_limit
from kvstore.errors import KVStoreError
from kvstore.framing import (  # the wire format, one place
    read_frame,
    request_frame,
    response,
    unavailable,
)

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
        self._opener = LocalChannel(path, token=token, timeout=timeout)  # its hello and frame reader
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
            return self._opener._connect()
        except OSError as exc:
            raise unavailable(self.path, exc) from None

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
                    within_limit(frame, self._opener._limit)
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
        self._opener._drop(sock)  # closes it
        for call in pending:
            self._finish(call, None, unavailable(self.path, exc))

    def close(self) -> None:
        with self._lock:
            try:
                self.drain()
            finally:
                self._sock = None
                self._opener.close()


def _deliver(then: Then, answer: Any) -> None:
    try:
        then(answer)
    except Exception:
        log.exception("kvstore pipeline: answer callback failed")


def _ignore(answer: Any) -> None:
    return None


class PipelineSlot:
    """The :class:`Pipeline` to the sidecar that ``client`` (a :class:`kvstore.client.SyncClient`)
    talks to, opened on first use: None while the sidecar cannot be reached (asked again next
    time), and for good when its socket cannot be opened from here or the client stays on gRPC."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._pipe: Pipeline | None = None
        self._want = callable(getattr(client, "hello", None))
        self._lock = threading.Lock()

    def get(self) -> Pipeline | None:
        if self._pipe is not None or not self._want:
            return self._pipe
        with self._lock:
            if self._pipe is None and self._want:
                try:
                    hello = self._client.hello()
                except KVStoreError:
                    return None  # down: ask again at the next use
                self._want = False
                if hello.local_socket and getattr(self._client, "transport", "") == "local":
                    pipe = Pipeline(hello.local_socket)
                    try:
                        pipe.connect()
                        self._pipe = pipe
                    except KVStoreError as exc:  # another container, or a token: blocking calls only
                        log.info("kvstore pipeline: %s not usable (%s)", hello.local_socket, exc)
        return self._pipe

    def close(self) -> None:
        with self._lock:
            pipe, self._pipe, self._want = self._pipe, None, False
        if pipe is not None:
            pipe.close()
