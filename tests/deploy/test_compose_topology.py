"""The compose topology as processes on loopback: the same commands, environment and files as
docker-compose.yml, with service names mapped to loopback ports and container paths to local
ones. redis-server runs the redis service's own arguments; moto's server stands in for MinIO.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import deploy_topology as topo
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families
from traffic import NAMESPACES

from kvstore.client import SyncClient
from kvstore.harness.servers import free_port, moto_server, redis_cluster, redis_server
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import prefix_keys

REPO = topo.REPO
DOCKERFILE = topo.Dockerfile()


def rewriter(services: dict, tmp_path: Path, redis_addr: str, s3_addr: str, grpc: int, http: int,
             **more: str) -> topo.Rewriter:
    addresses = {
        **more,
        "redis:6379": redis_addr,
        "minio:9000": s3_addr,
        "kvstore:50051": f"127.0.0.1:{grpc}",
        "kvstore:8080": f"127.0.0.1:{http}",
        "0.0.0.0:50051": f"127.0.0.1:{grpc}",
        "0.0.0.0:8080": f"127.0.0.1:{http}",
        "127.0.0.1:8080": f"127.0.0.1:{http}",  # inside the sidecar's container (healthcheck)
    }
    paths: dict[str, Path] = {DOCKERFILE.stages["worker"].workdir: REPO}
    for name in ("kvstore", "prefill", "decode"):
        for m in topo.mounts(services[name]):
            paths[m.target] = REPO / m.source if m.bind else tmp_path / "volumes" / m.source
    return topo.Rewriter(addresses, paths)


def start_sidecar(services: dict, rw: topo.Rewriter) -> ServeProcess:
    svc = services["kvstore"]
    assert DOCKERFILE.stages["sidecar"].entrypoint == ["kvstore"]
    cmd = rw.all(topo.command(svc))
    assert cmd[0] == "serve"
    return ServeProcess(cmd[1:], rw.env(topo.environment(svc)))  # runs `kvstore serve ...`


def run_healthcheck(services: dict, name: str, rw: topo.Rewriter) -> None:
    test = services[name]["healthcheck"]["test"]
    assert test[0] == "CMD"
    argv = rw.all(test[1:])
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    subprocess.run(argv, check=True, timeout=60)


def run_worker(services: dict, name: str, rw: topo.Rewriter) -> list[dict]:
    svc = services[name]
    entry = rw.all(DOCKERFILE.stages["worker"].entrypoint)
    assert entry[0] == "python"
    env = {**os.environ, **rw.env(topo.environment(svc))}
    p = subprocess.run([sys.executable, *entry[1:], *rw.all(topo.command(svc))], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=600)
    assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stdout}\n{p.stderr[-3000:]}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def http_get(url: str, token: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_compose_services_run_as_processes(tmp_path):
    services = topo.load_compose({})["services"]
    redis_args = topo.command(services["redis"])
    assert redis_args[0] == "redis-server"
    grpc, http = free_port(), free_port()
    with redis_server(*redis_args[1:]) as redis, moto_server() as s3:
        rw = rewriter(services, tmp_path, f"127.0.0.1:{redis.port}", f"127.0.0.1:{s3.port}", grpc, http)
        sidecar = start_sidecar(services, rw)
        try:
            assert sidecar.grpc == f"127.0.0.1:{grpc}" and sidecar.http == f"127.0.0.1:{http}"
            run_healthcheck(services, "kvstore", rw)
            token = topo.environment(services["kvstore"])["KVSTORE_SERVER__AUTH_TOKEN"]

            # depends_on order: prefill runs to completion, then decode
            prefill = run_worker(services, "prefill", rw)
            decode = run_worker(services, "decode", rw)
            assert prefill[-1]["summary"]["prompts"] == decode[-1]["summary"]["prompts"] == 8
            d = decode[-1]["summary"]
            assert d["mismatches"] == 0 and d["misses"] == 0 and d["loaded_tokens"] > d["computed_tokens"]
            assert all(line["matches_reference"] for line in decode[:-1])

            status, _ = http_get(f"http://{sidecar.http}/stats")
            assert status == 401, "compose runs the sidecar with a bearer token"
            status, body = http_get(f"http://{sidecar.http}/stats", token)
            doc = json.loads(body)
            assert status == 200 and doc["lookups"]["blocks_hit"] > 0
            # prefill prompts 1..7 reuse the shared system prompt; every decode prompt loads its prefix
            assert doc["decisions"]["counts"]["loaded"] == 7 + 8
            assert doc["tiers"]["redis"]["enabled"] and not doc["tiers"]["redis"]["down"]
            assert doc["tiers"]["s3"]["enabled"] and not doc["tiers"]["s3"]["down"]
            assert doc["tiers"]["ssd"]["enabled"]
            assert int(redis.cli("DBSIZE").strip()) > 0, "redis is written through at commit"

            # Prometheus's scrape job, pointed at the process
            prom = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())["scrape_configs"][0]
            target = rw(prom["static_configs"][0]["targets"][0])
            status, body = http_get(f"{prom['scheme']}://{target}{prom['metrics_path']}", token)
            fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
            assert status == 200 and fams["kvstore_lookups"].samples[0].value == doc["lookups"]["calls"]
        finally:
            segment = sidecar.ready["segment"]
            code = sidecar.stop(signal.SIGTERM)  # compose's stop_signal
        assert code == 0 and not os.path.exists(f"/dev/shm/{segment}")


def test_redis_cluster_profile_as_processes(tmp_path):
    env = {"KVSTORE_REDIS_URL": "redis://redis-node-1:6379/0", "KVSTORE_REDIS_CLUSTER": "true"}
    services = topo.load_compose(env)["services"]
    node_args = topo.command(services["redis-node-1"])
    assert "--cluster-enabled" in node_args
    grpc, http = free_port(), free_port()
    with redis_cluster(3) as cluster, moto_server() as s3:
        first = f"127.0.0.1:{cluster.ports[0]}"
        rw = rewriter(services, tmp_path, first, f"127.0.0.1:{s3.port}", grpc, http, **{"redis-node-1:6379": first})
        sidecar = start_sidecar(services, rw)
        try:
            token = topo.environment(services["kvstore"])["KVSTORE_SERVER__AUTH_TOKEN"]
            keys = prefix_keys(NAMESPACES[0], list(range(16 * 12)))
            with SyncClient(sidecar.grpc, token=token) as c:
                c.put_blocks(
                    NAMESPACES[0], keys, [np.full(4096, i, np.uint8) for i in range(len(keys))], checksums=True
                )
                doc = c.stats()
            assert doc["tiers"]["redis"]["enabled"] and not doc["tiers"]["redis"]["down"]
            per_node = [int(n.cli("DBSIZE").strip()) for n in cluster.nodes]
            assert sum(per_node) > 0 and sum(1 for n in per_node if n) >= 2, per_node  # spread over the slots
        finally:
            code = sidecar.stop(signal.SIGTERM)
        assert code == 0


def test_cluster_profile_handoff_across_nodes_as_processes(tmp_path):
    """directory, kvstore-a, kvstore-b, tiny-model, prefill-a, decode-b: the prefill worker stores
    on node a, the decode worker on node b loads every prompt's prefix through its own sidecar,
    which fetches the blocks from node a over the peer data path (no shared block tier)."""
    services = topo.load_compose({})["services"]
    names = ("directory", "kvstore-a", "kvstore-b", "tiny-model", "prefill-a", "decode-b")
    lb = topo.Loopback(services, names, tmp_path, free_port)
    dir_args = topo.command(services["directory"])
    assert dir_args[0] == "redis-server"
    workdir = {DOCKERFILE.stages["worker"].workdir: str(REPO)}
    with redis_server(*dir_args[1:]) as directory:
        lb.ports[("directory", 6379)] = directory.port
        sidecars = {}
        try:
            for name in ("kvstore-a", "kvstore-b"):
                rw = lb.rewriter(name)
                cmd = rw.all(topo.command(services[name]))
                assert cmd[0] == "serve"
                env = rw.env(topo.environment(services[name]))
                env["KVSTORE_DRAM__CAPACITY_BYTES"] = str(128 << 20)  # a smaller slab on a shared test machine
                sidecars[name] = ServeProcess(cmd[1:], env)
                run_healthcheck(services, name, rw)
            # depends_on order: tiny-model, prefill-a to completion, then decode-b
            outputs = {}
            for name in ("tiny-model", "prefill-a", "decode-b"):
                rw = lb.rewriter(name, workdir)
                entry = rw.all(DOCKERFILE.stages[services[name]["build"]["target"]].entrypoint)
                env = {**os.environ, **rw.env(topo.environment(services[name]))}
                p = subprocess.run([sys.executable, *entry[1:], *rw.all(topo.command(services[name]))],
                                   capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
                assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stdout}\n{p.stderr[-3000:]}"
                outputs[name] = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
            d = outputs["decode-b"][-1]["summary"]
            assert d["prompts"] == 8 and d["mismatches"] == 0 and d["misses"] == 0
            assert d["loaded_tokens"] > d["computed_tokens"]
            docs = {}
            for name, sc in sidecars.items():
                status, body = http_get(f"http://{sc.http}/stats")  # no bearer token in this profile
                assert status == 200
                docs[name] = json.loads(body)
            a, b = docs["kvstore-a"]["cluster"], docs["kvstore-b"]["cluster"]
            assert b["blocks_fetched"] > 0 and a["blocks_lent"] >= b["blocks_fetched"], (a, b)
            assert docs["kvstore-b"]["writes"].get("blocks_committed", 0) == 0, "decode-b stores nothing itself"
        finally:
            codes = {name: sc.stop(signal.SIGTERM) for name, sc in sidecars.items()}
    assert all(code == 0 for code in codes.values()), codes
