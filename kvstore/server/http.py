"""The sidecar's HTTP side: /healthz, /readyz, /stats (JSON), /metrics (Prometheus), dashboard."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from kvstore.server.auth import token_matches
from kvstore.store.counters import document_json

if TYPE_CHECKING:
    from kvstore.server.sidecar import Sidecar

STATIC = Path(__file__).parent / "static"


def build_app(sidecar: Sidecar) -> web.Application:
    token = sidecar.config.server.auth_token

    @web.middleware
    async def auth(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if token and request.path not in ("/healthz", "/readyz"):
            header, query = request.headers.get("Authorization", ""), request.query.get("token", "")
            if not (token_matches(header, f"Bearer {token}") or token_matches(query, token)):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready = sidecar.ready
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def stats(_: web.Request) -> web.Response:
        return web.Response(text=document_json(sidecar.store.snapshot()), content_type="application/json")

    async def metrics(_: web.Request) -> web.Response:
        from kvstore.server.metrics import render

        body, content_type = render(sidecar.store.snapshot())
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def dashboard(_: web.Request) -> web.StreamResponse:
        page = STATIC / "dashboard.html"
        if not page.exists():
            raise web.HTTPNotFound(text="dashboard not built")
        return web.FileResponse(page)

    app = web.Application(middlewares=[auth])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_get("/dashboard", dashboard)
    return app


async def start_http(sidecar: Sidecar, address: str) -> tuple[web.AppRunner, int]:
    host, _, port = address.rpartition(":")
    runner = web.AppRunner(build_app(sidecar), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
