"""docker-compose.yml, deploy/Dockerfile and deploy/prometheus.yml, checked without Docker.

The schema is the compose specification's JSON schema as shipped in the ``docker-compose``
1.29.2 package on PyPI (``compose/config/compose_spec.json``, Apache-2.0), vendored unchanged
as tests/deploy/compose_spec.json.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import tomllib
import urllib.parse
from pathlib import Path

import deploy_topology as topo
import jsonschema
import pytest
import yaml

from kvstore.config import load_config

REPO = topo.REPO
DOC = topo.load_compose({})
SERVICES = DOC["services"]
DOCKERFILE = topo.Dockerfile()


def validator() -> jsonschema.Validator:
    schema = json.loads(topo.SCHEMA.read_text())
    return jsonschema.Draft201909Validator(schema)


def test_compose_file_matches_the_compose_specification():
    v = validator()
    for doc in (topo.raw_compose(), DOC):  # as written, and after interpolation
        errors = sorted(v.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_schema_catches_mistakes():
    bad = copy.deepcopy(DOC)
    bad["services"]["kvstore"]["healthcheck"]["intervall"] = "5s"
    bad["services"]["redis"]["depends_on"] = {"kvstore": {"condition": "when_ready"}}
    paths = {tuple(e.path) for e in validator().iter_errors(bad)}
    assert ("services", "kvstore", "healthcheck") in paths
    assert any(p[:3] == ("services", "redis", "depends_on") for p in paths)


def test_every_service_has_an_image_and_builds_point_at_real_stages():
    for name, svc in SERVICES.items():
        assert svc.get("image") or svc.get("build"), name
        build = svc.get("build")
        if build:
            ctx = REPO / build["context"]
            assert (ctx / build["dockerfile"]).is_file(), name
            assert build["target"] in DOCKERFILE.stages, f"{name}: no stage {build['target']}"
    for stage in DOCKERFILE.stages.values():
        for sources, _ in stage.copies:
            for src in sources:
                assert (REPO / src).exists(), f"Dockerfile stage {stage.name}: COPY {src} does not exist"


def test_sidecar_and_workers_run_as_one_uid_and_share_ipc():
    # The slab is created 0600 by the sidecar: workers must be the same user, in its IPC namespace.
    sidecar, worker = DOCKERFILE.stages["sidecar"], DOCKERFILE.stages["worker"]
    assert sidecar.user and sidecar.user == worker.user
    assert SERVICES["kvstore"]["ipc"] == "shareable"
    for name in ("prefill", "decode"):
        assert SERVICES[name]["ipc"] == "service:kvstore"
        assert SERVICES[name]["build"]["target"] == "worker"


def _bytes(size: str) -> int:
    units = {"b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}
    num = size.rstrip("bkmgBKMG")
    return int(float(num) * units[size[len(num):].lower() or "b"])


def sidecar_config():
    svc = SERVICES["kvstore"]
    [toml] = [m for m in topo.mounts(svc) if m.target.endswith(".toml")]
    args = topo.command(svc)
    assert args[args.index("--config") + 1] == toml.target
    return _with_env(REPO / toml.source, topo.environment(svc))


def _with_env(path: Path, env: dict[str, str]):
    """load_config as the sidecar does it: the file, then KVSTORE_* environment overrides."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_config(path)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_sidecar_environment_and_file_form_a_valid_config_wired_to_the_services():
    cfg = sidecar_config()
    assert cfg.server.auth_token, "the compose file uses the bearer token"
    assert _bytes(SERVICES["kvstore"]["shm_size"]) > cfg.dram.capacity_bytes
    grpc_port = int(cfg.server.grpc_address.rpartition(":")[2])
    http_port = int(cfg.server.http_address.rpartition(":")[2])
    published = {p.container for p in topo.ports(SERVICES["kvstore"])}
    assert {grpc_port, http_port} <= published
    assert {grpc_port, http_port} <= set(DOCKERFILE.stages["sidecar"].expose)
    assert cfg.data_dir in {m.target for m in topo.mounts(SERVICES["kvstore"])}
    redis = urllib.parse.urlparse(cfg.redis.url)
    assert cfg.redis.enabled and redis.hostname in SERVICES and redis.port == 6379
    s3 = urllib.parse.urlparse(cfg.s3.endpoint_url)
    assert cfg.s3.enabled and s3.hostname == "minio" and s3.port == 9000
    assert "/data" in topo.command(SERVICES["minio"])  # MinIO serves :9000 by default
    env = topo.environment(SERVICES["kvstore"])
    minio = topo.environment(SERVICES["minio"])
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (
        minio["MINIO_ROOT_USER"],
        minio["MINIO_ROOT_PASSWORD"],
    )


