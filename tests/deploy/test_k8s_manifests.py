"""deploy/k8s: the sidecar DaemonSet next to the inference pods, checked without a cluster."""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from pathlib import Path

import deploy_topology as topo
import yaml

from kvstore.config import load_config

K8S = topo.REPO / "deploy" / "k8s"


def objects() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(set(K8S.glob("*.yaml")) - {K8S / "kustomization.yaml"}):
        for d in yaml.safe_load_all(path.read_text()):
            if d:
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


OBJ = objects()
DS = OBJ[("DaemonSet", "kvstore-sidecar")]
POD = DS["spec"]["template"]["spec"]
[SIDECAR] = POD["containers"]


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"]) - {"../grafana"}  # (the dashboard's ConfigMap: test_grafana_dashboard.py)
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_configmap_holds_a_valid_config_and_the_daemonset_mounts_it(tmp_path: Path):
    cm = OBJ[("ConfigMap", "kvstore-config")]
    toml = tmp_path / "kvstore.toml"
    toml.write_text(cm["data"]["kvstore.toml"])
    assert tomllib.loads(toml.read_text())
    env = {e["name"]: e.get("value", "secret") for e in SIDECAR["env"]}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = load_config(toml)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert cfg.server.auth_token == "secret"
    args = SIDECAR["args"]
    config_path = Path(args[args.index("--config") + 1])
    mounts = {m["name"]: m["mountPath"] for m in SIDECAR["volumeMounts"]}
    assert str(config_path.parent) == mounts["config"]
    assert cfg.data_dir == mounts["data"]
    ports = {p["name"]: p for p in SIDECAR["ports"]}
    assert ports["grpc"]["containerPort"] == int(cfg.server.grpc_address.rpartition(":")[2])
    assert ports["http"]["containerPort"] == int(cfg.server.http_address.rpartition(":")[2])
    assert all(p["hostPort"] == p["containerPort"] for p in ports.values())


def test_probes_hit_the_sidecar_endpoints():
    assert SIDECAR["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert SIDECAR["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert SIDECAR["startupProbe"]["grpc"]["port"] == next(
        p["containerPort"] for p in SIDECAR["ports"] if p["name"] == "grpc"
    )
    ann = DS["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == "/metrics" and ann["prometheus.io/port"] == "8080"


def test_inference_pods_share_ipc_and_uid_with_the_sidecar_and_reach_it_on_the_node():
    uid = topo.Dockerfile().stages["sidecar"].user.split(":")[0]
    assert POD["hostIPC"] is True and str(POD["securityContext"]["runAsUser"]) == uid
    job = OBJ[("Job", "prefill-decode-example")]["spec"]["template"]["spec"]
    assert job["hostIPC"] is True and str(job["securityContext"]["runAsUser"]) == uid
    grpc_port = next(p["hostPort"] for p in SIDECAR["ports"] if p["name"] == "grpc")
    for c in job["initContainers"] + job["containers"]:
        assert f"grpc://$(HOST_IP):{grpc_port}" in c["args"]
        env = {e["name"]: e for e in c["env"]}
        assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
        assert env["KVSTORE_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "kvstore-token", "key": "token"}
    selector = OBJ[("Service", "kvstore-sidecar")]["spec"]["selector"]
    assert selector.items() <= DS["spec"]["template"]["metadata"]["labels"].items()


def pod_env(container: dict, downward: dict[str, str], secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: values, fieldRefs, secretKeyRefs, and
    ``$(VAR)`` expanded from the entries before it (only those: Kubernetes' rule)."""
    out: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            value = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e["valueFrom"]:
            value = downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            value = secrets[(ref["name"], ref["key"])]
        out[e["name"]] = value
    return out


def test_sidecars_form_one_cluster_named_after_their_nodes(tmp_path: Path):
    secret = OBJ[("Secret", "kvstore-token")]["stringData"]
    secrets = {("kvstore-token", k): f"{k}-value" for k in secret}
    env = pod_env(SIDECAR, {"status.hostIP": "10.1.2.3", "spec.nodeName": "gpu-node-7"}, secrets)
    assert "$(" not in "".join(env.values()), "every $(VAR) refers to an earlier entry"
    toml = tmp_path / "kvstore.toml"
    toml.write_text(OBJ[("ConfigMap", "kvstore-config")]["data"]["kvstore.toml"])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = load_config(toml)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    c = cfg.cluster
    assert c.enabled and c.node_id == "gpu-node-7" and c.token == "cluster-token-value"
    assert c.token != cfg.server.auth_token, "the peer path's secret is not the API token"
    peer = next(p for p in SIDECAR["ports"] if p["name"] == "peer")
    assert peer["hostPort"] == peer["containerPort"] == int(c.peer_address.rpartition(":")[2])
    assert c.advertise_address == f"10.1.2.3:{peer['hostPort']}", "other nodes reach it at its node's address"
    # the directory: the kvstore-directory Service in the kustomization's namespace
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    svc = OBJ[("Service", "kvstore-directory")]
    url = urllib.parse.urlparse(c.directory_url)
    assert url.hostname == f"{svc['metadata']['name']}.{kust['namespace']}.svc"
    assert url.port == svc["spec"]["ports"][0]["port"] and not c.directory_cluster
    dep = OBJ[("Deployment", "kvstore-directory")]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    [redis] = dep["spec"]["template"]["spec"]["containers"]
    assert redis["args"][0] == "redis-server" and "allkeys-lru" in redis["args"]
    assert redis["ports"][0]["name"] == svc["spec"]["ports"][0]["targetPort"]
    maxmemory = redis["args"][redis["args"].index("--maxmemory") + 1]
    limit = redis["resources"]["limits"]["memory"]
    assert maxmemory.endswith("gb") and limit.endswith("Mi")
    assert int(maxmemory[:-2]) << 30 < int(limit[:-2]) << 20, "Redis' own overhead fits under the memory limit"


def test_the_grace_period_outlasts_the_sidecars_stop_with_its_drain(tmp_path: Path, monkeypatch):
    """The kubelet's SIGKILL comes after the sidecar's stop may have ended: the gRPC grace, the
    drain of DRAM's blocks to the SSD (server.drain_s) and the watchdog's bound."""
    toml = tmp_path / "kvstore.toml"
    toml.write_text(OBJ[("ConfigMap", "kvstore-config")]["data"]["kvstore.toml"])
    monkeypatch.setenv("KVSTORE_CLUSTER__TOKEN", "t" * 16)  # (the DaemonSet's, from a Secret)
    cfg = load_config(toml)
    assert cfg.server.drain_s > 0
    assert POD["terminationGracePeriodSeconds"] > cfg.server.stop_bound_s()
