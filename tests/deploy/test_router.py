"""deploy/router.py, the KV-aware router in front of vLLM servers.

- Its decisions against a real two-node cluster (two ``kvstore serve`` processes, a redis-server directory):
  the node holding the longest prefix, the load cap, nothing cached, a short prompt, a sidecar
  down, requests the connector bypasses.
- The compose file's "cluster" profile as processes on loopback, with real vLLM: the directory
  (redis-server with the service's arguments), kvstore-a and kvstore-b (``kvstore serve`` with the
  services' KVSTORE_CLUSTER__* environment), vllm-a and vllm-b (vLLM's OpenAI server, each with
  the kvstore connector on its own node's sidecar) and the router, each with its service's
  command. A document sent through the router lands on one engine; requests sharing its prefix
  follow it there while another document lands on the other engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import deploy_topology as topo
import numpy as np
import pytest

from kvstore.client import SyncClient
from kvstore.harness.servers import free_port, redis_server
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import Namespace, prefix_keys
from tests.support.sidecar_args import loopback_args

sys.path.insert(0, str(topo.REPO / "deploy"))
try:
    import router as rt
finally:
    sys.path.remove(str(topo.REPO / "deploy"))

REPO = topo.REPO
DOCKERFILE = topo.Dockerfile()
BS = 16
NS = Namespace(model="tiny-llama", kv_layout="vllm_cpu", dtype="float32", block_size=BS, revision="+cpu_attn=vec")


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 512, n).tolist()


# --- decisions against a real two-node cluster (no engines: prompts as token ids) ---------------


TOKEN = "sidecar-token"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """Two ``kvstore serve`` cluster members (a and b) with a bearer token, a redis-server directory."""
    root = tmp_path_factory.mktemp("pair")
    with redis_server() as directory:
        nodes: list[ServeProcess] = []
        try:
            for name in ("a", "b"):
                nodes.append(ServeProcess(
                    loopback_args(root / name, 16 << 20),
                    {"KVSTORE_SSD__ENABLED": "false", "KVSTORE_SERVER__AUTH_TOKEN": TOKEN,
                     "KVSTORE_CLUSTER__ENABLED": "true", "KVSTORE_CLUSTER__DIRECTORY_URL": directory.url,
                     "KVSTORE_CLUSTER__NODE_ID": name, "KVSTORE_CLUSTER__PEER_ADDRESS": "127.0.0.1:0",
                     "KVSTORE_CLUSTER__TOKEN": "cluster-secret", "KVSTORE_CLUSTER__KEY_PREFIX": "router-test",
                     "KVSTORE_CLUSTER__HEARTBEAT_MS": "100", "KVSTORE_CLUSTER__LEASE_MS": "1000",
                     "KVSTORE_CLUSTER__PUBLISH_INTERVAL_MS": "2"}))
            for sc in nodes:  # until each sees both members
                deadline = time.monotonic() + 60
                ns = {"model": "m", "kvLayout": "raw", "dtype": "float16", "blockSize": 16}
                body = {"namespace": ns, "keys": ["00" * 32]}
                while True:
                    req = urllib.request.Request(f"http://{sc.http}/route", json.dumps(body).encode(),
                                                 {"Authorization": f"Bearer {TOKEN}"})
                    with urllib.request.urlopen(req, timeout=10) as r:
                        if len(json.loads(r.read())["nodes"]) == 2:
                            break
                    assert time.monotonic() < deadline, "the two sidecars never saw each other"
                    time.sleep(0.1)
            yield nodes[0], nodes[1]
        finally:
            for sc in nodes:
                sc.stop()


def settings(*sidecars: str, token: str = TOKEN, nodes: tuple[str, ...] = ("a", "b")) -> rt.Settings:
    args = rt.parse_args([
        *[a for node, sc in zip(nodes, sidecars) for a in ("--backend", f"{node}=http://127.0.0.1:1,{sc}")],
        "--model-id", NS.model, "--kv-layout", NS.kv_layout, "--dtype", NS.dtype, "--block-size", str(BS),
        "--revision", NS.revision, "--sidecar-token", token, "--route-timeout-s", "10",
    ])
    return rt.settings_from_args(args)


@contextlib.asynccontextmanager
async def started(s: rt.Settings) -> AsyncIterator[rt.Router]:
    r = rt.Router(s)
    await r.start()
    try:
        yield r
    finally:
        await r.close()


def store(sc: ServeProcess, toks: list[int]) -> int:
    """Commit the prompt's full blocks on this node and wait until the directory lists them."""
    keys = prefix_keys(NS, toks)
    with SyncClient(sc.grpc, token=TOKEN) as c:
        c.put_blocks(NS, keys, [np.full(4096, i, np.uint8) for i in range(len(keys))], wait_published=True)
    return len(keys)


