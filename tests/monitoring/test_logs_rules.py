"""The central-logs alerts (roles/prometheus/files/rules/logs.rules.yml): they exist, and their unit tests catch the
rules written the naive way. The promtool runs of every rule file and its tests are test_rules.py's."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from .conftest import DASHBOARDS_DIR, RULES_DIR
from .test_rules import _mutated

LOG_ALERTS = {"NodeLogsNotArriving", "NodeLogsNeverArrived", "LogCollectorMetricsStale", "LogStoreOverLimit"}


def test_the_log_alerts_exist() -> None:
    rules = [r for g in yaml.safe_load((RULES_DIR / "logs.rules.yml").read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules if "alert" in r} == LOG_ALERTS


def test_silence_from_a_node_that_is_down_is_left_to_node_down(tmp_path: Path) -> None:
    # Without the `unless … up == 0` clause the down node n4 fires too, and the tests must say so.
    out = _mutated(tmp_path, "logs.rules.yml", '\n          unless on (node) (up{job="node"} == 0)', "",
                   "logs.test.yml")
    assert "NodeLogsNotArriving" in out and "n4" in out


def test_the_sender_not_the_collector_is_named(tmp_path: Path) -> None:
    # The textfile is scraped from the collector: without relabelling `host` to `node`, every series is the
    # collector's and one silent node hides among them.
    out = _mutated(tmp_path, "logs.rules.yml",
                   'label_replace(shardstack_logs_last_received_timestamp_seconds, "node", "$1", "host", "(.+)")',
                   "shardstack_logs_last_received_timestamp_seconds", "logs.test.yml")
    assert "NodeLogsNotArriving" in out


def test_no_collector_no_never_arrived_alert(tmp_path: Path) -> None:
    out = _mutated(tmp_path, "logs.rules.yml",
                   "\n          and on () (count(shardstack_logs_collector_last_run_timestamp_seconds) > 0)", "",
                   "logs.test.yml")
    assert "NodeLogsNeverArrived" in out


def test_the_overview_dashboard_shows_the_logs_rate() -> None:
    d = json.loads((DASHBOARDS_DIR / "cluster-overview.json").read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    assert any("rate(shardstack_logs_received_entries_total" in e for e in exprs)
    assert any("shardstack:logs_last_received:timestamp" in e for e in exprs)
