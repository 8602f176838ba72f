"""One view of the cluster (`shardstack status`, docs/operations.md "Status"): nodes from the inventory with
Prometheus' `up` and the cordon state, failed systemd units (node_exporter's systemd collector), the training job's
metrics, the inference backends from HAProxy's Prometheus endpoint (its metrics listener, plain HTTP, which the
firewall opens to the monitoring server and the admin networks; the stats page wants TLS and a password), Slurm-run
replicas (squeue) and the autoscaler's last decisions, and the alerts firing. A source that does not answer is
named in `notes`; the rest is still shown."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.inventory import Cluster

NODE_GROUPS = ("train_nodes", "inference_nodes", "loadbalancer", "monitoring_server", "storage_server")
TRAIN_METRICS = {"step": "shardstack_train_step", "loss": "shardstack_train_loss",
                 "tokens_per_second": "shardstack_train_tokens_per_second",
                 "step_seconds": "shardstack_train_step_seconds", "end_step": "shardstack_train_end_step",
                 "last_checkpoint_step": "shardstack_train_last_checkpoint_step",
                 "last_step_timestamp": "shardstack_train_last_step_timestamp_seconds"}
# Per inference backend, from the service's own metrics (HAProxy 2.6 has no per-server request rate or latency);
# a vLLM backend's under the same names (Prometheus records them: roles/prometheus/files/rules/vllm.rules.yml).
BACKEND_METRICS = {
    "requests_per_second": 'sum by (node) (rate(shardstack_infer_requests_total{job="inference"}[1m]))',
    "p99_seconds": 'histogram_quantile(0.99, sum by (node, le) '
                   '(rate(shardstack_infer_request_duration_seconds_bucket{job="inference"}[5m])))',
    "engine_waiting": 'sum by (node) (shardstack_infer_requests_waiting{job="inference"})',
    "kv_cache_usage": 'max by (node) (shardstack_infer_kv_cache_usage_ratio{job="inference"})',
    "vllm": 'count by (node) (vllm:num_requests_running{job="inference"})',  # present: the node runs vLLM
}


@dataclass
class Status:
    nodes: list[dict[str, Any]] = field(default_factory=list)
    failed_units: list[dict[str, str]] | None = None  # None: node_exporter's systemd collector is not scraped
    training: list[dict[str, Any]] = field(default_factory=list)
    backends: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, str]] = field(default_factory=list)
    # Slurm-run inference replicas (inference_service_scheduled): their jobs; None where the nodes run their own.
    replicas: list[dict[str, Any]] | None = None
    # The autoscaler's last decision and its last changes (its textfile metrics); None: none reports.
    autoscaler: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """What makes `shardstack status` exit 1: nodes Prometheus sees DOWN and critical alerts firing. A node of
        unknown state (no Prometheus) is not counted: the notes say why it is unknown."""
        down = [f"node {n['node']} DOWN" for n in self.nodes if n["up"] is False]
        return down + [f"critical alert {a['name']}" + (f" on {a['node']}" if a["node"] else "")
                       for a in self.alerts if a["severity"] == "critical"]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "problems": self.problems()}


def sources(cluster: Cluster) -> tuple[str | None, str | None]:
    """Prometheus on the first monitoring_server and HAProxy's /metrics on the first loadbalancer, as URLs."""
    prometheus = haproxy = None
    if monitoring := cluster.hosts("monitoring_server"):
        port = cluster.setting("prometheus_port", "prometheus", "monitoring_server")
        prometheus = f"http://{cluster.address(monitoring[0])}:{port}"
    if lbs := cluster.hosts("loadbalancer"):
        port = cluster.setting("loadbalancer_metrics_port", "loadbalancer", "loadbalancer")
        haproxy = f"http://{cluster.address(lbs[0])}:{port}/metrics"
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