def test_the_redis_cluster_profile_is_a_valid_config_too():
    env = {"KVSTORE_REDIS_URL": "redis://redis-node-1:6379/0", "KVSTORE_REDIS_CLUSTER": "true"}
    svc = topo.load_compose(env)["services"]["kvstore"]
    cfg = _with_env(REPO / "deploy" / "kvstore.toml", topo.environment(svc))
    assert cfg.redis.cluster and urllib.parse.urlparse(cfg.redis.url).hostname == "redis-node-1"
    init = SERVICES["redis-cluster-init"]
    script = next(m for m in topo.mounts(init) if m.bind)
    assert (REPO / script.source).is_file()
    text = (REPO / script.source).read_text()
    nodes = [n for n, s in SERVICES.items() if "redis-cluster" in s.get("profiles", []) and n.startswith("redis-node")]
    assert len(nodes) == 3 and all(n in text for n in nodes)
    for n in nodes:
        assert "--cluster-enabled" in topo.command(SERVICES[n])


def test_ports_are_unique_for_every_combination_of_profiles():
    for enabled in topo.profile_sets(DOC):
        seen: dict[int, str] = {}
        for name, svc in topo.active(DOC, enabled).items():
            for p in topo.ports(svc):
                if p.host is None:
                    continue
                assert p.host not in seen, f"profiles {enabled}: port {p.host} used by {seen.get(p.host)} and {name}"
                seen[p.host] = name


def test_dependencies_exist_are_started_with_their_dependents_and_have_healthchecks():
    for enabled in topo.profile_sets(DOC):
        running = topo.active(DOC, enabled)
        for name, svc in running.items():
            for dep, condition in topo.depends_on(svc).items():
                assert dep in running, f"profiles {enabled}: {name} depends on {dep}, which is not started"
                if condition == "service_healthy":
                    assert "healthcheck" in SERVICES[dep], (
                        f"{name} waits for {dep} to be healthy; it has no healthcheck"
                    )
                if condition == "service_completed_successfully":
                    assert SERVICES[dep].get("restart", "no") == "no", f"{dep} must run once"


def test_healthchecks_are_exec_form_and_the_sidecar_probes_readyz_on_its_http_port():
    for name, svc in SERVICES.items():
        hc = svc.get("healthcheck")
        if hc:
            assert hc["test"][0] in ("CMD", "CMD-SHELL"), name
    cfg = sidecar_config()
    http_port = cfg.server.http_address.rpartition(":")[2]
    probe = " ".join(SERVICES["kvstore"]["healthcheck"]["test"])
    assert f"127.0.0.1:{http_port}/readyz" in probe
    assert SERVICES["kvstore"]["healthcheck"]["test"][1:] == DOCKERFILE.stages["sidecar"].healthcheck


def test_volumes_are_declared_used_and_bind_sources_exist():
    declared = set(DOC.get("volumes") or {})
    used = set()
    for name, svc in SERVICES.items():
        for m in topo.mounts(svc):
            if m.bind:
                assert (REPO / m.source).exists(), f"{name}: bind source {m.source} missing"
            else:
                assert m.source in declared, f"{name}: volume {m.source} not declared"
                used.add(m.source)
    assert used == declared


