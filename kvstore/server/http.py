"""The sidecar's HTTP side: /healthz, /readyz, /stats (JSON), /metrics (Prometheus), dashboard,
/route (KV-aware routing: POST a JSON RouteRequest, or GET with it in ``?q=``).

It sees the sidecar only through :class:`HttpSource`: the token, whether it is ready (and which
background loops are failing), a /stats snapshot and the route call. :class:`HttpServer` listens:
at most ``server.http_max_connections`` connections at once (fewer when the open-file limit is
low, as the local socket's). Past that, ``server.http_probe_connections`` more are served the
probes only (``PROBE_PATHS``: /healthz, /readyz, /metrics; any other path 503), and when those are
full too the oldest of them is closed for the new one: idle connections that fill the cap cannot
fail a liveness probe (which would restart the sidecar and drop its DRAM), since a probe connects
and asks at once. A connection idle for
``server.http_idle_timeout_s``, or whose request head (or /route body) has not arrived in full by
then, is closed: silent connections cannot hold the process's file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvstore.server.auth import token_matches
from kvstore.server.local_server import connection_cap
from kvstore.stats.counters import document_json
from kvstore.util.address import split_host_port
from kvstore.util.logs import Throttled

if TYPE_CHECKING:
    from kvstore.config import ServerConfig

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
OPEN_PATHS = ("/healthz", "/readyz")  # probes answer without the token
PROBE_PATHS = ("/healthz", "/readyz", "/metrics")  # served in the probes' room too (HttpServer)
FULL = "too many HTTP connections"
MAX_DEPTH = 8  # of a /route body: a RouteRequest is 2 deep ({"namespace": {...}}); what parses it recurses
MAX_DIGITS = 20  # of an integer in a /route body: its widest integer field is a uint64 (20 digits)


@dataclass(frozen=True, slots=True)
class HttpSource:
    """What the HTTP side reads from the sidecar, and nothing else."""

    token: str  # server.auth_token; empty: every path is open
    ready: Callable[[], bool]  # /readyz: serving
    snapshot: Callable[[], dict[str, Any]]  # /stats, /metrics and the dashboard: one stats document
    route: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None  # /route (a JSON RouteRequest)
    failing: Callable[[], dict[str, str]] = dict  # /readyz: background loops whose last pass failed -> the error
    body_timeout_s: float = 60.0  # a request body (/route) arrives in full within this


def build_app(source: HttpSource, paths: Collection[str] | None = None) -> web.Application:
    """The HTTP side's paths (only ``paths``, with 503 for any other, when given)."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        failing = source.failing()
        ready = source.ready() and not failing
        return web.json_response({"ready": ready, "failing": failing}, status=200 if ready else 503)

    async def stats(_: web.Request) -> web.Response:
        return web.Response(text=document_json(source.snapshot()), content_type="application/json")

    async def metrics(_: web.Request) -> web.Response:
        from kvstore.stats.prometheus import render

        body, content_type = render(source.snapshot())
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def dashboard(_: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "dashboard.html")  # package data: ships with kvstore

    route = _route_handler(source)
    routes = [("GET", "/route", route), ("POST", "/route", route), ("GET", "/healthz", healthz),
              ("GET", "/readyz", readyz), ("GET", "/stats", stats), ("GET", "/metrics", metrics),
              ("GET", "/", dashboard), ("GET", "/dashboard", dashboard)]
    app = web.Application(middlewares=[_auth(source.token)])
    for method, path, handler in routes:
        if paths is None or path in paths:  # (add_get answers HEAD too)
            (app.router.add_get if method == "GET" else app.router.add_post)(path, handler)
    if paths is not None:
        app.router.add_route("*", "/{tail:.*}", _full)
    return app


async def _full(_: web.Request) -> web.Response:
    """Any other path asked over the probes' room: what a connection past the cap is answered."""
    return web.json_response({"error": FULL}, status=503)


