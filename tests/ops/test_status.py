"""`shardstack status`'s data from a loopback HTTP server answering with recorded Prometheus API responses (the
shapes of /api/v1/query and /api/v1/alerts, Prometheus 2.x/3.x) and HAProxy's stats CSV."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator

import pytest
from rich.console import Console
from shardstack.cli import status as status_cli
from shardstack.ops import status as status_ops


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
}
ALERTS = {"status": "success", "data": {"alerts": [
    {"labels": {"alertname": "GPUHealthUncorrectableECC", "severity": "critical", "node": "t1", "gpu": "1"},
     "annotations": {"summary": "GPU 1 on t1 has 2 uncorrectable ECC errors"}, "state": "firing",
     "activeAt": "2026-12-01T09:58:00Z", "value": "2e+00"},
    {"labels": {"alertname": "Watchdog", "severity": "none"}, "annotations": {"summary": "Always firing"},
     "state": "firing", "activeAt": "2026-12-01T08:00:00Z", "value": "1e+00"},
    {"labels": {"alertname": "NodeDown", "severity": "critical", "node": "i1"}, "annotations": {"summary": "x"},
     "state": "pending", "activeAt": "2026-12-01T10:00:00Z", "value": "0e+00"},
]}}
# HAProxy 2.6's `show stat` / `/stats;csv` header (first 40 of its columns) and three rows.
HEADER = ("# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,"
          "weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttle,lbtot,tracked,type,rate,"
          "rate_lim,rate_max,check_status,check_code,check_duration,hrsp_1xx,")
CSV = "\n".join([
    HEADER,
    "inference,FRONTEND,,,3,9,2000,812,1,2,0,0,0,,,,,OPEN,,,,,,,,,1,2,0,,,,0,7,0,15,,,,0,",
    "inference,i1,0,0,0,2,,401,1,2,,0,,0,0,0,0,DRAIN,1,1,0,0,0,35,0,,1,3,1,,401,,2,0,,9,L7OK,200,1,0,",
    "inference,i2,0,0,3,7,,411,1,2,,0,,0,0,0,0,UP,1,1,0,0,0,900,0,,1,3,2,,411,,2,7,,8,L7OK,200,1,0,",
    "inference,BACKEND,0,0,3,9,200,812,1,2,0,0,,0,0,0,0,UP,2,2,0,,0,900,0,,1,3,0,,812,,1,7,,15,,,,0,",
    "stats,FRONTEND,,,1,2,2000,50,1,2,0,0,0,,,,,OPEN,,,,,,,,,1,4,0,,,,0,1,0,2,,,,0,",
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
        elif url.path == "/stats;csv":
            body, kind = CSV.encode(), "text/csv"
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
    st = status_ops.collect(GROUPS, {"i1": {"action": "cordon", "roles": ["inference"]}}, server, server)
    nodes = {n["node"]: n for n in st.nodes}
    assert list(nodes) == ["i1", "i2", "lb", "t1"]
    assert nodes["t1"]["up"] is True and nodes["i1"]["up"] is False and nodes["i2"]["up"] is None
    assert nodes["i1"]["cordoned"] == "cordon" and nodes["t1"]["cordoned"] is None
    assert nodes["t1"]["gpu_alerts"] == ["GPUHealthUncorrectableECC"]
    assert nodes["lb"]["groups"] == ["loadbalancer", "monitoring_server"]
    assert st.failed_units == [{"node": "i1", "unit": "shardstack-inference.service"}]
    assert st.training == [{"node": "t1", "step": 1200.0, "loss": 2.8125, "tokens_per_second": 51234.5,
                            "last_step_timestamp": 1764583199.0}]
    assert st.backends == [
        {"server": "i1", "status": "DRAIN", "sessions": 0, "req_rate": 0, "check": "L7OK"},
        {"server": "i2", "status": "UP", "sessions": 3, "req_rate": 7, "check": "L7OK"}]
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
    st = status_ops.collect(GROUPS, {"t1": {"action": "drain", "roles": ["train"]}}, server, server)
    out = Console(width=200, record=True)
    out.print(status_cli.table(st))
    text = out.export_text()
    assert "up drained" in text and "DRAIN" in text and "step 1200, loss 2.8125, 51234 tokens/s" in text
    assert "GPUHealthUncorrectableECC" in text and "shardstack-inference.service" in text


def test_sources_from_the_inventory() -> None:
    inv = {"groups": GROUPS, "hostvars": {"lb": {"ansible_host": "10.0.0.5"}}}
    assert status_ops.sources(inv) == ("http://10.0.0.5:9090", "http://10.0.0.5:8404")
    inv = {"groups": {**GROUPS, "monitoring_server": []},
           "hostvars": {"lb": {"ansible_host": "10.0.0.5", "loadbalancer_stats_port": 9404}}}
    assert status_ops.sources(inv) == (None, "http://10.0.0.5:9404")
