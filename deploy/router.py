"""A reference KV-aware router in front of several vLLM OpenAI-compatible servers.

    python deploy/router.py --listen 0.0.0.0:8000 \\
        --backend node-a=http://vllm-a:8000,http://kvstore-a:8080 \\
        --backend node-b=http://vllm-b:8000,http://kvstore-b:8080 \\
        --model-id tiny-llama --kv-layout vllm_cpu --dtype float32 --block-size 32 --revision +cpu_attn=vec

Each ``--backend`` is one engine: ``NODE=ENGINE_URL,SIDECAR_URL``, where NODE is the
``cluster.node_id`` of the kvstore sidecar that engine's connector writes to and SIDECAR_URL that
sidecar's HTTP address. For every ``POST /v1/completions`` and ``POST /v1/chat/completions``:

1. the prompt's token ids: ``prompt`` when it is token ids already, else the engines' own
   ``POST /tokenize`` (on the least-loaded engine: every engine tokenizes alike), with the
   request's ``add_special_tokens`` / chat-template fields;
2. one sidecar's ``POST /route`` (any sidecar answers for the whole cluster; the next one is
   asked when it fails, a failed one is skipped for ``--sidecar-backoff-s``) with the engines'
   namespace and the router's in-flight requests per node as ``loads``: every live node, best
   first (kvstore.routing.rank: the tier-weighted longest cached prefix under a 1.25x load cap);
3. the request goes to the engine of the first answered node that is a backend here. When no
   node holds any of the prefix, the sidecars are unreachable, the prompt is shorter than one
   block or cannot be tokenized, or its KV is not keyed by its token ids alone (``cache_salt``:
   the connector keys it under the salt's namespace, which the router does not compute; multimodal
   parts: their items go into the keys, which the router does not compute either; prompt
   embeddings: the connector bypasses those), it goes to the least-loaded
   engine (fewest in flight, then fewest sent so far). An engine that refuses the connection
   is skipped for the next one.

Responses, streamed (``"stream": true``, server-sent events) or not, pass through unchanged, with
``X-KVStore-Node`` and ``X-KVStore-Route`` (the reason) added. Other paths (``/v1/models``, ...)
go to the least-loaded engine. ``GET /router/stats``: requests per engine, in flight, decisions
by reason, errors, the last decisions. ``POST /router/route[?api=chat]``: the decision for a
request body, nothing sent. ``GET /healthz``.

The namespace must be the one the engines' connector (connector/vllm/cache_groups.py ``engine_groups``)
writes, or no prefix is ever found: ``--model-id`` = the connector's ``model_id`` (default there:
vLLM's ``--model`` path or name, not ``--served-model-name``), ``--kv-layout`` ``vllm_gpu`` or
``vllm_cpu``, ``--dtype`` the KV cache dtype (``float16``, ``bfloat16``, ``float32``, ...),
``--block-size`` vLLM's block size, ``--revision`` the connector's revision: the model revision
(usually empty), for an fp8 cache (``--dtype float8_e4m3`` or ``float8_e5m2``) followed by
``+kv_scales=unit`` (or ``+kv_scales=checkpoint:<quantization method>``), on CPU then by
``+cpu_attn=ISA`` (``vec`` on x86 unless bf16 on AMX, ``neon`` on ARM; vLLM's
``cpu_attn._get_attn_isa``).

The sidecars' bearer token: ``--sidecar-token`` or ``KVSTORE_TOKEN``. The engines' own
``Authorization`` header passes through. Only aiohttp and the standard library are needed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

log = logging.getLogger("kvstore.router")

# Why a request went where it went (GET /router/stats "decisions").
PREFIX = "prefix"  # the node holding the best-scored cached prefix
LOAD_CAP = "load_cap"  # a node with a longer prefix was over the load cap: the sidecar's next choice
LEAST_LOADED = "least_loaded"  # no node holds any of the prompt's blocks
SHORT_PROMPT = "short_prompt"  # fewer tokens than one block: nothing to look up
SIDECAR_UNREACHABLE = "sidecar_unreachable"  # no sidecar answered /route
TOKENIZE_FAILED = "tokenize_failed"  # no engine tokenized the prompt
BYPASS = "bypass"  # KV that the connector does not share by token ids
REASONS = (PREFIX, LOAD_CAP, LEAST_LOADED, SHORT_PROMPT, SIDECAR_UNREACHABLE, TOKENIZE_FAILED, BYPASS)

APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself
_DROP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                   "transfer-encoding", "upgrade", "host", "content-length"})
# chat fields that change the rendered prompt (vLLM's TokenizeChatRequest takes the same names)
_CHAT_TOKENIZE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                         "chat_template", "chat_template_kwargs", "tools", "documents")
RECENT = 50


@dataclass(frozen=True, slots=True)
class Backend:
    node: str  # the sidecar's cluster.node_id
    engine: str  # the vLLM server, http://host:port
    sidecar: str  # that node's sidecar HTTP address, http://host:port


@dataclass(frozen=True, slots=True)
class Settings:
    backends: tuple[Backend, ...]
    namespace: dict[str, Any]  # the RouteRequest namespace as JSON (camelCase)
    listen: str = "127.0.0.1:8000"
    sidecar_token: str = ""
    route_timeout_s: float = 0.5
    tokenize_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    sidecar_backoff_s: float = 2.0

    @property
    def block_size(self) -> int:
        return int(self.namespace["blockSize"])


@dataclass(slots=True)
class Decision:
    node: str
    reason: str
    tokens: int = 0  # prompt tokens routed on (0: not tokenized)
    prefix: int = 0  # blocks of the prompt the chosen node can serve (the sidecar's answer)
    ranked: list[dict[str, Any]] = field(default_factory=list)  # the sidecar's answer, best first
    sidecar: str = ""  # the sidecar that answered


def parse_backend(text: str) -> Backend:
    node, sep, urls = text.partition("=")
    engine, comma, sidecar = urls.partition(",")
    if not (sep and comma and node and engine and sidecar):
        raise argparse.ArgumentTypeError(f"--backend {text!r}: expected NODE=ENGINE_URL,SIDECAR_URL")
    return Backend(node, engine.rstrip("/"), sidecar.rstrip("/"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="KV-aware router in front of vLLM OpenAI-compatible servers")
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve on (port 0: any)")
    p.add_argument("--backend", action="append", type=parse_backend, required=True, dest="backends",
                   metavar="NODE=ENGINE_URL,SIDECAR_URL", help="one engine and its node's sidecar (repeat)")
    g = p.add_argument_group("namespace (as the engines' kvstore connector writes it)")
    g.add_argument("--model-id", required=True, help="the connector's model_id (default there: vLLM's --model)")
    g.add_argument("--kv-layout", default="vllm_gpu", choices=("vllm_gpu", "vllm_cpu"))
    g.add_argument("--dtype", default="bfloat16", help="KV cache dtype")
    g.add_argument("--block-size", type=int, default=16, help="vLLM's --block-size")
    g.add_argument("--revision", default="", help="the connector's revision (on CPU: ...+cpu_attn=ISA)")
    p.add_argument("--sidecar-token", default=os.environ.get("KVSTORE_TOKEN", ""),
                   help="the sidecars' bearer token (default: $KVSTORE_TOKEN)")
    p.add_argument("--route-timeout-s", type=float, default=0.5, help="deadline of one sidecar /route call")
    p.add_argument("--tokenize-timeout-s", type=float, default=10.0, help="deadline of one engine /tokenize call")
    p.add_argument("--sidecar-backoff-s", type=float, default=2.0, help="a sidecar that failed is skipped this long")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    nodes = [b.node for b in args.backends]
    if len(set(nodes)) != len(nodes):
        p.error(f"--backend: node ids must be unique, got {nodes}")
    if args.block_size <= 0:
        p.error("--block-size: must be positive")
    return args


def settings_from_args(args: argparse.Namespace) -> Settings:
    ns = {"model": args.model_id, "kvLayout": args.kv_layout, "dtype": args.dtype, "blockSize": args.block_size}
    if args.revision:
        ns["revision"] = args.revision
    return Settings(backends=tuple(args.backends), namespace=ns, listen=args.listen, sidecar_token=args.sidecar_token,
                    route_timeout_s=args.route_timeout_s, tokenize_timeout_s=args.tokenize_timeout_s,
                    sidecar_backoff_s=args.sidecar_backoff_s)


def _bypassed(api: str, body: dict[str, Any]) -> bool:
    """The connector skips these requests (their KV depends on more than the token ids)."""
    if body.get("cache_salt") or body.get("prompt_embeds") is not None:
        return True
    if api == "chat":
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(isinstance(c, dict) and c.get("type", "text") != "text"
                                                 for c in content):
                return True
    return False


class Router:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.backends = {b.node: b for b in settings.backends}
        self.order = [b.node for b in settings.backends]
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()  # sent to each engine
        self.decisions: collections.Counter[str] = collections.Counter({r: 0 for r in REASONS})
        self.errors: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        self._sidecar_down_until = dict.fromkeys(self.order, 0.0)
        self._session: ClientSession | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        # auto_decompress off: bodies pass through byte for byte, Content-Encoding with them
        timeout = ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s)
        self._session = ClientSession(timeout=timeout, auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> ClientSession:
        assert self._session is not None, "Router.start() first"
        return self._session

    # --- the decision ---------------------------------------------------------------------------

    def least_loaded(self, exclude: frozenset[str] = frozenset()) -> str:
        """Fewest requests in flight, then fewest sent so far, then configuration order."""
        nodes = [n for n in self.order if n not in exclude] or self.order
        return min(nodes, key=lambda n: (self.in_flight[n], self.requests[n], self.order.index(n)))

    async def tokens_of(self, api: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engines see them; None when no engine could tell."""
        if api == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]  # a batch: routed on its first prompt
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None
            req: dict[str, Any] = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        else:
            req = {k: body[k] for k in _CHAT_TOKENIZE_FIELDS if k in body}
            if "messages" not in req:
                return None
        if "model" in body:
            req["model"] = body["model"]
        tried: set[str] = set()
        for _ in self.order:
            node = self.least_loaded(frozenset(tried))
            tried.add(node)
            try:
                async with self.session.post(f"{self.backends[node].engine}/tokenize", json=req,
                                             timeout=ClientTimeout(total=self.settings.tokenize_timeout_s)) as r:
                    if r.status == 200:
                        tokens = (await r.json()).get("tokens")
                        if isinstance(tokens, list):
                            return tokens
                    elif 400 <= r.status < 500:  # the request itself is wrong: the engine will say so
                        self.errors["tokenize"] += 1
                        return None
            except (TimeoutError, ClientError, ValueError) as exc:
                log.warning("tokenize on %s failed: %r", node, exc)
            self.errors["tokenize"] += 1
        return None

    async def ask_sidecars(self, tokens: list[int]) -> tuple[str, list[dict[str, Any]]] | None:
        """(node whose sidecar answered, the ranked nodes), or None when none answered."""
        body = {"namespace": self.settings.namespace, "tokens": tokens,
                "loads": {n: float(self.in_flight[n]) for n in self.order}}
        headers = {"Authorization": f"Bearer {self.settings.sidecar_token}"} if self.settings.sidecar_token else {}
        now = time.monotonic()
        for node in [n for n in self.order if self._sidecar_down_until[n] <= now]:
            try:
                async with self.session.post(f"{self.backends[node].sidecar}/route", json=body, headers=headers,
                                             timeout=ClientTimeout(total=self.settings.route_timeout_s)) as r:
                    doc = await r.json(content_type=None)
                    if r.status == 200 and isinstance(doc.get("nodes"), list):
                        return node, doc["nodes"]
                    problem: object = f"HTTP {r.status}: {doc.get('error', doc)}"
            except (TimeoutError, ClientError, ValueError, AttributeError) as exc:
                problem = repr(exc)
            self.errors["sidecar"] += 1
            self._sidecar_down_until[node] = time.monotonic() + self.settings.sidecar_backoff_s
            log.warning("sidecar of %s: /route failed (%s); skipped for %.1fs", node, problem,
                        self.settings.sidecar_backoff_s)
        return None

    async def decide(self, api: str, body: dict[str, Any]) -> Decision:
        if _bypassed(api, body):
            return Decision(self.least_loaded(), BYPASS)
        tokens = await self.tokens_of(api, body)
        if tokens is None:
            return Decision(self.least_loaded(), TOKENIZE_FAILED)
        bs = self.settings.block_size
        full = tokens[: len(tokens) // bs * bs]  # only full blocks are stored
        if not full:
            return Decision(self.least_loaded(), SHORT_PROMPT, tokens=len(tokens))
        answer = await self.ask_sidecars(full)
        if answer is None:
            return Decision(self.least_loaded(), SIDECAR_UNREACHABLE, tokens=len(tokens))
        sidecar, ranked = answer
        ours = [n for n in ranked if n.get("node") in self.backends]
        best = max((float(n.get("score", 0.0)) for n in ours), default=0.0)
        if not ours or best <= 0.0:
            return Decision(self.least_loaded(), LEAST_LOADED, tokens=len(tokens), ranked=ranked, sidecar=sidecar)
        first = ours[0]
        reason = PREFIX if float(first.get("score", 0.0)) >= best else LOAD_CAP
        return Decision(first["node"], reason, tokens=len(tokens), prefix=int(first.get("prefix", 0)), ranked=ranked,
                        sidecar=sidecar)

    # --- forwarding -----------------------------------------------------------------------------

    async def forward(self, request: web.Request, body: bytes, node: str, decision: Decision | None = None
                      ) -> web.StreamResponse:
        """Send the request to ``node``'s engine (the next least-loaded one if it refuses the
        connection) and stream its response back as it comes."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        tried: set[str] = set()
        while True:
            tried.add(node)
            resp: web.StreamResponse | None = None
            self.in_flight[node] += 1
            self.requests[node] += 1
            try:
                url = f"{self.backends[node].engine}{request.path_qs}"
                async with self.session.request(request.method, url, data=body, headers=headers) as up:
                    resp = web.StreamResponse(status=up.status, reason=up.reason)
                    for k, v in up.headers.items():
                        if k.lower() not in _DROP:
                            resp.headers.add(k, v)
                    resp.headers["X-KVStore-Node"] = node
                    if decision is not None:
                        resp.headers["X-KVStore-Route"] = decision.reason
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
            except (ClientError, OSError) as exc:
                self.errors["engine"] += 1
                if resp is not None and resp.prepared:  # cut off mid-response: nothing left to retry
                    log.warning("engine %s: response cut off: %r", node, exc)
                    return resp
                log.warning("engine %s unreachable: %r", node, exc)
                if len(tried) == len(self.order):
                    return web.json_response({"error": f"no engine reachable (last: {node}: {exc!r})"}, status=502)
            finally:
                self.in_flight[node] -= 1
            node = self.least_loaded(frozenset(tried))
            self.errors["failover"] += 1

    # --- HTTP -----------------------------------------------------------------------------------

    async def handle_api(self, request: web.Request) -> web.StreamResponse:
        api = "chat" if request.path == APIS["chat"] else "completions"
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):  # the engine answers malformed requests itself
            return await self.forward(request, raw, self.least_loaded())
        decision = await self.decide(api, body)
        self.decisions[decision.reason] += 1
        self.recent.append({"t": round(time.time(), 3), "api": api, "node": decision.node, "reason": decision.reason,
                            "tokens": decision.tokens, "prefix": decision.prefix})
        return await self.forward(request, raw, decision.node, decision)

    async def handle_other(self, request: web.Request) -> web.StreamResponse:
        return await self.forward(request, await request.read(), self.least_loaded())

    async def handle_route(self, request: web.Request) -> web.Response:
        api = request.query.get("api", "completions")
        if api not in APIS:
            return web.json_response({"error": f"api: one of {sorted(APIS)}"}, status=400)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return web.json_response({"error": f"request: not JSON: {exc}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request: a JSON object"}, status=400)
        d = await self.decide(api, body)
        return web.json_response({**asdict(d), "engine": self.backends[d.node].engine})

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "backends": [{**asdict(b), "requests": self.requests[b.node], "in_flight": self.in_flight[b.node],
                          "sidecar_down": self._sidecar_down_until[b.node] > now} for b in self.settings.backends],
            "requests": {n: self.requests[n] for n in self.order},
            "in_flight": {n: self.in_flight[n] for n in self.order},
            "decisions": dict(self.decisions),
            "errors": {k: self.errors[k] for k in ("sidecar", "tokenize", "engine", "failover")},
            "namespace": self.settings.namespace,
            "recent": list(self.recent),
        }

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)

        async def session_ctx(_: web.Application) -> Any:
            await self.start()
            yield
            await self.close()

        async def stats(_: web.Request) -> web.Response:
            return web.json_response(self.stats())

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app.cleanup_ctx.append(session_ctx)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/router/stats", stats)
        app.router.add_post("/router/route", self.handle_route)
        for path in APIS.values():
            app.router.add_post(path, self.handle_api)
        app.router.add_route("*", "/{tail:.*}", self.handle_other)
        return app


async def serve(settings: Settings) -> None:
    router = Router(settings)
    runner = web.AppRunner(router.app(), handle_signals=False, access_log=None)
    await runner.setup()
    host, _, port = settings.listen.rpartition(":")
    site = web.TCPSite(runner, host or "0.0.0.0", int(port))
    await site.start()
    bound = runner.addresses[0]
    print(json.dumps({"event": "ready", "http": f"{bound[0]}:{bound[1]}",
                      "backends": [asdict(b) for b in settings.backends]}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings_from_args(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