# One sample of HAProxy's Prometheus exporter: name{label="value",…} value
_SAMPLE = re.compile(r'^(haproxy_server_[a-z_]+)\{([^}]*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def haproxy_servers(metrics_url: str, backend: str = "inference", timeout: float = 5.0) -> list[dict[str, Any]]:
    """The backend's servers from HAProxy's Prometheus endpoint (`/metrics?scope=server`): state (UP, DOWN, DRAIN,
    MAINT, NOLB: the `state` label whose haproxy_server_status is 1), current sessions, requests waiting in HAProxy's
    queue for the server, sessions since HAProxy started, and the last health check's result."""
    text = _get(f"{metrics_url}?scope=server", timeout).decode()
    servers: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m[1], dict(_LABEL.findall(m[2])), m[3]
        if labels.get("proxy") != backend or "server" not in labels:
            continue
        entry = servers.setdefault(labels["server"], {"server": labels["server"], "status": "", "sessions": 0,
                                                      "queued": 0, "sessions_total": 0, "check": ""})
        if name == "haproxy_server_status" and float(value) == 1:
            entry["status"] = labels.get("state", "")
        elif name == "haproxy_server_check_status" and float(value) == 1:
            entry["check"] = labels.get("state", "")
        elif name == "haproxy_server_current_sessions":
            entry["sessions"] = int(float(value))
        elif name == "haproxy_server_current_queue":
            entry["queued"] = int(float(value))
        elif name == "haproxy_server_sessions_total":
            entry["sessions_total"] = int(float(value))
    return [servers[k] for k in sorted(servers)]


def collect(groups: dict[str, list[str]], cordoned: dict[str, dict[str, Any]], prometheus: str | None,
            haproxy: str | None, replica_jobs: Callable[[], list[Any]] | None = None) -> Status:
    """`replica_jobs`: where replicas are Slurm jobs, what lists them (ops.replicas.replicas on the cluster)."""
    status = Status()
    if replica_jobs is not None:
        try:
            status.replicas = [asdict(j) for j in replica_jobs()]
        except ShardstackError as exc:
            status.notes.append(f"Slurm: {exc}".replace("\n  hint:", "; hint:"))
    hosts = sorted({h for g in NODE_GROUPS for h in groups.get(g, [])})
    up: dict[str, bool] = {}
    served: dict[str, dict[str, float | None]] = {}  # inference node → BACKEND_METRICS
    if prometheus is None:
        status.notes.append("no monitoring_server in the inventory: no Prometheus data")
    else:
        try:
            up = {r["metric"].get("node", ""): r["value"][1] == "1" for r in prom_query(prometheus, 'up{job="node"}')}
            served = _prometheus_parts(prometheus, status)
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
    for b in status.backends:
        b.update({key: served.get(b["server"], {}).get(key) for key in BACKEND_METRICS})
        b["engine"] = "vllm" if b.pop("vllm") else "builtin" if b["server"] in served else None
    return status


def _prometheus_parts(base: str, status: Status) -> dict[str, dict[str, float | None]]:
    """Fills in units, training and alerts; returns the inference backends' figures by node."""
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
    for v in by_node.values():
        # The rest of the run at the last step's pace; None once it is done or when a gauge is missing.
        left = v.get("end_step", 0) - v.get("step", 0)
        v["eta_seconds"] = left * v["step_seconds"] if left > 0 and "step_seconds" in v else None
    status.training = [{"node": n, **v} for n, v in sorted(by_node.items())]
    served: dict[str, dict[str, float | None]] = {}
    for key, promql in BACKEND_METRICS.items():
        for r in prom_query(base, promql):
            value = float(r["value"][1])
            served.setdefault(r["metric"].get("node", ""), {})[key] = (
                value if value == value else None)  # NaN (no request in the window): no figure
    status.autoscaler = _autoscaler(prom_query(base, '{__name__=~"shardstack_autoscale_.+"}'))
    body = json.loads(_get(f"{base}/api/v1/alerts", 5.0))
    status.alerts = sorted(
        ({"name": a["labels"].get("alertname", ""), "severity": a["labels"].get("severity", ""),
          "node": a["labels"].get("node", ""), "summary": a.get("annotations", {}).get("summary", "")}
         for a in body.get("data", {}).get("alerts", []) if a.get("state") == "firing"),
        key=lambda a: (a["severity"] != "critical", a["name"], a["node"]))
    return served


def _autoscaler(series: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The autoscaler's textfile metrics (ops.autoscale.write_metrics) as one record; None when there are none."""
    if not series:
        return None
    out: dict[str, Any] = {"node": series[0]["metric"].get("node", series[0]["metric"].get("instance", "")),
                           "changes": []}
    for r in series:
        labels, value = r["metric"], float(r["value"][1])
        name = labels["__name__"].removeprefix("shardstack_autoscale_")
        if name == "replicas":
            out[labels.get("kind", "")] = int(value)
        elif name in ("min_replicas", "max_replicas", "floor"):
            out[name] = int(value)
        elif name == "saturated":
            out[name] = value == 1
        elif name == "last_decision_timestamp_seconds":
            out["last_decision"] = value
        elif name == "change_timestamp_seconds":
            out["changes"].append({"n": int(labels.get("n", 0)), "time": value, "action": labels.get("action", ""),
                                   "from": int(labels.get("from_replicas", 0)), "to": int(labels.get("to_replicas", 0)),
                                   "reason": labels.get("reason", "")})
    out["changes"].sort(key=lambda c: c["n"])
    return out