def http(sc: ServeProcess) -> str:
    return f"http://{sc.http}"


async def test_the_node_holding_the_longest_prefix_wins_under_the_load_cap(
    pair: tuple[ServeProcess, ServeProcess],
) -> None:
    a, b = pair
    doc = tokens(1, 6 * BS + 5)
    assert store(a, doc[: 4 * BS]) == 4
    store(b, doc[:BS])
    async with started(settings(http(a), http(b))) as r:
        d = await r.decide("completions", {"prompt": doc + tokens(2, 9)})
        assert (d.node, d.reason, d.prefix, d.tokens) == ("a", rt.PREFIX, 4, 6 * BS + 5 + 9)
        assert [(n["node"], n["dram"], n["peer"]) for n in d.ranked] == [("a", 4, 0), ("b", 1, 3)]
        r.in_flight["a"] = 5  # far over the mean: B, which holds less, takes it
        d = await r.decide("completions", {"prompt": doc})
        assert (d.node, d.reason) == ("b", rt.LOAD_CAP) and d.ranked[1]["load"] == 5.0
        r.in_flight["a"] = 0
        # a batch is routed on its first prompt
        assert (await r.decide("completions", {"prompt": [doc, tokens(3, 40)]})).node == "a"


async def test_nothing_cached_short_prompts_and_bypassed_requests_go_to_the_least_loaded(
    pair: tuple[ServeProcess, ServeProcess],
) -> None:
    a, b = pair
    async with started(settings(http(a), http(b))) as r:
        d = await r.decide("completions", {"prompt": tokens(4, 3 * BS)})
        assert (d.node, d.reason, d.prefix) == ("a", rt.LEAST_LOADED, 0) and len(d.ranked) == 2
        r.requests["a"] = 1  # sent one already: the next fresh prompt goes to B
        assert (await r.decide("completions", {"prompt": tokens(5, 3 * BS)})).node == "b"
        r.in_flight["b"] = 1  # busier now, though A was sent more
        assert (await r.decide("completions", {"prompt": tokens(6, 3 * BS)})).node == "a"
        r.in_flight["b"] = 0
        d = await r.decide("completions", {"prompt": tokens(7, BS - 1)})
        assert (d.reason, d.tokens, d.ranked) == (rt.SHORT_PROMPT, BS - 1, [])
        doc = tokens(8, 4 * BS)
        store(a, doc)
        assert (await r.decide("completions", {"prompt": doc})).reason == rt.PREFIX
        for body in ({"prompt": doc, "cache_salt": "tenant"},
                     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}):
            api = "chat" if "messages" in body else "completions"
            assert (await r.decide(api, body)).reason == rt.BYPASS
        assert r.errors["sidecar"] == 0


