"""deploy/grafana: the dashboard JSON loads as a Grafana dashboard, every query on every panel
names a metric a live sidecar's /metrics exports, and compose and Kubernetes provision it.

Schema: the Grafana Foundation SDK's dashboard model for Grafana 11.6 (``grafana-foundation-sdk``
on PyPI, Apache-2.0, offline) reads the JSON and writes it back with nothing lost or changed (a
misspelt or unknown field would be dropped); its loader checks no types, so a JSON Schema of the
fields Grafana needs to draw a panel (written here) checks those.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request

import deploy_topology as topo
import jsonschema
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client.parser import text_string_to_metric_families
from traffic import one_round

from kvstore.client import SyncClient
from kvstore.stats.latency import FAMILIES
from tests.support.sidecar_args import loopback_args

GRAFANA = topo.REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvstore.json"
DOC = json.loads(DASHBOARD.read_text())

# Metrics the dashboard may show before any sidecar exports them (another branch's work): each
# leaves this list when it lands. Empty: kvstore_retained_bytes, listed here until the retention
# hints (issue 32 parts 1-2) landed, is exported now.
NOT_YET_EXPORTED: set[str] = set()

_INT = {"type": "integer", "minimum": 0}
REQUIRED = {  # what Grafana needs of a provisioned dashboard to draw its panels and run their queries
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos"],
                "properties": {
                    "id": {"type": "integer"},
                    "type": {"enum": ["row", "timeseries", "stat", "gauge", "table", "bargauge", "heatmap"]},
                    "title": {"type": "string", "minLength": 1},
                    "gridPos": {
                        "type": "object",
                        "required": ["h", "w", "x", "y"],
                        "properties": {
                            "h": {"type": "integer", "minimum": 1},
                            "w": {"type": "integer", "minimum": 1, "maximum": 24},
                            "x": {"type": "integer", "minimum": 0, "maximum": 23},
                            "y": _INT,
                        },
                    },
                    "datasource": {
                        "type": "object",
                        "required": ["type", "uid"],
                        "properties": {"type": {"const": "prometheus"}},
                    },
                    "targets": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["refId", "expr"],
                            "properties": {
                                "refId": {"type": "string", "minLength": 1},
                                "expr": {"type": "string", "minLength": 1},
                                "legendFormat": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {"list": {"type": "array", "items": {"type": "object", "required": ["name", "type"]}}},
        },
    },
}


def panels() -> list[dict]:
    return [p for p in DOC["panels"] if p["type"] != "row"]


def test_the_dashboard_loads_as_a_grafana_dashboard():
    jsonschema.Draft202012Validator(REQUIRED).validate(DOC)
    model = Dashboard.from_json(DOC)
    again = json.loads(JSONEncoder().encode(model))

    def lost(a: object, b: object, path: str) -> list[str]:  # what the model dropped or changed
        if isinstance(a, dict) and isinstance(b, dict):
            return [p for k in a for p in (lost(a[k], b[k], f"{path}.{k}") if k in b else [f"{path}.{k}"])]
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [p for i, (x, y) in enumerate(zip(a, b)) for p in lost(x, y, f"{path}[{i}]")]
        return [] if a == b else [path]

    assert lost(DOC, again, "") == []
    ids = [p["id"] for p in DOC["panels"]]
    assert len(ids) == len(set(ids)) and all(
        len({t["refId"] for t in p["targets"]}) == len(p["targets"]) for p in panels()
    )
    titles = " | ".join(p["title"] for p in panels())
    for shown in (
        "Hit rate per tier",
        "RPC p99",
        "Promotion p50 / p99 by tier",
        "Occupancy",
        "Evictions",
        "Peer fetch rate and failures",
        "Retained bytes",
        "Directory round trips",
    ):
        assert shown in titles


# PromQL words that are not metric names: functions, aggregations, keywords
PROMQL_WORDS = {
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "by",
    "without",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "scalar",
    "ignoring",
    "on",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers once strings, label matchers,
    ranges and label lists (by/without/on/ignoring/group_*) are cut, less PromQL's own words."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", re.sub(r"\b\d+(\.\d+)?\b", " ", text)))
    return words - PROMQL_WORDS


def test_metric_names_are_read_out_of_promql():
    expr = 'histogram_quantile(0.99, sum by (le, tier) (rate(kvstore_x_bucket{a=~"b|c"}[$__rate_interval])))'
    assert metric_names(expr) == {"kvstore_x_bucket"}
    assert metric_names("sum(a_total) / ignoring(tier) group_left b > 0") == {"a_total", "b"}


LATENCY_SERIES = re.compile(r"\bkvstore_(\w+)_duration_seconds_(?:bucket|count|sum)\b")


def test_latency_queries_name_only_their_familys_labels():
    """A panel that filters or sums a latency family by a label the family does not have shows
    nothing and says nothing (``outcome="error"`` on a family timed by tier alone): every label a
    latency query names, in its matchers and its by/without lists, is one of its family's
    (kvstore/stats/latency.py), ``le`` or the scrape's ``instance``."""
    checked = 0
    for p in panels():
        for t in p["targets"]:
            families = set(LATENCY_SERIES.findall(t["expr"]))
            if not families:
                continue
            assert len(families) == 1, f"{p['title']}: one latency family a query, got {families}"
            [family] = families
            allowed = {*FAMILIES[family][0], "le", "instance"}
            text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', t["expr"])
            named = {m for sel in re.findall(r"\{([^}]*)\}", text) for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel)}
            named |= {w for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text) for w in re.findall(r"\w+", g)}
            assert named <= allowed, f"{p['title']}: {sorted(named - allowed)} not labels of {family} ({t['expr']})"
            checked += 1
    assert checked >= 6  # (rpc, promotion, demotion, write-through, peers, directory: all read)


