"""The sidecar's HTTP side: /healthz, /readyz, /stats (JSON), /metrics (Prometheus), dashboard,
/route (KV-aware routing: POST a JSON RouteRequest, or GET with it in ``?q=``).

It sees the sidecar only through :class:`HttpSource`: the token, whether it is ready, a /stats
snapshot and the route call.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from kvstore.server.auth import token_matches
from kvstore.store.counters import document_json

STATIC = Path(__file__).parent / "static"
OPEN_PATHS = ("/healthz", "/readyz")  # probes answer without the token
MAX_DEPTH = 8  # of a /route body: a RouteRequest is 2 deep ({"namespace": {...}}); what parses it recurses


@dataclass(frozen=True, slots=True)
class HttpSource:
    """What the HTTP side reads from the sidecar, and nothing else."""

    token: str  # server.auth_token; empty: every path is open
    ready: Callable[[], bool]  # /readyz: serving
    snapshot: Callable[[], dict[str, Any]]  # /stats, /metrics and the dashboard: one stats document
    route: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None  # /route (a JSON RouteRequest)


def build_app(source: HttpSource) -> web.Application:
    token = source.token

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token and request.path not in OPEN_PATHS:
            header, query = request.headers.get("Authorization", ""), request.query.get("token", "")
            if not (token_matches(header, f"Bearer {token}") or token_matches(query, token)):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready = source.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def stats(_: web.Request) -> web.Response:
        return web.Response(text=document_json(source.snapshot()), content_type="application/json")

    async def metrics(_: web.Request) -> web.Response:
        from kvstore.server.metrics import render

        body, content_type = render(source.snapshot())
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def dashboard(_: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "dashboard.html")  # package data: ships with kvstore

    async def route(request: web.Request) -> web.Response:
        from kvstore.errors import KVStoreError

        if source.route is None:
            return web.json_response({"error": "routing is not served here"}, status=404)
        try:
            body = await request.json() if request.can_read_body else json.loads(request.query.get("q", "{}"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return web.json_response({"error": f"request: not JSON: {exc}"}, status=400)
        except RecursionError:  # (the decoder's own limit, before MAX_DEPTH is looked at)
            return web.json_response({"error": f"request: nested deeper than {MAX_DEPTH} levels"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request: a JSON object"}, status=400)
        if _deeper(body, MAX_DEPTH):
            return web.json_response({"error": f"request: nested deeper than {MAX_DEPTH} levels"}, status=400)
        try:
            return web.json_response(await source.route(body))
        except KVStoreError as exc:
            return web.json_response({"error": str(exc)}, status=400 if exc.code.name == "INVALID_ARGUMENT" else 503)

    app = web.Application(middlewares=[auth])
    app.router.add_get("/route", route)
    app.router.add_post("/route", route)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_get("/dashboard", dashboard)
    return app


def _deeper(doc: Any, limit: int) -> bool:
    """Whether the JSON value ``doc`` nests lists and objects more than ``limit`` deep (without
    recursing: the point is a value too deep to recurse into)."""
    level: list[Any] = [doc]
    for _ in range(limit + 1):
        level = [v for d in level if isinstance(d, (dict, list)) for v in (d.values() if isinstance(d, dict) else d)]
        if not level:
            return False
    return True


async def start_http(source: HttpSource, address: str) -> tuple[web.AppRunner, int]:
    host, _, port = address.rpartition(":")
    runner = web.AppRunner(build_app(source), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    bound: int = runner.addresses[0][1]  # (host, port) or, on IPv6, (host, port, flowinfo, scope_id)
    return runner, bound
