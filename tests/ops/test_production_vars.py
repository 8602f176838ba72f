"""`shardstack check` warns about exactly the production variables an inventory leaves to the role default, on the
hosts they matter for, read through ansible-inventory as Ansible reads the inventory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardstack.build.variables import PRODUCTION
from shardstack.cli import deploy
from shardstack.ops.inventory import Cluster
from shardstack.ops.production import unset_production_variables, warning_lines
from shardstack.ops.runner import RunResult

HOSTS = {"all": {"children": {
    "train_nodes": {"hosts": {"gpu01": {"ansible_host": "192.0.2.11"}, "gpu02": {"ansible_host": "192.0.2.12"}}},
    "inference_nodes": {"hosts": {"gpu03": {"ansible_host": "192.0.2.13"}}},
    "monitoring_server": {"hosts": {"ops01": {"ansible_host": "192.0.2.31"}}},
    "loadbalancer": {"hosts": {"ops01": {}}},
    "slurm_controller": {"hosts": {"ops01": {}}},
}}}


def _inventory(tmp_path: Path, all_vars: dict[str, Any], host_vars: dict[str, dict[str, Any]] | None = None) -> Path:
    inv = tmp_path / "inventory"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text(yaml.safe_dump(HOSTS))
    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(all_vars))
    for host, values in (host_vars or {}).items():
        (inv / "host_vars").mkdir(exist_ok=True)
        (inv / "host_vars" / f"{host}.yml").write_text(yaml.safe_dump(values))
    return inv


def test_exactly_the_unset_ones_are_reported(tmp_path: Path) -> None:
    # Set: the admin networks (to the default: decided counts), the certificate, Grafana's password. Slurm is chosen
    # but slurm_users is left out, so it joins the unset ones; the webhook and the client networks are left out too.
    inv = _inventory(tmp_path, {"firewall_admin_networks": [], "loadbalancer_tls_cert": "/etc/pki/lb.crt",
                                "grafana_admin_password": "s3cret", "shardstack_scheduler": "slurm"})
    unset = unset_production_variables(Cluster.load(inv))
    assert {u.name for u in unset} == {"firewall_client_networks", "prometheus_alertmanager_webhook_url",
                                       "slurm_users"}
    by_name = {u.name: u for u in unset}
    assert by_name["firewall_client_networks"].hosts == ["ops01"]
    assert by_name["firewall_client_networks"].group == "loadbalancer"
    assert by_name["slurm_users"].group == "slurm_controller"
    reasons = {v.name: v.reason for v in PRODUCTION}
    assert all(u.reason == reasons[u.name] for u in unset)


def test_conditions_and_host_vars_are_read_per_host(tmp_path: Path) -> None:
    # Grafana switched off and the systemd scheduler (the default): neither its password nor slurm_users matters.
    # The admin networks are set for ops01 only (host_vars), so the other hosts of `all` still warn.
    inv = _inventory(tmp_path, {"grafana_enabled": False, "firewall_client_networks": ["198.51.100.0/24"],
                                "loadbalancer_tls_cert": "x", "prometheus_alertmanager_webhook_url": "https://hook"},
                     host_vars={"ops01": {"firewall_admin_networks": ["203.0.113.0/24"]}})
    unset = unset_production_variables(Cluster.load(inv))
    assert [(u.name, u.hosts, u.of_hosts) for u in unset] == [
        ("firewall_admin_networks", ["gpu01", "gpu02", "gpu03"], 4)]
    assert warning_lines(unset)[0] == (
        "production: firewall_admin_networks (firewall) is unset on 3 of the 4 hosts of group all (gpu01, gpu02, "
        f"gpu03): {unset[0].reason}")


def test_nothing_to_say_when_every_production_variable_is_set(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, {v.name: "set" for v in PRODUCTION} | {"shardstack_scheduler": "slurm"})
    assert unset_production_variables(Cluster.load(inv)) == []
    assert warning_lines([]) == []


@pytest.fixture
def no_preflight(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The preflight playbook replaced by a successful result: the check's own output, no node reached."""
    ran: list[str] = []

    def fake_run_playbook(playbook: str, inventory: Path, **_: Any) -> RunResult:
        ran.append(playbook)
        return RunResult(playbook, "successful", 0, 0.1, "/nonexistent")

    monkeypatch.setattr(deploy, "run_playbook", fake_run_playbook)
    return ran


def _args(inv: Path, *, as_json: bool) -> argparse.Namespace:
    return argparse.Namespace(inventory=inv, json=as_json, limit=None, extra_vars=[])


def test_check_prints_the_warnings_after_its_report_and_keeps_its_exit_code(
        tmp_path: Path, no_preflight: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path, {"grafana_admin_password": "s3cret"})
    assert deploy._check(_args(inv, as_json=False)) == 0
    err = capsys.readouterr().err
    assert no_preflight == ["playbooks/preflight.yml"]
    for name in ("firewall_admin_networks", "firewall_client_networks", "loadbalancer_tls_cert",
                 "prometheus_alertmanager_webhook_url"):
        assert f"warning: production: {name} (" in err
    assert "grafana_admin_password" not in err and "slurm_users" not in err
    assert err.index("check (preflight)") < err.index("warning: production:")


def test_check_json_has_the_warnings(tmp_path: Path, no_preflight: list[str],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path, {v.name: "set" for v in PRODUCTION if v.name != "grafana_admin_password"})
    assert deploy._check(_args(inv, as_json=True)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["success"] is True and report["playbook"] == "playbooks/preflight.yml"
    assert [(w["name"], w["group"], w["hosts"]) for w in report["warnings"]] == [
        ("grafana_admin_password", "monitoring_server", ["ops01"])]
    assert report["warnings"][0]["message"].startswith("grafana_admin_password (grafana) is unset on group")