async def test_a_sidecar_down_or_refusing_is_skipped_and_then_the_router_routes_blind(
    pair: tuple[ServeProcess, ServeProcess],
) -> None:
    a, b = pair
    doc = tokens(9, 4 * BS)
    store(a, doc)
    dead = f"http://127.0.0.1:{free_port()}"
    async with started(settings(dead, http(b))) as r:  # A's sidecar down: B answers for the cluster
        d = await r.decide("completions", {"prompt": doc})
        assert (d.node, d.reason, d.sidecar) == ("a", rt.PREFIX, "b") and r.errors["sidecar"] == 1
        await r.decide("completions", {"prompt": doc})
        assert r.errors["sidecar"] == 1, "a failed sidecar is skipped for --sidecar-backoff-s"
        assert r.stats()["backends"][0]["sidecar_down"] is True
    async with started(settings(http(a), http(b), token="wrong")) as r:  # 401 from both
        d = await r.decide("completions", {"prompt": doc})
        assert (d.node, d.reason) == ("a", rt.SIDECAR_UNREACHABLE) and r.errors["sidecar"] == 2
        d = await r.decide("completions", {"prompt": doc})  # both backing off: not even asked
        assert d.reason == rt.SIDECAR_UNREACHABLE and r.errors["sidecar"] == 2
    async with started(settings(http(a), nodes=("c",))) as r:  # a backend that is no cluster member
        d = await r.decide("completions", {"prompt": doc})
        assert (d.node, d.reason) == ("c", rt.LEAST_LOADED) and {n["node"] for n in d.ranked} == {"a", "b"}


def test_backend_arguments_are_checked():
    with pytest.raises(SystemExit):
        rt.parse_args(["--backend", "a=http://e:8000", "--model-id", "m"])  # no sidecar URL
    with pytest.raises(SystemExit):
        rt.parse_args(["--backend", "a=http://e:1,http://s:2", "--backend", "a=http://f:1,http://t:2",
                       "--model-id", "m"])
    s = rt.settings_from_args(rt.parse_args(["--backend", "a=http://e:1/,http://s:2/", "--model-id", "m"]))
    assert s.backends == (rt.Backend("a", "http://e:1", "http://s:2"),)
    assert s.namespace == {"model": "m", "kvLayout": "vllm_gpu", "dtype": "bfloat16", "blockSize": 16}


# --- the compose file's cluster profile with real vLLM ------------------------------------------------

SERVICES = topo.load_compose({})["services"]
CLUSTER = ("directory", "kvstore-a", "kvstore-b", "tiny-model", "vllm-a", "vllm-b", "router")
ENGINES = {"node-a": "vllm-a", "node-b": "vllm-b"}
TIMEOUT_S = 900.0  # two vLLM servers starting at once on a shared 2-core machine


def vllm_env() -> dict[str, str]:
    from kvstore.harness.instance import VLLM_ENV

    env = dict(VLLM_ENV)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the OpenAI server runs its engine core in a process of its own
    return env


def cpu_revision() -> str:
    """The revision connector.vllm gives the compose engines' KV here (float32, block 32, head 32)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return f"+cpu_attn={_get_attn_isa(torch.float32, 32, 32, 'auto')}"


def call(url: str, body: Any = None, timeout: float = 300) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in the metrics")


class Process:
    """A service's command as a process, its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(argv, env={**os.environ, **env}, cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_http(self, url: str, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                if call(url, timeout=5)[0] == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {url} not up:\n{self.tail()}")
            time.sleep(1.0)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def engine_argv(lb: topo.Loopback, name: str) -> list[str]:
    """vllm-X's command: its entrypoint (the Dockerfile's vllm stage) and arguments on loopback."""
    entry = DOCKERFILE.stages[SERVICES[name]["build"]["target"]].entrypoint
    assert entry[0] == "python"
    args = lb.rewriter(name).all(topo.command(SERVICES[name]))
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(lb.ports[(name, 8000)])
    return [sys.executable, *entry[1:], *args]


