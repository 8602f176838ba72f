"""`shardstack status`'s data from a loopback HTTP server answering with recorded Prometheus API responses (the
shapes of /api/v1/query and /api/v1/alerts, Prometheus 2.x/3.x) and HAProxy's Prometheus exporter."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from shardstack.cli import main as cli_main
from shardstack.cli import status as status_cli
from shardstack.errors import ShardstackError
from shardstack.ops import status as status_ops
from shardstack.ops.inventory import Cluster
from shardstack.ops.replicas import ReplicaJob


def _vector(*samples: tuple[dict[str, str], str]) -> dict:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": m, "value": [1764583200.123, v]} for m, v in samples]}}


T = {"job": "trainer", "instance": "t1:9400"}
PROMETHEUS = {
    'up{job="node"}': _vector(({"__name__": "up", "job": "node", "instance": "t1:9100", "node": "t1"}, "1"),
                              ({"__name__": "up", "job": "node", "instance": "i1:9100", "node": "i1"}, "0")),
    "count(node_systemd_unit_state)": _vector(({}, "412")),
    'node_systemd_unit_state{state="failed"} == 1': _vector(
        ({"__name__": "node_systemd_unit_state", "job": "node", "node": "i1", "name": "shardstack-inference.service",
          "state": "failed", "type": "notify"}, "1")),
    "shardstack_train_step": _vector(({**T, "node": "t1", "__name__": "shardstack_train_step"}, "1200")),
    "shardstack_train_loss": _vector(({**T, "node": "t1", "__name__": "shardstack_train_loss"}, "2.8125")),
    "shardstack_train_tokens_per_second": _vector(({**T, "node": "t1"}, "51234.5")),
    "shardstack_train_last_step_timestamp_seconds": _vector(({**T, "node": "t1"}, "1764583199")),
    "shardstack_train_step_seconds": _vector(({**T, "node": "t1"}, "0.5")),
    "shardstack_train_end_step": _vector(({**T, "node": "t1"}, "5000")),
    "shardstack_train_last_checkpoint_step": _vector(({**T, "node": "t1"}, "1000")),
    status_ops.BACKEND_METRICS["requests_per_second"]: _vector(({"node": "i1"}, "0"), ({"node": "i2"}, "12.25")),
    # i1 is drained: no request in the window, so the quantile is NaN.
    status_ops.BACKEND_METRICS["p99_seconds"]: _vector(({"node": "i1"}, "NaN"), ({"node": "i2"}, "0.84")),
    status_ops.BACKEND_METRICS["engine_waiting"]: _vector(({"node": "i1"}, "0"), ({"node": "i2"}, "2")),
    # i2 runs vLLM: its KV-cache use and vllm:* series.
    status_ops.BACKEND_METRICS["kv_cache_usage"]: _vector(({"node": "i2"}, "0.375")),
    status_ops.BACKEND_METRICS["vllm"]: _vector(({"node": "i2"}, "1")),
}
# The autoscaler's textfile metrics as Prometheus has them (tests/ops/test_autoscale.py scrapes the real file).
A = {"job": "node", "instance": "lb:9100", "node": "lb"}
AUTOSCALER = _vector(
    ({**A, "__name__": "shardstack_autoscale_replicas", "kind": "current"}, "2"),
    ({**A, "__name__": "shardstack_autoscale_replicas", "kind": "wanted"}, "2"),
    ({**A, "__name__": "shardstack_autoscale_min_replicas"}, "1"),
    ({**A, "__name__": "shardstack_autoscale_max_replicas"}, "2"),
    ({**A, "__name__": "shardstack_autoscale_floor"}, "1"),
    ({**A, "__name__": "shardstack_autoscale_saturated"}, "1"),
    ({**A, "__name__": "shardstack_autoscale_last_decision_timestamp_seconds"}, "1764583190"),
    ({**A, "__name__": "shardstack_autoscale_change_timestamp_seconds", "n": "1", "action": "up",
      "from_replicas": "1", "to_replicas": "2", "reason": "saturated: waiting 3.0/replica > 1"}, "1764583000"))
ALERTS = {"status": "success", "data": {"alerts": [
    {"labels": {"alertname": "GPUHealthUncorrectableECC", "severity": "critical", "node": "t1", "gpu": "1"},
     "annotations": {"summary": "GPU 1 on t1 has 2 uncorrectable ECC errors"}, "state": "firing",
     "activeAt": "2026-12-01T09:58:00Z", "value": "2e+00"},
    {"labels": {"alertname": "Watchdog", "severity": "none"}, "annotations": {"summary": "Always firing"},
     "state": "firing", "activeAt": "2026-12-01T08:00:00Z", "value": "1e+00"},
    {"labels": {"alertname": "NodeDown", "severity": "critical", "node": "i1"}, "annotations": {"summary": "x"},
     "state": "pending", "activeAt": "2026-12-01T10:00:00Z", "value": "0e+00"},
]}}
# HAProxy 2.6's Prometheus exporter (`/metrics?scope=server`, the metrics listener), the families status reads
# (abridged: the exporter writes every family for every server, grouped by family; the order does not matter here).
METRICS = "\n".join([
    "# HELP haproxy_server_status Current status of the service, per state label value.",
    "# TYPE haproxy_server_status gauge",
    "# HELP haproxy_server_current_sessions Number of current sessions on the frontend, backend or server",
    "# TYPE haproxy_server_current_sessions gauge",
    'haproxy_server_current_sessions{proxy="inference",server="i1"} 0',
    'haproxy_server_current_queue{proxy="inference",server="i1"} 0',
    'haproxy_server_sessions_total{proxy="inference",server="i1"} 401',
    'haproxy_server_status{proxy="inference",server="i1",state="DOWN"} 0',
    'haproxy_server_status{proxy="inference",server="i1",state="UP"} 0',
    'haproxy_server_status{proxy="inference",server="i1",state="MAINT"} 0',
    'haproxy_server_status{proxy="inference",server="i1",state="DRAIN"} 1',
    'haproxy_server_status{proxy="inference",server="i1",state="NOLB"} 0',
    'haproxy_server_check_status{proxy="inference",server="i1",state="L4CON"} 0',
    'haproxy_server_check_status{proxy="inference",server="i1",state="L7OK"} 1',
    'haproxy_server_check_status{proxy="inference",server="i1",state="L7STS"} 0',
    'haproxy_server_current_sessions{proxy="inference",server="i2"} 3',
    'haproxy_server_current_queue{proxy="inference",server="i2"} 1',
    'haproxy_server_sessions_total{proxy="inference",server="i2"} 411',
    'haproxy_server_status{proxy="inference",server="i2",state="DOWN"} 0',
    'haproxy_server_status{proxy="inference",server="i2",state="UP"} 1',
    'haproxy_server_status{proxy="inference",server="i2",state="MAINT"} 0',
    'haproxy_server_status{proxy="inference",server="i2",state="DRAIN"} 0',
    'haproxy_server_status{proxy="inference",server="i2",state="NOLB"} 0',
    'haproxy_server_check_status{proxy="inference",server="i2",state="L4CON"} 0',
    'haproxy_server_check_status{proxy="inference",server="i2",state="L7OK"} 1',
    'haproxy_server_check_status{proxy="inference",server="i2",state="L7STS"} 0',
    'haproxy_server_current_sessions{proxy="other",server="i1"} 0',
    'haproxy_server_current_queue{proxy="other",server="i1"} 0',
    'haproxy_server_sessions_total{proxy="other",server="i1"} 0',
    'haproxy_server_status{proxy="other",server="i1",state="DOWN"} 1',
    'haproxy_server_status{proxy="other",server="i1",state="UP"} 0',
    'haproxy_server_status{proxy="other",server="i1",state="MAINT"} 0',
    'haproxy_server_status{proxy="other",server="i1",state="DRAIN"} 0',
    'haproxy_server_status{proxy="other",server="i1",state="NOLB"} 0',
    'haproxy_server_check_status{proxy="other",server="i1",state="L4CON"} 1',
    'haproxy_server_check_status{proxy="other",server="i1",state="L7OK"} 0',
    'haproxy_server_check_status{proxy="other",server="i1",state="L7STS"} 0',
    'haproxy_server_max_session_rate{proxy="inference",server="i2"} 15',
]) + "\n"


class Recorded(http.server.ThreadingHTTPServer):
    daemon_threads = True


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/api/v1/query":
            query = urllib.parse.parse_qs(url.query)["query"][0]
            body = json.dumps(PROMETHEUS.get(query, _vector())).encode()
            kind = "application/json"
        elif url.path == "/api/v1/alerts":
            body, kind = json.dumps(ALERTS).encode(), "application/json"
        elif url.path == "/metrics" and url.query == "scope=server":
            body, kind = METRICS.encode(), "text/plain; version=0.0.4"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    srv = Recorded(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


GROUPS = {"train_nodes": ["t1"], "inference_nodes": ["i1", "i2"], "loadbalancer": ["lb"],
          "monitoring_server": ["lb"]}


def test_collect_everything(server: str) -> None:
    st = status_ops.collect(GROUPS, {"i1": {"action": "cordon", "roles": ["inference"]}}, server,
                            f"{server}/metrics")
    nodes = {n["node"]: n for n in st.nodes}
    assert list(nodes) == ["i1", "i2", "lb", "t1"]
    assert nodes["t1"]["up"] is True and nodes["i1"]["up"] is False and nodes["i2"]["up"] is None
    assert nodes["i1"]["cordoned"] == "cordon" and nodes["t1"]["cordoned"] is None
    assert nodes["t1"]["gpu_alerts"] == ["GPUHealthUncorrectableECC"]
    assert nodes["lb"]["groups"] == ["loadbalancer", "monitoring_server"]
    assert st.failed_units == [{"node": "i1", "unit": "shardstack-inference.service"}]
    # ETA: the 3800 steps left at the last step's 0.5 s.
    assert st.training == [{"node": "t1", "step": 1200.0, "loss": 2.8125, "tokens_per_second": 51234.5,
                            "step_seconds": 0.5, "end_step": 5000.0, "last_checkpoint_step": 1000.0,
                            "last_step_timestamp": 1764583199.0, "eta_seconds": 1900.0}]
    assert st.backends == [
        {"server": "i1", "status": "DRAIN", "sessions": 0, "queued": 0, "sessions_total": 401, "check": "L7OK",
         "requests_per_second": 0.0, "p99_seconds": None, "engine_waiting": 0.0, "kv_cache_usage": None,
         "engine": "builtin"},
        {"server": "i2", "status": "UP", "sessions": 3, "queued": 1, "sessions_total": 411, "check": "L7OK",
         "requests_per_second": 12.25, "p99_seconds": 0.84, "engine_waiting": 2.0, "kv_cache_usage": 0.375,
         "engine": "vllm"}]
    # Firing only (pending is not), critical first.
    assert [(a["name"], a["node"]) for a in st.alerts] == [("GPUHealthUncorrectableECC", "t1"), ("Watchdog", "")]
    assert st.notes == []
    assert json.loads(json.dumps(st.to_dict()))["backends"][0]["status"] == "DRAIN"


def test_no_systemd_collector_and_unreachable_sources(server: str) -> None:
    saved = PROMETHEUS.pop("count(node_systemd_unit_state)")
    try:
        st = status_ops.collect(GROUPS, {}, server, "http://127.0.0.1:9")
    finally:
        PROMETHEUS["count(node_systemd_unit_state)"] = saved
    assert st.failed_units is None
    assert any("systemd collector is not scraped" in n for n in st.notes)
    assert any(n.startswith("HAProxy: http://127.0.0.1:9") for n in st.notes) and st.backends == []

    st = status_ops.collect(GROUPS, {}, "http://127.0.0.1:9", None)
    assert any(n.startswith("Prometheus: ") for n in st.notes)
    assert any("no loadbalancer" in n for n in st.notes)
    assert [n["up"] for n in st.nodes] == [None] * 4 and st.alerts == []


def test_status_table(server: str) -> None:
    st = status_ops.collect(GROUPS, {"t1": {"action": "drain", "roles": ["train"]}}, server,
                            f"{server}/metrics")
    out = Console(width=200, record=True)
    out.print(status_cli.table(st))
    text = out.export_text()
    assert "up drained" in text and "DRAIN" in text
    assert "step 1200/5000, loss 2.8125, 51234 tokens/s, last checkpoint 1000, ETA 31m40s" in text
    assert "GPUHealthUncorrectableECC" in text and "shardstack-inference.service" in text
    assert ("vllm: 12.2 req/s, p99 0.840 s, 2 waiting, KV cache 38%; 3 sessions, 1 queued at the edge, 411 since "
            "start") in text
    assert "- req/s, p99 - s" not in text and "builtin: 0.0 req/s, p99 - s, 0 waiting; 0 sessions" in text


def test_replicas_and_the_autoscaler(server: str) -> None:
    jobs = [ReplicaJob(31, "RUNNING", "i2", "2026-12-01T10:00:00"), ReplicaJob(34, "PENDING", "", "2026-12-01T10:05")]
    PROMETHEUS['{__name__=~"shardstack_autoscale_.+"}'] = AUTOSCALER
    try:
        st = status_ops.collect(GROUPS, {}, server, f"{server}/metrics", lambda: jobs)
    finally:
        del PROMETHEUS['{__name__=~"shardstack_autoscale_.+"}']
    assert [(r["job_id"], r["state"], r["node"]) for r in st.replicas] == [(31, "RUNNING", "i2"), (34, "PENDING", "")]
    assert st.autoscaler["saturated"] is True and st.autoscaler["changes"][0]["to"] == 2
    out = Console(width=200, record=True)
    out.print(status_cli.table(st))
    text = out.export_text()
    assert "job 31" in text and "running" in text and "on i2" in text and "job 34" in text
    assert "2 replica(s), wants 2; 1..2, floor 1, decided" in text and "saturated" in text
    assert "up 1→2" in text and "saturated: waiting 3.0/replica > 1" in text

    def unreachable() -> list[ReplicaJob]:
        raise ShardstackError("squeue failed on the Slurm controller n1: slurmctld down", hint="check it")

    st = status_ops.collect(GROUPS, {}, server, None, unreachable)
    assert st.replicas is None and st.autoscaler is None
    assert "Slurm: squeue failed on the Slurm controller n1: slurmctld down; hint: check it" in st.notes


def test_sources_from_the_inventory() -> None:
    inv = Cluster(Path("hosts.yml"), GROUPS, {"lb": {"ansible_host": "10.0.0.5"}})
    # HAProxy's metrics listener (plain HTTP, open to the admin networks), not the stats page (TLS + password).
    assert status_ops.sources(inv) == ("http://10.0.0.5:9090", "http://10.0.0.5:8405/metrics")
    inv = Cluster(Path("hosts.yml"), {**GROUPS, "monitoring_server": []},
                  {"lb": {"ansible_host": "10.0.0.5", "loadbalancer_metrics_port": 9405}})
    assert status_ops.sources(inv) == (None, "http://10.0.0.5:9405/metrics")


def _inventory(tmp_path: Path, server: str) -> Path:
    """GROUPS with the monitoring server and the load balancer at the loopback server's address and port."""
    port = int(server.rsplit(":", 1)[1])
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "vars": {"prometheus_port": port, "loadbalancer_metrics_port": port},
        "children": {g: {"hosts": {h: {"ansible_host": "127.0.0.1"} for h in hosts}} for g, hosts in GROUPS.items()},
    }}))
    return inv


def test_status_exits_1_with_a_node_down_or_a_critical_alert(server: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """The documented exit codes: 1 when Prometheus sees a node DOWN or a critical alert fires, in --json and the
    table alike; 0 once both are gone (a node of unknown state and a non-critical alert do not count)."""
    inv = str(_inventory(tmp_path, server))
    assert cli_main(["status", "-i", inv, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["problems"] == ["node i1 DOWN", "critical alert GPUHealthUncorrectableECC on t1"]
    assert cli_main(["status", "-i", inv]) == 1
    assert "unhealthy: node i1 DOWN" in capsys.readouterr().err
    saved_up, saved_alerts = PROMETHEUS['up{job="node"}'], ALERTS["data"]["alerts"]
    PROMETHEUS['up{job="node"}'] = _vector(({"job": "node", "node": "t1"}, "1"), ({"job": "node", "node": "i1"}, "1"))
    ALERTS["data"]["alerts"] = [a for a in saved_alerts if a["labels"]["severity"] != "critical"]
    try:
        assert cli_main(["status", "-i", inv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["problems"] == []
        assert cli_main(["status", "-i", inv]) == 0
    finally:
        PROMETHEUS['up{job="node"}'], ALERTS["data"]["alerts"] = saved_up, saved_alerts
