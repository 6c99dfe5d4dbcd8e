"""docker-compose.yml, deploy/Dockerfile and deploy/prometheus.yml, checked without Docker.

The schema is the compose specification's JSON schema as shipped in the ``docker-compose``
1.29.2 package on PyPI (``compose/config/compose_spec.json``, Apache-2.0), vendored unchanged
as tests/deploy/compose_spec.json.
"""

from __future__ import annotations

import copy
import json
import os
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