class Cluster:
    def __init__(self, services: dict[str, Any], lb: topo.Loopback, sidecars: dict[str, ServeProcess],
                 engines: dict[str, str], router: str, revision: str) -> None:
        self.services, self.lb, self.sidecars, self.engines, self.router = services, lb, sidecars, engines, router
        self.revision = revision

    def route(self, body: dict[str, Any], api: str = "completions") -> dict[str, Any]:
        status, _, raw = call(f"{self.router}/router/route?api={api}", body)
        assert status == 200, raw
        return dict(json.loads(raw))

    def wait_stored(self, body: dict[str, Any], api: str = "completions") -> dict[str, Any]:
        """Until the cluster's answer for this request names a node holding a prefix of it (the
        engine's connector saves after the response went out; the sidecar then lists the blocks)."""
        deadline = time.monotonic() + 120
        while True:
            d = self.route(body, api)
            if d["reason"] == rt.PREFIX or time.monotonic() > deadline:
                return d
            time.sleep(0.5)

    def metrics(self, node: str) -> str:
        return call(f"{self.engines[node]}/metrics")[2].decode()

    def stats(self) -> dict[str, Any]:
        return dict(json.loads(call(f"{self.router}/router/stats")[2]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("rt")
    revision = cpu_revision()
    services = topo.load_compose({"KVSTORE_ROUTER_REVISION": revision})["services"]
    lb = topo.Loopback(services, CLUSTER, root, free_port)
    procs: list[Process] = []
    sidecars: dict[str, ServeProcess] = {}
    deadline = time.monotonic() + TIMEOUT_S
    dir_args = topo.command(services["directory"])
    assert dir_args[0] == "redis-server"
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(redis_server(*dir_args[1:]))
        lb.ports[("directory", 6379)] = directory.port
        try:
            # tiny-model: the worker image's entrypoint, its command (builds the model in the volume)
            model = services["tiny-model"]
            entry = DOCKERFILE.stages[model["build"]["target"]].entrypoint
            rw = lb.rewriter("tiny-model", {DOCKERFILE.stages["worker"].workdir: str(REPO)})
            subprocess.run([sys.executable, *rw.all(entry[1:]), *rw.all(topo.command(model))], check=True,
                           cwd=REPO, timeout=600, capture_output=True)
            for name in ("kvstore-a", "kvstore-b"):
                rw = lb.rewriter(name)
                cmd = rw.all(topo.command(services[name]))
                assert cmd[0] == "serve"
                env = rw.env(topo.environment(services[name]))
                env["KVSTORE_DRAM__CAPACITY_BYTES"] = str(128 << 20)  # a smaller slab on a shared test machine
                sidecars[name] = ServeProcess(cmd[1:], env)
            engines = {}
            for node, name in ENGINES.items():
                env = {**vllm_env(), **lb.rewriter(name).env(topo.environment(services[name])),
                       "PYTHONPATH": str(REPO)}
                procs.append(Process(name, engine_argv(lb, name), env, root))
                engines[node] = f"http://{lb.addr(name, 8000)}"
            stage = DOCKERFILE.stages[services["router"]["build"]["target"]]
            rw = lb.rewriter("router", {stage.workdir: str(REPO)})  # the image's /opt/kvstore: this checkout
            entry = stage.entrypoint
            router_argv = [sys.executable, *rw.all(entry[1:]), *rw.all(topo.command(services["router"]))]
            # a loaded 2-core machine: the sidecars' answers may take longer than the default 0.5 s
            procs.append(Process("router", [*router_argv, "--route-timeout-s", "10"], {}, root))
            router = f"http://{lb.addr('router', 8000)}"
            for p, url in zip(procs, [f"{e}/health" for e in engines.values()] + [f"{router}/healthz"]):
                p.wait_http(url, deadline)
            yield Cluster(services, lb, sidecars, engines, router, revision)
        finally:
            for p in reversed(procs):
                p.stop()
            for sc in sidecars.values():
                sc.stop()


def completion(c: Cluster, prompt: Any, **extra: Any) -> tuple[str, str, dict[str, Any]]:
    status, headers, raw = call(f"{c.router}/v1/completions",
                                {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra})
    assert status == 200, raw
    return headers["X-KVStore-Node"], headers["X-KVStore-Route"], json.loads(raw)


@pytest.mark.vllm
def test_requests_for_a_cached_document_go_to_the_node_that_holds_it(cluster: Cluster) -> None:
    from kvstore.harness.tiny_model import generate_corpus

    c = cluster
    lines = generate_corpus(seed=7, n_lines=200)
    doc1 = " ".join(lines[:8])  # about 400 tokens: a dozen blocks of 32
    q1, q2 = lines[100], lines[101]

    # D1 (text: the router tokenizes it on an engine) lands on the least-loaded engine
    n1, reason, out = completion(c, doc1)
    assert reason == rt.LEAST_LOADED and out["usage"]["prompt_tokens"] > 4 * 32
    n2 = next(n for n in ENGINES if n != n1)
    follow = {"model": "tiny-llama", "prompt": f"{doc1}\n{q1}"}
    d = c.wait_stored(follow)
    assert (d["node"], d["reason"]) == (n1, rt.PREFIX) and d["prefix"] >= 4
    held = {n["node"]: n for n in d["ranked"]}
    assert held[n1]["dram"] == d["prefix"] and held[n2]["dram"] == 0 and held[n2]["peer"] == d["prefix"]
    hits_before = {n: metric(c.metrics(n), "vllm:prefix_cache_hits_total") for n in ENGINES}

    # requests sharing D1's prefix follow it, streamed ones too
    assert completion(c, f"{doc1}\n{q1}")[:2] == (n1, rt.PREFIX)
    status, headers, raw = call(f"{c.router}/v1/completions", {**follow, "prompt": f"{doc1}\n{q2}", "max_tokens": 4,
                                                               "temperature": 0, "stream": True})
    assert status == 200 and headers["X-KVStore-Node"] == n1 and headers["Content-Type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in raw.decode().splitlines() if line.startswith("data: ")]
    # the stream passes through the router: data events, then [DONE] (vLLM merges a request's
    # outputs into one event when its reader falls behind, so a loaded machine may send the 4
    # tokens in one): at least one data event, each with its choices
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and len(chunks) >= 1 and all(c["choices"] for c in chunks)
    hits = {n: metric(c.metrics(n), "vllm:prefix_cache_hits_total") - hits_before[n] for n in ENGINES}
    assert hits[n1] >= 2 * 4 * 32 and hits[n2] == 0, hits  # the follow-ups hit n1's own cache

    # D2 (token ids, no tokenizing) goes to the other engine; its follow-up stays there
    doc2 = tokens(20, 5 * 32 + 7)
    assert completion(c, doc2)[:2] == (n2, rt.LEAST_LOADED)
    assert c.wait_stored({"prompt": [*doc2[:4 * 32], *tokens(21, 20)]})["node"] == n2
    assert completion(c, [*doc2[:4 * 32], *tokens(21, 20)])[:2] == (n2, rt.PREFIX)

    # chat: the engines' chat template, through their /tokenize
    system = {"role": "system", "content": " ".join(lines[50:58])}
    chat = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0}
    status, headers, raw = call(f"{c.router}/v1/chat/completions",
                                {**chat, "messages": [system, {"role": "user", "content": q1}]})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["role"] == "assistant"
    n3 = headers["X-KVStore-Node"]
    again = {**chat, "messages": [system, {"role": "user", "content": q2}]}
    assert c.wait_stored(again, "chat")["node"] == n3
    status, headers, _ = call(f"{c.router}/v1/chat/completions", again)
    assert status == 200 and (headers["X-KVStore-Node"], headers["X-KVStore-Route"]) == (n3, rt.PREFIX)

    # other paths go to an engine as they are
    status, _, raw = call(f"{c.router}/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "tiny-llama"

    s = c.stats()
    assert s["decisions"][rt.PREFIX] == 4 and s["decisions"][rt.LEAST_LOADED] == 3, s["decisions"]
    assert sum(s["requests"].values()) == 7 + 1  # and /v1/models (the router's own /tokenize calls are not counted)
    assert s["requests"][n1] >= 3 and s["requests"][n2] >= 2 and s["in_flight"] == {n: 0 for n in ENGINES}
    assert s["errors"] == {"sidecar": 0, "tokenize": 0, "engine": 0, "failover": 0}
    assert [r["reason"] for r in s["recent"]][:3] == [rt.LEAST_LOADED, rt.PREFIX, rt.PREFIX]
    # each engine's connector stored its prompts' blocks in its own node's sidecar
    committed = {}
    for node, name in (("node-a", "kvstore-a"), ("node-b", "kvstore-b")):
        status, _, raw = call(f"http://{c.sidecars[name].http}/stats")
        assert status == 200
        committed[node] = json.loads(raw)["writes"].get("blocks_committed", 0)
    assert committed[n1] >= d["prefix"] and committed[n2] >= 5, committed


@pytest.mark.vllm
def test_without_sidecars_or_with_an_engine_down_the_router_still_serves(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    dead = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, str(REPO / "deploy" / "router.py"), "--listen", "127.0.0.1:0",
            "--backend", f"node-c={dead},{dead}",  # an engine that refuses connections
            *[a for node, url in c.engines.items() for a in ("--backend", f"{node}={url},{dead}")],
            "--model-id", "tiny-llama", "--kv-layout", "vllm_cpu", "--dtype", "float32", "--block-size", "32",
            "--revision", c.revision]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        url = f"http://{ready['http']}"
        served = []
        for seed in (30, 31):
            status, headers, raw = call(f"{url}/v1/completions", {"model": "tiny-llama", "prompt": tokens(seed, 100),
                                                                 "max_tokens": 2, "temperature": 0})
            assert status == 200, raw
            assert headers["X-KVStore-Route"] == rt.SIDECAR_UNREACHABLE
            served.append(headers["X-KVStore-Node"])
        assert served[0] != "node-c" and set(served) == set(c.engines), "failover, then the least-loaded"
        s = json.loads(call(f"{url}/router/stats")[2])
        assert s["decisions"][rt.SIDECAR_UNREACHABLE] == 2 and s["errors"]["failover"] == 1
        assert s["errors"]["engine"] == 1 and s["requests"]["node-c"] == 1
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


@pytest.mark.vllm
def test_compose_engines_parse_with_vllms_own_arguments_and_match_the_routers_namespace() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    router = rt.parse_args(topo.command(SERVICES["router"]))
    assert router.revision == cpu_revision(), "the compose default is x86's; set KVSTORE_ROUTER_REVISION elsewhere"
    by_node = {b.node: b for b in router.backends}
    for node, name in ENGINES.items():
        svc = SERVICES[name]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(topo.command(svc))
        engine = AsyncEngineArgs.from_cli_args(args)
        extra = engine.kv_transfer_config.kv_connector_extra_config
        sidecar = next(s for s, n in (("kvstore-a", "node-a"), ("kvstore-b", "node-b")) if n == node)
        assert topo.environment(SERVICES[sidecar])["KVSTORE_CLUSTER__NODE_ID"] == node
        assert extra["url"] == f"grpc://{sidecar}:50051" and svc["ipc"] == f"service:{sidecar}"
        assert engine.kv_transfer_config.kv_connector_module_path == "connector.vllm"
        assert (extra["model_id"], engine.block_size, engine.dtype) == (router.model_id, router.block_size,
                                                                        router.dtype)
        assert by_node[node].engine == f"http://{name}:{args.port}"
        assert by_node[node].sidecar == f"http://{sidecar}:8080"
        assert args.chat_template in {m.target for m in topo.mounts(svc)}
        assert engine.enable_prefix_caching
