"""deploy/k8s: the sidecar DaemonSet next to the inference pods, checked without a cluster."""

from __future__ import annotations

import os
import tomllib
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
    listed = set(kust["resources"])
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
