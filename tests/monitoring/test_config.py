"""Scrape targets generated from an inventory, and the Prometheus/Alertmanager/Grafana files the roles write,
validated by the same tools the roles use on the node (promtool check config, amtool check-config)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_vars import load_module
from shardstack.lab.inventory import group_layout

from .conftest import DASHBOARDS_DIR, REPO, ROLES, RULES_DIR, load_filter_module, role_vars, run, tool

targets_filter = load_filter_module().scrape_targets
DEFAULT_JOBS = yaml.safe_load((REPO / "roles" / "prometheus" / "defaults" / "main.yml").read_text())[
    "prometheus_scrape_jobs"]


def inventory_groups(path: Path) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    """groups and hostvars of a YAML inventory, read with Ansible's own inventory manager."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    inv = InventoryManager(loader=loader, sources=[str(path)])
    vm = VariableManager(loader=loader, inventory=inv)
    groups = {name: [h.name for h in g.get_hosts()] for name, g in inv.groups.items()}
    hostvars = {h.name: vm.get_vars(host=h, include_hostvars=False) for h in inv.get_hosts()}
    return groups, hostvars


def flat(targets: dict[str, list[dict]]) -> dict[str, list[tuple[str, str]]]:
    return {job: [(g["labels"]["node"], g["targets"][0]) for g in groups] for job, groups in targets.items()}


def test_targets_from_the_sample_inventory() -> None:
    groups, hostvars = inventory_groups(REPO / "inventory" / "sample" / "hosts.yml")
    got = flat(targets_filter(DEFAULT_JOBS, groups, hostvars))
    assert sorted(got["node"]) == [("gpu01", "192.0.2.11:9100"), ("gpu02", "192.0.2.12:9100"),
                                   ("gpu03", "192.0.2.13:9100"), ("gpu04", "192.0.2.14:9100"),
                                   ("ops01", "192.0.2.31:9100"), ("store01", "192.0.2.21:9100")]
    # ops01 is both monitoring server and load balancer: scraped once per job, at the address it was given once.
    assert got["prometheus"] == [("ops01", "192.0.2.31:9090")]
    assert got["loadbalancer"] == [("ops01", "192.0.2.31:8405")]
    # c10d may put rank 0 (the one serving metrics) on any train node.
    assert got["trainer"] == [("gpu01", "192.0.2.11:9400"), ("gpu02", "192.0.2.12:9400")]
    assert got["inference"] == [("gpu03", "192.0.2.13:8000"), ("gpu04", "192.0.2.14:8000")]
    assert got["dcgm"] == []  # no host has recorded an active DCGM exporter


def test_dcgm_targets_follow_the_gate_facts() -> None:
    groups, hostvars = inventory_groups(REPO / "inventory" / "sample" / "hosts.yml")
    hostvars["gpu01"]["dcgm_exporter_active"] = True
    hostvars["gpu03"]["dcgm_exporter_active"] = "True"  # a fact templated to text still counts
    hostvars["gpu04"]["dcgm_exporter_active"] = False
    got = targets_filter(DEFAULT_JOBS, groups, hostvars)["dcgm"]
    assert [(g["labels"], g["targets"]) for g in got] == [
        ({"node": "gpu01", "train_node": "true"}, ["192.0.2.11:9401"]),
        ({"node": "gpu03", "train_node": "false"}, ["192.0.2.13:9401"]),
    ]


def test_replicas_slurm_runs_are_labelled_scheduled() -> None:
    groups, hostvars = inventory_groups(REPO / "inventory" / "sample" / "hosts.yml")
    node = groups["inference_nodes"][0]
    hostvars[node]["inference_service_scheduled"] = True
    got = {g["labels"]["node"]: g["labels"] for g in targets_filter(DEFAULT_JOBS, groups, hostvars)["inference"]}
    assert got[node].get("scheduled") == "true"
    assert all("scheduled" not in labels for host, labels in got.items() if host != node) and len(got) > 1
    node_job = targets_filter(DEFAULT_JOBS, groups, hostvars)["node"]
    assert all("scheduled" not in g["labels"] for g in node_job)  # only the job that names the variable