def exported(text: str) -> set[str]:
    """Every series name the exposition offers a query: samples, and the names a family of its
    type has before its first sample (a histogram's _bucket, _count, _sum; a counter's _total)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
        names.update(
            {
                "histogram": [f"{fam.name}_bucket", f"{fam.name}_count", f"{fam.name}_sum"],
                "counter": [f"{fam.name}_total"],
            }.get(fam.type, [fam.name])
        )
    return names


def test_every_panel_query_names_a_metric_a_live_sidecar_exports(serve_process, tmp_path):
    sc = serve_process(loopback_args(tmp_path / "d", 8 << 20))
    with SyncClient(sc.grpc) as c:
        for r in range(3):
            one_round(c, r)
    with urllib.request.urlopen(f"http://{sc.http}/metrics") as r:
        names = exported(r.read().decode())
    assert "kvstore_rpc_duration_seconds_bucket" in names and "kvstore_tier_hits_total" in names
    used: set[str] = set()
    for p in panels():
        for t in p["targets"]:
            found = metric_names(t["expr"])
            assert found, f"{p['title']}: no metric in {t['expr']!r}"
            missing = found - names - NOT_YET_EXPORTED
            assert not missing, f"panel {p['title']!r} queries {sorted(missing)}, which /metrics does not export"
            used |= found
    assert used >= NOT_YET_EXPORTED, "a metric listed as not yet exported that no panel uses: drop it from the list"
    assert not NOT_YET_EXPORTED & names, "exported now: drop it from NOT_YET_EXPORTED"
    variable = next(v for v in DOC["templating"]["list"] if v["name"] == "instance")
    assert re.fullmatch(r"label_values\((\w+), instance\)", variable["query"]["query"])[1] in names


def test_compose_metrics_profile_provisions_grafana_with_prometheus_and_the_dashboard():
    svc = topo.load_compose({})["services"]["grafana"]
    assert svc["profiles"] == ["metrics"] and topo.depends_on(svc) == {"prometheus": "service_healthy"}
    mounts = {m.target: m.source for m in topo.mounts(svc)}
    provisioning = topo.REPO / mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    prometheus = topo.load_compose({})["services"]["prometheus"]
    port = next(p.container for p in topo.ports(prometheus))
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{port}" and source["isDefault"]
    [provider] = yaml.safe_load((provisioning / "dashboards" / "kvstore.yml").read_text())["providers"]
    assert (topo.REPO / mounts[provider["options"]["path"]] / DASHBOARD.name).samefile(DASHBOARD)
    env = topo.environment(svc)
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{provider['options']['path']}/{DASHBOARD.name}"
    datasource = next(v for v in DOC["templating"]["list"] if v["type"] == "datasource")
    assert datasource["query"] == source["type"]  # the variable offers the provisioned source


def test_kubernetes_manifests_carry_the_dashboard_as_a_configmap():
    k8s = yaml.safe_load((topo.REPO / "deploy" / "k8s" / "kustomization.yaml").read_text())
    assert "../grafana" in k8s["resources"]
    kust = yaml.safe_load((GRAFANA / "kustomization.yaml").read_text())
    [gen] = kust["configMapGenerator"]
    assert gen["files"] == [str(DASHBOARD.relative_to(GRAFANA))]
    assert kust["generatorOptions"]["labels"]["grafana_dashboard"] == "1"
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # the build itself needs kubectl (or kustomize); the structure is checked above
        return
    built = subprocess.run(
        [kubectl, "kustomize", str(topo.REPO / "deploy" / "k8s")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    cm = next(
        d for d in yaml.safe_load_all(built) if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == gen["name"]
    )
    assert cm["metadata"]["namespace"] == k8s["namespace"]
    assert json.loads(cm["data"][DASHBOARD.name]) == DOC