def test_worker_commands_parse_and_point_at_the_sidecar():
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        import worker
    finally:
        sys.path.remove(str(REPO / "deploy"))
    cfg = sidecar_config()
    grpc_port = int(cfg.server.grpc_address.rpartition(":")[2])
    entry = DOCKERFILE.stages["worker"].entrypoint
    assert entry[-1].startswith(DOCKERFILE.stages["worker"].workdir)
    assert (REPO / Path(entry[-1]).relative_to(DOCKERFILE.stages["worker"].workdir)).is_file()
    model_dirs = set()
    for name in ("prefill", "decode"):
        svc = SERVICES[name]
        args = worker.parse_args(topo.command(svc))
        assert args.role == name
        url = urllib.parse.urlparse(args.url)
        assert (url.scheme, url.hostname, url.port) == ("grpc", "kvstore", grpc_port)
        assert topo.environment(svc)["KVSTORE_TOKEN"] == cfg.server.auth_token
        assert any(str(args.model_dir).startswith(m.target) for m in topo.mounts(svc))
        model_dirs.add(args.model_dir)
    assert len(model_dirs) == 1, "prefill and decode must share the model"
    assert topo.depends_on(SERVICES["decode"])["prefill"] == "service_completed_successfully"


def test_prometheus_scrapes_the_sidecar_with_the_token():
    svc = SERVICES["prometheus"]
    assert svc["profiles"] == ["metrics"]
    [cfg_mount] = [m for m in topo.mounts(svc) if m.target.endswith("prometheus.yml")]
    prom = yaml.safe_load((REPO / cfg_mount.source).read_text())
    [job] = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    cfg = sidecar_config()
    http_port = cfg.server.http_address.rpartition(":")[2]
    assert job["static_configs"][0]["targets"] == [f"kvstore:{http_port}"]
    token_file = job["authorization"]["credentials_file"]
    entry = " ".join(topo.command(svc, "entrypoint"))
    assert f'printf %s "$KVSTORE_TOKEN" > {token_file}' in entry
    assert cfg_mount.target in entry
    assert topo.environment(svc)["KVSTORE_TOKEN"] == cfg.server.auth_token


def test_deploy_config_file_is_valid_on_its_own():
    assert tomllib.loads((REPO / "deploy" / "kvstore.toml").read_text())
    cfg = load_config(REPO / "deploy" / "kvstore.toml")
    assert cfg.tiering.write_through == ["redis"]