def test_targets_from_a_generated_lab_inventory() -> None:
    names = ["lab-n1", "lab-n2", "lab-n3"]
    layout = group_layout(names)
    groups = {"all": names, **layout}
    hostvars = {n: {"ansible_host": f"10.213.0.{11 + i}"} for i, n in enumerate(names)}
    got = targets_filter(DEFAULT_JOBS, groups, hostvars)
    assert [g["targets"][0] for g in got["node"]] == ["10.213.0.11:9100", "10.213.0.12:9100", "10.213.0.13:9100"]
    assert {g["labels"]["node"]: g["labels"]["train_node"] for g in got["node"]} == {
        n: ("true" if n in layout["train_nodes"] else "false") for n in names}
    assert [g["labels"]["node"] for g in got["trainer"]] == layout["train_nodes"]
    assert [g["labels"]["node"] for g in got["inference"]] == layout["inference_nodes"]


def test_target_address_override_ipv6_and_disabled_jobs() -> None:
    jobs = [{"name": "node", "groups": ["all"], "port": "9100"},
            {"name": "first", "groups": ["all"], "port": 1, "first_host_only": True},
            {"name": "inference", "groups": ["inference_nodes"], "port": 8000, "enabled": "false"}]
    groups = {"all": ["a", "b", "c"], "inference_nodes": ["a"]}
    hostvars = {"a": {"ansible_host": "192.0.2.1", "prometheus_target_address": "a.mgmt"},
                "b": {"ansible_host": "2001:db8::2"}, "c": {}}
    got = targets_filter(jobs, groups, hostvars)
    assert [g["targets"][0] for g in got["node"]] == ["a.mgmt:9100", "[2001:db8::2]:9100", "c:9100"]
    assert "inference" not in got
    assert [g["labels"]["node"] for g in got["first"]] == ["a"]


def test_duplicate_job_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        targets_filter([{"name": "node", "groups": ["all"], "port": 1}] * 2, {"all": ["a"]}, {})