def _auth(token: str) -> Middleware:
    """Every path but the probes (``OPEN_PATHS``) answers 401 without ``token``, sent as a bearer
    token or in ``?token=``; an empty ``token`` opens every path."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token and request.path not in OPEN_PATHS:
            header, query = request.headers.get("Authorization", ""), request.query.get("token", "")
            if not (token_matches(header, f"Bearer {token}") or token_matches(query, token)):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    return auth


def _route_handler(source: HttpSource) -> Handler:
    """/route: a JSON RouteRequest (the POST body, or ``?q=`` of a GET) read within
    ``source.body_timeout_s`` and at most ``MAX_DEPTH`` deep, answered by ``source.route``."""

    async def route(request: web.Request) -> web.Response:
        from kvstore.errors import KVStoreError

        if source.route is None:
            return web.json_response({"error": "routing is not served here"}, status=404)
        try:
            async with asyncio.timeout(source.body_timeout_s):
                text = await request.text() if request.can_read_body else request.query.get("q", "{}")
            body = _loads(text)
        except TimeoutError:
            return web.json_response({"error": f"request: body not in within {source.body_timeout_s} s"}, status=408)
        except ValueError as exc:  # (not JSON, not UTF-8)
            return web.json_response({"error": f"request: not JSON: {exc}"}, status=400)
        except RecursionError:  # (the decoder's own limit, before MAX_DEPTH is looked at)
            return web.json_response({"error": f"request: nested deeper than {MAX_DEPTH} levels"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request: a JSON object"}, status=400)
        if _deeper(body, MAX_DEPTH):
            return web.json_response({"error": f"request: nested deeper than {MAX_DEPTH} levels"}, status=400)
        where = _oversized(body)
        if where is not None:
            return web.json_response({"error": f"{where}: an integer of more than {MAX_DIGITS} digits"}, status=400)
        try:
            return web.json_response(await source.route(body))
        except KVStoreError as exc:
            return web.json_response({"error": str(exc)}, status=400 if exc.code.name == "INVALID_ARGUMENT" else 503)

    return route


class _Oversized(str):
    """An integer literal longer than ``MAX_DIGITS`` digits, kept as its text until its field is named
    (Python refuses to convert one of more than 4,300 digits at all: a ValueError, not a field)."""


def _int(literal: str) -> int | _Oversized:
    return int(literal) if len(literal.lstrip("-")) <= MAX_DIGITS else _Oversized(literal)


def _loads(text: str) -> Any:
    """A /route body decoded, its integers parsed only when a field could hold them."""
    return json.loads(text, parse_int=_int)


def _oversized(doc: Any) -> str | None:
    """The path (``namespace.blockSize``, ``tokens[3]``) of the first oversized integer in ``doc``
    (at most ``MAX_DEPTH`` deep: :func:`_deeper` said so), or None."""
    if isinstance(doc, _Oversized):
        return ""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        inner = _oversized(v)
        if inner is not None:
            here = f"{k}" if isinstance(k, str) else f"[{k}]"
            return here + (inner if not inner or inner.startswith("[") else f".{inner}")
    return None


def _deeper(doc: Any, limit: int) -> bool:
    """Whether the JSON value ``doc`` nests lists and objects more than ``limit`` deep (without
    recursing: the point is a value too deep to recurse into)."""
    level: list[Any] = [doc]
    for _ in range(limit + 1):
        level = [v for d in level if isinstance(d, (dict, list)) for v in (d.values() if isinstance(d, dict) else d)]
        if not level:
            return False
    return True


REFUSAL = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" \
          b"Connection: close\r\n\r\n%s"


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 (a fresh socket's buffer takes it) and closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = json.dumps({"error": FULL}).encode()
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(REFUSAL % (len(body), body))
        transport.close()


class _Pool:
    """The connections of one aiohttp server, counted against ``cap``."""

    def __init__(self, runner: web.AppRunner, cap: int) -> None:
        self.runner, self.cap = runner, cap
        self._unmade = 0  # connections accepted in this loop pass (not yet in server.connections)
        self._shed: set[web.RequestHandler] = set()  # closed by shed(), until they are gone

    def _server(self) -> web.Server:
        server = self.runner.server
        assert server is not None  # (after setup)
        return server

    def full(self) -> bool:
        # server.connections counts a connection from its connection_made, which the loop runs
        # after the whole batch it accepted in one pass: those of the batch are counted here
        connections = self._server().connections
        self._shed.intersection_update(connections)
        return len(connections) - len(self._shed) + self._unmade >= self.cap

    def take(self) -> asyncio.BaseProtocol:
        if not self._unmade:  # (runs before the batch's connection_made calls, queued after it)
            asyncio.get_running_loop().call_soon(self._made)
        self._unmade += 1
        return self._server()()

    def _made(self) -> None:
        self._unmade = 0

    def shed(self) -> bool:
        """Close the oldest connection (not closed already) to make room; False: none to close."""
        for handler in self._server().connections:  # (in the order they were made)
            if handler not in self._shed:
                self._shed.add(handler)
                handler.force_close()
                return True
        return False


class HttpServer:
    """The HTTP side listening on ``config.http_address`` (see the module's doc for its limits)."""

    def __init__(self, source: HttpSource, config: ServerConfig) -> None:
        self.address = config.http_address
        self.refused = 0  # connections over the cap and the probes' room
        self.shed = 0  # connections of the probes' room closed for a newer one
        idle = config.http_idle_timeout_s
        self._clients = _Pool(web.AppRunner(build_app(source), access_log=None, keepalive_timeout=idle),
                              connection_cap(config.http_max_connections))
        self._probes = _Pool(web.AppRunner(build_app(source, PROBE_PATHS), access_log=None, keepalive_timeout=idle),
                             config.http_probe_connections)
        self.cap = self._clients.cap
        self._listener: asyncio.Server | None = None
        self._warn = Throttled(log)
        self.port = 0

    async def start(self) -> int:
        host, port = split_host_port(self.address, listen=True)
        for pool in (self._clients, self._probes):
            await pool.runner.setup()
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(self._protocol, host or "127.0.0.1", port)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self.port

    def _protocol(self) -> asyncio.BaseProtocol:
        """A new connection: a client's while the cap has room, else one in the probes' room (the
        oldest there closed for it when that is full too), else refused."""
        if not self._clients.full():
            return self._clients.take()
        self._warn.warning("http: %d connections open; more are served the probes only", self.cap)
        if self._probes.full():
            if not self._probes.shed():
                self.refused += 1
                return _Refused()
            self.shed += 1
        return self._probes.take()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for pool in (self._clients, self._probes):
            await pool.runner.cleanup()  # (shuts the open connections down)