@pytest.mark.parametrize("path", sorted((REPO / "deploy" / "k8s").glob("*.yaml")), ids=lambda p: p.name)
def test_k8s_manifests_parse(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs and all("kind" in d and "apiVersion" in d for d in docs)


# --- profile "cluster": two nodes, a directory, vLLM servers and the router -----------------------

CLUSTER_SIDECARS = {"kvstore-a": "node-a", "kvstore-b": "node-b"}


def _router_args():
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        import router
    finally:
        sys.path.remove(str(REPO / "deploy"))
    return router.parse_args(topo.command(SERVICES["router"]))


def cluster_config(name: str):
    svc = SERVICES[name]
    [toml] = [m for m in topo.mounts(svc) if m.target.endswith(".toml")]
    args = topo.command(svc)
    assert args[args.index("--config") + 1] == toml.target
    return _with_env(REPO / toml.source, topo.environment(svc))


def test_services_reach_what_they_name_on_a_network_they_share():
    for name, svc in SERVICES.items():
        for target, _ in topo.references(svc, SERVICES):
            if target == name:
                continue
            assert topo.networks(svc) & topo.networks(SERVICES[target]), f"{name} names {target}: no shared network"


def test_cluster_nodes_share_only_the_cluster_network_and_the_router():
    nets = {n: topo.networks(SERVICES[n]) for n in SERVICES}
    assert nets["directory"] == {"cluster"}
    assert nets["kvstore-a"] & nets["kvstore-b"] == {"cluster"}
    for a, b in (("node-a", "node-b"), ("node-b", "node-a")):
        on_a = [n for n, s in nets.items() if a in s]
        assert {"node-a", "node-b"} <= nets["router"]
        for n in on_a:
            if n != "router":
                assert b not in nets[n], f"{n} is on both nodes"
    # the decode worker and node b's engine reach node a only through their own sidecar
    for n in ("decode-b", "vllm-b"):
        assert not nets[n] & nets["kvstore-a"]
    for n in ("prefill-a", "vllm-a"):
        assert not nets[n] & nets["kvstore-b"]
    assert set(DOC["networks"]) == {"cluster", "node-a", "node-b"}
    assert all("cluster" in s.get("profiles", []) for n, s in SERVICES.items() if nets[n] - {"default"}
               or s.get("network_mode"))


def test_cluster_sidecars_form_one_cluster_with_the_directory():
    cfgs = {n: cluster_config(n) for n in CLUSTER_SIDECARS}
    for name, node in CLUSTER_SIDECARS.items():
        svc, cfg = SERVICES[name], cfgs[name]
        assert svc["profiles"] == ["cluster"]
        c = cfg.cluster
        assert c.enabled and c.node_id == node and c.token
        host, _, port = c.advertise_address.rpartition(":")
        assert host == name and int(port) == int(c.peer_address.rpartition(":")[2])
        assert int(port) in topo.listens(svc)
        directory = urllib.parse.urlparse(c.directory_url)
        assert (directory.hostname, directory.port) == ("directory", 6379) and not c.directory_cluster
        assert not cfg.redis.enabled and not cfg.s3.enabled and cfg.tiering.chain == ["ssd"]
        assert _bytes(svc["shm_size"]) > cfg.dram.capacity_bytes and svc["ipc"] == "shareable"
        mounts = {m.target: m.source for m in topo.mounts(svc)}
        assert cfg.data_dir in mounts and str(Path(cfg.server.local_socket).parent) in mounts
        # no bearer token (the vLLM connector cannot send one yet): nothing of it is published
        assert not cfg.server.auth_token and not svc.get("ports")
    assert topo.command(SERVICES["directory"])[0] == "redis-server"
    a, b = cfgs.values()
    assert a.cluster.token == b.cluster.token and a.cluster.key_prefix == b.cluster.key_prefix
    data = {m.source for n in CLUSTER_SIDECARS for m in topo.mounts(SERVICES[n]) if m.target == a.data_dir}
    assert len(data) == 2, "one data directory per node"
    env = {"KVSTORE_CLUSTER_TOKEN": "from-the-environment"}
    assert _with_env(REPO / "deploy" / "kvstore-cluster.toml", topo.environment(
        topo.load_compose(env)["services"]["kvstore-b"])).cluster.token == "from-the-environment"


def test_cluster_workers_and_engines_use_their_own_nodes_sidecar():
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        import worker
    finally:
        sys.path.remove(str(REPO / "deploy"))
    sidecar_user = DOCKERFILE.stages["sidecar"].user
    for name, svc in SERVICES.items():
        ipc = svc.get("ipc", "")
        if ipc.startswith("service:"):
            target = ipc.removeprefix("service:")
            assert SERVICES[target]["ipc"] == "shareable", name
            assert DOCKERFILE.stages[svc["build"]["target"]].user == sidecar_user, f"{name}: not the slab's uid"
            run = {m.source for m in topo.mounts(SERVICES[target]) if m.target == "/run/kvstore"}
            assert run <= {m.source for m in topo.mounts(svc) if m.target == "/run/kvstore"}, f"{name}: socket"
            sidecars_named = {n for n, _ in topo.references(svc, SERVICES) if n in {"kvstore", *CLUSTER_SIDECARS}}
            assert sidecars_named == {target}, f"{name} shares {target}'s slab but talks to {sidecars_named}"
    for name, sidecar in (("prefill-a", "kvstore-a"), ("decode-b", "kvstore-b")):
        args = worker.parse_args(topo.command(SERVICES[name]))
        url = urllib.parse.urlparse(args.url)
        assert (url.scheme, url.hostname, url.port) == ("grpc", sidecar, 50051) and args.role in name
        assert not topo.environment(SERVICES[name])["KVSTORE_TOKEN"]
    assert worker.parse_args(topo.command(SERVICES["decode-b"])).expect_hits
    assert topo.depends_on(SERVICES["decode-b"])["prefill-a"] == "service_completed_successfully"
    model = worker.parse_args(topo.command(SERVICES["tiny-model"]))
    assert model.role == "model"
    for name in ("prefill-a", "decode-b", "vllm-a", "vllm-b"):
        svc = SERVICES[name]
        assert topo.depends_on(svc).get("tiny-model", "service_completed_successfully") == \
            "service_completed_successfully"
        cmd = topo.command(svc)
        model_dir = cmd[cmd.index("--model-dir" if "--model-dir" in cmd else "--model") + 1]
        assert model_dir == str(model.model_dir) and any(model_dir.startswith(m.target) for m in topo.mounts(svc))


def test_the_router_fronts_each_nodes_engine_with_that_nodes_sidecar():
    args = _router_args()
    svc = SERVICES["router"]
    assert [b.node for b in args.backends] == list(CLUSTER_SIDECARS.values())
    for b, sidecar in zip(args.backends, CLUSTER_SIDECARS):
        engine, side = urllib.parse.urlparse(b.engine), urllib.parse.urlparse(b.sidecar)
        vllm = SERVICES[engine.hostname]
        cmd = topo.command(vllm)
        assert engine.port == int(cmd[cmd.index("--port") + 1]) and vllm["ipc"] == f"service:{sidecar}"
        connector = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert connector["kv_connector_extra_config"]["url"] == f"grpc://{sidecar}:50051"
        assert connector["kv_connector_extra_config"]["model_id"] == args.model_id
        assert int(cmd[cmd.index("--block-size") + 1]) == args.block_size
        assert cmd[cmd.index("--dtype") + 1] == args.dtype
        assert side.hostname == sidecar and side.port == int(cluster_config(sidecar).server.http_address.rpartition(
            ":")[2])
        assert topo.depends_on(svc)[engine.hostname] == "service_healthy"
    assert args.kv_layout == "vllm_cpu" and args.revision.startswith("+cpu_attn=")
    listen = int(args.listen.rpartition(":")[2])
    assert [p.container for p in topo.ports(svc)] == [listen]
    assert listen in DOCKERFILE.stages["router"].expose
    assert f"127.0.0.1:{listen}/healthz" in " ".join(svc["healthcheck"]["test"])
    assert svc["healthcheck"]["test"][1:] == DOCKERFILE.stages["router"].healthcheck
    assert "KVSTORE_ROUTER_REVISION" in topo.raw_compose()["services"]["router"]["command"][-1]


def _seconds(duration: str) -> float:
    """A compose duration ("60s", "1m30s", "1h") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.fullmatch(r"(?:\d+(?:\.\d+)?(?:h|ms|us|m|s))+", duration)
    assert parts, duration
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration))


def test_every_sidecar_is_given_the_time_its_stop_and_drain_may_take():
    """docker's SIGKILL comes after the sidecar's stop may have ended (grace, drain_s, watchdog)."""
    sidecars = {name: cluster_config(name) for name, svc in SERVICES.items() if topo.command(svc)[:1] == ["serve"]}
    assert set(sidecars) == {"kvstore", "kvstore-a", "kvstore-b"}
    for name, cfg in sidecars.items():
        assert cfg.server.drain_s > 0, name
        assert _seconds(SERVICES[name]["stop_grace_period"]) > cfg.server.stop_bound_s(), name