def _render_prometheus(tmp_path: Path, **overrides: Any) -> Path:
    """Write what the prometheus role writes (rules, prometheus.yml with the targets) under tmp_path."""
    groups, hostvars = inventory_groups(REPO / "inventory" / "sample" / "hosts.yml")
    targets = targets_filter(DEFAULT_JOBS, groups, hostvars)
    (tmp_path / "rules").mkdir()
    role = role_vars("prometheus", role_path=str(ROLES / "prometheus"), __prometheus_config_dir=str(tmp_path),
                    __prometheus_targets=targets, **overrides)
    (tmp_path / "rules" / role["__prometheus_builtin_rules_file"]).write_text(role.render("shardstack.rules.yml.j2"))
    config = tmp_path / "prometheus.yml"
    config.write_text(role.render("prometheus.yml.j2"))
    # The cluster CA the role copies beside it, as shardstack_common's module creates it (promtool checks that the
    # https jobs' CA file is there).
    cc = load_module(ROLES / "shardstack_common" / "library" / "cluster_certificate.py")
    ca = Path(role["__prometheus_cluster_ca"])
    cc.apply(cc.plan_ca(ca, tmp_path / "ca.key"), ca, tmp_path / "ca.key", None, None, [],
             ca_common_name="test cluster CA", valid_days=1)
    return config


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    config = _render_prometheus(tmp_path)
    proc = run(tool("promtool"), "check", "config", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # promtool also loaded and checked the rule file the config points at: the role's rule set in one file.
    (built,) = (config.parent / "rules").iterdir()
    shipped = [g for p in sorted(RULES_DIR.glob("*.rules.yml")) for g in yaml.safe_load(p.read_text())["groups"]]
    assert yaml.safe_load(built.read_text())["groups"] == shipped
    assert "SUCCESS: 1 rule files found" in proc.stdout
    assert f"SUCCESS: {sum(len(g['rules']) for g in shipped)} rules found" in proc.stdout
    assert "DCGM_FI_DEV_XID_ERRORS is a gauge" in built.read_text()  # the files' comments come along
    cfg = yaml.safe_load(config.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {j["name"] for j in DEFAULT_JOBS}
    targets = targets_filter(DEFAULT_JOBS, *inventory_groups(REPO / "inventory" / "sample" / "hosts.yml"))
    assert {name: job["static_configs"] for name, job in jobs.items()} == targets
    # The inference service speaks HTTPS only, verified against the cluster CA; the exporters are plain HTTP.
    assert jobs["inference"]["scheme"] == "https"
    assert jobs["inference"]["tls_config"] == {"ca_file": str(tmp_path / "cluster-ca.crt")}
    assert {n for n, j in jobs.items() if "scheme" in j} == {"inference"}
    relabel = jobs["node"]["metric_relabel_configs"][0]
    assert re.fullmatch(relabel["regex"], "node_filesystem_avail_bytes;/srv/shardstack")
    assert not re.fullmatch(relabel["regex"], "node_filesystem_avail_bytes;/srv/shardstack2")
    assert not re.fullmatch(relabel["regex"], "node_cpu_seconds_total;/srv/shardstack")
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]


def test_prometheus_config_with_a_broken_rule_fails_promtool(tmp_path: Path) -> None:
    config = _render_prometheus(tmp_path)
    (tmp_path / "rules" / "broken.rules.yml").write_text(
        "groups:\n  - name: x\n    rules:\n      - alert: Broken\n        expr: rate(up[5m]\n")
    proc = run(tool("promtool"), "check", "config", str(config))
    assert proc.returncode != 0


@pytest.mark.parametrize("webhooks", [False, True], ids=["no-receivers", "webhooks"])
def test_alertmanager_config_passes_amtool(tmp_path: Path, webhooks: bool) -> None:
    overrides = {"prometheus_alertmanager_webhook_url": "http://alerts.example:9000/hook",
                 "prometheus_alertmanager_watchdog_url": "http://heartbeat.example/ping"} if webhooks else {}
    config = tmp_path / "alertmanager.yml"
    config.write_text(role_vars("prometheus", **overrides).render("alertmanager.yml.j2"))
    proc = run(tool("amtool"), "check-config", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = yaml.safe_load(config.read_text())
    receivers = {r["name"]: r for r in cfg["receivers"]}
    assert ("webhook_configs" in receivers["default"]) is webhooks
    assert cfg["route"]["routes"][0]["receiver"] == "watchdog"
    # Every alert an inhibit rule names exists in the rule files.
    names = set(re.findall(r"- alert: (\w+)", "".join(p.read_text() for p in RULES_DIR.glob("*.rules.yml"))))
    inhibited = {n for rule in cfg["inhibit_rules"] for m in rule["source_matchers"] + rule["target_matchers"]
                 for n in re.findall(r"[A-Z][A-Za-z]+", m.split("=", 1)[1]) if m.startswith("alertname")}
    assert inhibited and inhibited <= names, sorted(inhibited - names)


def test_service_arguments_render() -> None:
    ne = role_vars("node_exporter").render("node_exporter.default.j2")
    assert "--web.listen-address=0.0.0.0:9100" in ne
    assert "--collector.textfile.directory=/var/lib/prometheus/node-exporter" in ne
    assert ne.startswith("#") and "Ansible managed" in ne
    # InferenceServiceRestarting counts node_systemd_service_restart_total, which only this flag exports.
    assert "--collector.systemd --collector.processes --collector.systemd.enable-restarts-metrics" in ne
    without = role_vars("node_exporter", node_exporter_enabled_collectors=["processes"]).render(
        "node_exporter.default.j2")
    assert "enable-restarts-metrics" not in without
    ipv6 = role_vars("node_exporter", node_exporter_listen_address="::").render("node_exporter.default.j2")
    assert "--web.listen-address=[::]:9100" in ipv6
    am = role_vars("prometheus", prometheus_alertmanager_cluster_peers=["10.0.0.2:9094"]).render(
        "alertmanager.default.j2")
    assert "--cluster.listen-address= " in am and "--cluster.peer=10.0.0.2:9094" in am
    assert "--web.listen-address=0.0.0.0:9093" in am
    prom = role_vars("prometheus", prometheus_listen_address="::1").render("prometheus.default.j2")
    assert "--web.listen-address=[::1]:9090" in prom and "--storage.tsdb.retention.time=15d" in prom


def test_dcgm_gate_and_counters() -> None:
    def hw(*pci: str) -> dict:
        return {"nvidia_pci_functions": list(pci), "nvidia_device_nodes": [], "rdma_devices": []}

    skip = role_vars("dcgm_exporter", shardstack_hardware=hw())
    assert skip["__dcgm_exporter_enabled"] is False
    assert skip["__dcgm_exporter_reason"].startswith("skipped: no NVIDIA GPU found")
    forced = role_vars("dcgm_exporter", shardstack_hardware=hw(), dcgm_exporter_force=True)
    assert forced["__dcgm_exporter_enabled"] is True
    assert "forced" in forced["__dcgm_exporter_reason"]
    gpu = role_vars("dcgm_exporter", shardstack_hardware=hw("a", "b"))
    assert gpu["__dcgm_exporter_reason"] == "enabled: 2 NVIDIA PCI device(s)"
    csv = gpu.render("counters.csv.j2")
    rows = [line.split(", ") for line in csv.splitlines() if line and not line.startswith("#")]
    assert all(len(r) == 3 and r[1] in {"gauge", "counter"} for r in rows), rows
    unit = gpu.render("dcgm-exporter.service.j2")
    assert "-a 0.0.0.0:9401" in unit and "/etc/dcgm-exporter/shardstack-counters.csv" in unit


def test_grafana_gate() -> None:
    unreachable = {"status": -1, "msg": "Request failed: <urlopen error [Errno 101] Network is unreachable>"}
    auto = role_vars("grafana", __grafana_repo_probe=unreachable)
    assert auto["__grafana_active"] is False
    assert auto["__grafana_reason"].startswith("skipped: https://apt.grafana.com is unreachable")
    assert role_vars("grafana", __grafana_repo_probe={"status": 200})["__grafana_active"] is True
    assert role_vars("grafana", grafana_enabled="true", __grafana_repo_probe=unreachable)["__grafana_active"] is True
    off = role_vars("grafana", grafana_enabled="false", __grafana_repo_probe={"status": 200})
    assert off["__grafana_active"] is False


DASHBOARDS = sorted(DASHBOARDS_DIR.glob("*.json"))
GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "1h", "$node": ".*"}


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboards_are_provisionable() -> None:
    assert {p.stem for p in DASHBOARDS} == {"cluster-overview", "training-job", "inference"}
    role = role_vars("grafana", groups={"monitoring_server": ["ops01"]},
                    hostvars={"ops01": {"ansible_host": "192.0.2.31"}})
    datasource = yaml.safe_load(role.render("datasource.yml.j2"))["datasources"][0]
    assert datasource["url"] == "http://192.0.2.31:9090"
    uids = set()
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        uids.add(d["uid"])
        assert d["panels"] and _exprs(d), path.name
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for p in d["panels"]:
            assert p["datasource"]["uid"] == datasource["uid"], f"{path.name}: {p['title']}"
    assert len(uids) == len(DASHBOARDS)


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel query is valid PromQL: promtool parses them as recording rules (Grafana variables filled)."""
    rules = []
    for path in DASHBOARDS:
        for i, expr in enumerate(_exprs(json.loads(path.read_text()))):
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{path.name}: unknown Grafana variable in {expr}"
            rules.append({"record": f"dashboard:{path.stem.replace('-', '_')}:{i}", "expr": expr})
    rule_file = tmp_path / "dashboards.rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = run(tool("promtool"), "check", "rules", str(rule_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
