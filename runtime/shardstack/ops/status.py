"""One view of the cluster (`shardstack status`, docs/operations.md "Status"): nodes from the inventory with
Prometheus' `up` and the cordon state, failed systemd units (node_exporter's systemd collector), the training job's
metrics, the inference backends from HAProxy's stats CSV, and the alerts firing. A source that does not answer is
named in `notes`; the rest is still shown."""

from __future__ import annotations

import csv
import io
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops import cluster

NODE_GROUPS = ("train_nodes", "inference_nodes", "loadbalancer", "monitoring_server", "storage_server")
TRAIN_METRICS = {"step": "shardstack_train_step", "loss": "shardstack_train_loss",
                 "tokens_per_second": "shardstack_train_tokens_per_second",
                 "last_step_timestamp": "shardstack_train_last_step_timestamp_seconds"}


@dataclass
class Status:
    nodes: list[dict[str, Any]] = field(default_factory=list)
    failed_units: list[dict[str, str]] | None = None  # None: node_exporter's systemd collector is not scraped
    training: list[dict[str, Any]] = field(default_factory=list)
    backends: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sources(inv: dict[str, Any]) -> tuple[str | None, str | None]:
    """Prometheus on the first monitoring_server and HAProxy's stats on the first loadbalancer, as URLs."""
    groups = inv["groups"]
    prometheus = haproxy = None
    if groups.get("monitoring_server"):
        port = cluster.setting(inv, "prometheus_port", "prometheus", "monitoring_server")
        prometheus = f"http://{cluster.address(inv, groups['monitoring_server'][0])}:{port}"
    if groups.get("loadbalancer"):
        port = cluster.setting(inv, "loadbalancer_stats_port", "loadbalancer", "loadbalancer")
        haproxy = f"http://{cluster.address(inv, groups['loadbalancer'][0])}:{port}"
    return prometheus, haproxy


def _get(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise ShardstackError(f"{url}: {getattr(exc, 'reason', exc)}") from None


def prom_query(base: str, promql: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """An instant query's result vector: [{"metric": {labels}, "value": [ts, "v"]}, …]."""
    body = json.loads(_get(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}", timeout))
    if body.get("status") != "success":
        raise ShardstackError(f"Prometheus refused {promql!r}: {body.get('error', body)}")
    return list(body["data"]["result"])


def haproxy_servers(base: str, backend: str = "inference", timeout: float = 5.0) -> list[dict[str, Any]]:
    """The backend's servers from HAProxy's stats CSV (`/stats;csv`): status, current sessions, requests/s."""
    text = _get(f"{base}/stats;csv", timeout).decode()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return [{"server": r["svname"], "status": r["status"], "sessions": int(r["scur"] or 0),
             "req_rate": int(r["rate"] or 0), "check": r.get("check_status", "")}
            for r in rows if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")]


def collect(groups: dict[str, list[str]], cordoned: dict[str, dict[str, Any]], prometheus: str | None,
            haproxy: str | None) -> Status:
    status = Status()
    hosts = sorted({h for g in NODE_GROUPS for h in groups.get(g, [])})
    up: dict[str, bool] = {}
    if prometheus is None:
        status.notes.append("no monitoring_server in the inventory: no Prometheus data")
    else:
        try:
            up = {r["metric"].get("node", ""): r["value"][1] == "1" for r in prom_query(prometheus, 'up{job="node"}')}
            _prometheus_parts(prometheus, status)
        except ShardstackError as exc:
            status.notes.append(f"Prometheus: {exc}")
    gpu_alerts: dict[str, list[str]] = {}
    for alert in status.alerts:
        if alert["name"].startswith(("GPU", "Xid")) and alert["node"]:
            gpu_alerts.setdefault(alert["node"], []).append(alert["name"])
    for host in hosts:
        status.nodes.append({
            "node": host, "groups": [g for g in NODE_GROUPS if host in groups.get(g, [])],
            "up": up.get(host), "cordoned": cordoned.get(host, {}).get("action"),
            "gpu_alerts": sorted(set(gpu_alerts.get(host, []))),
        })
    if haproxy is None:
        status.notes.append("no loadbalancer in the inventory: no backend data")
    else:
        try:
            status.backends = haproxy_servers(haproxy)
        except ShardstackError as exc:
            status.notes.append(f"HAProxy: {exc}")
    return status


def _prometheus_parts(base: str, status: Status) -> None:
    if prom_query(base, "count(node_systemd_unit_state)"):
        status.failed_units = sorted(
            ({"node": r["metric"].get("node", ""), "unit": r["metric"].get("name", "")}
             for r in prom_query(base, 'node_systemd_unit_state{state="failed"} == 1')),
            key=lambda u: (u["node"], u["unit"]))
    else:
        status.notes.append("node_exporter's systemd collector is not scraped: failed units not shown")
    by_node: dict[str, dict[str, Any]] = {}
    for key, metric in TRAIN_METRICS.items():
        for r in prom_query(base, metric):
            entry = by_node.setdefault(r["metric"].get("node", r["metric"].get("instance", "")), {})
            entry[key] = float(r["value"][1])
    status.training = [{"node": n, **v} for n, v in sorted(by_node.items())]
    body = json.loads(_get(f"{base}/api/v1/alerts", 5.0))
    status.alerts = sorted(
        ({"name": a["labels"].get("alertname", ""), "severity": a["labels"].get("severity", ""),
          "node": a["labels"].get("node", ""), "summary": a.get("annotations", {}).get("summary", "")}
         for a in body.get("data", {}).get("alerts", []) if a.get("state") == "firing"),
        key=lambda a: (a["severity"] != "critical", a["name"], a["node"]))
