"""On the lab: the monitoring stage (playbooks/monitoring.yml) brings Prometheus up on the monitoring node, it
scrapes every node's exporter, loads every rule, and its alerts reach Alertmanager. Checked from the host through
the Prometheus and Alertmanager HTTP APIs on the lab address."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import REPO, RULES_DIR

pytestmark = [pytest.mark.lab, pytest.mark.slow]

# The services behind trainer/inference/loadbalancer are not deployed in this test, so their jobs are left out;
# the node, dcgm (gated: no GPU, so no targets), prometheus and alertmanager jobs are the real defaults.
JOBS = [j for j in yaml.safe_load((REPO / "roles/prometheus/defaults/main.yml").read_text())["prometheus_scrape_jobs"]
        if j["name"] in {"prometheus", "alertmanager", "node", "dcgm"}]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    name = "m" + uuid.uuid4().hex[:6]
    inventory = tmp_path_factory.mktemp("monlab") / "hosts.yml"
    up = cli("lab", "up", "--name", name, "--nodes", "2", "--inventory", str(inventory))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield name, inventory
    finally:
        cli("lab", "down", "--name", name)


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}; last: {last}")


@pytest.fixture(scope="module")
def monitoring(lab: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    _, inventory = lab
    extra = tmp_path_factory.mktemp("monvars") / "vars.json"
    extra.write_text(json.dumps({
        "prometheus_scrape_jobs": JOBS,
        "prometheus_scrape_interval": "5s",
        "prometheus_scrape_timeout": "4s",
        "prometheus_evaluation_interval": "5s",
        "prometheus_checkpoint_mountpoints": ["/mnt/lab-shared"],
    }))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), "-e", f"@{extra}",
         "playbooks/monitoring.yml"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "grafana: skipped:" in proc.stdout and "dcgm_exporter: skipped: no NVIDIA GPU found" in proc.stdout
    hosts = yaml.safe_load(inventory.read_text())["all"]
    head = hosts["children"]["monitoring_server"]["hosts"]
    address = hosts["hosts"][next(iter(head))]["ansible_host"]
    return {"prometheus": f"http://{address}:9090", "alertmanager": f"http://{address}:9093",
            "nodes": ",".join(hosts["hosts"])}


def test_every_target_is_up(monitoring: dict[str, str]) -> None:
    def all_up() -> list[dict] | None:
        targets = get(monitoring["prometheus"] + "/api/v1/targets?state=active")["data"]["activeTargets"]
        return targets if targets and all(t["health"] == "up" for t in targets) else None

    targets = wait_for(all_up, 90, "every target up")
    by_job: dict[str, set[str]] = {}
    for t in targets:
        by_job.setdefault(t["labels"]["job"], set()).add(t["labels"]["node"])
    nodes = set(monitoring["nodes"].split(","))
    assert by_job == {"node": nodes, "prometheus": {min(nodes)}, "alertmanager": {min(nodes)}}


def test_every_rule_is_loaded_and_healthy(monitoring: dict[str, str]) -> None:
    files = RULES_DIR.glob("*.rules.yml")
    expected = sum(len(g["rules"]) for p in files for g in yaml.safe_load(p.read_text())["groups"])
    groups = get(monitoring["prometheus"] + "/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == expected
    wait_for(lambda: all(r["health"] == "ok" for g in get(monitoring["prometheus"] + "/api/v1/rules")["data"]["groups"]
                         for r in g["rules"]), 30, "every rule evaluated ok")


def test_checkpoint_storage_is_labelled_and_recorded(monitoring: dict[str, str]) -> None:
    query = urllib.parse.quote("shardstack:checkpoint_storage_free:ratio")
    result = wait_for(lambda: get(f"{monitoring['prometheus']}/api/v1/query?query={query}")["data"]["result"], 60,
                      "the checkpoint storage recording rule")
    assert [r["metric"]["mountpoint"] for r in result] == ["/mnt/lab-shared"]
    assert 0.0 < float(result[0]["value"][1]) <= 1.0


def test_watchdog_reaches_alertmanager(monitoring: dict[str, str]) -> None:
    alerts = wait_for(lambda: [a for a in get(monitoring["alertmanager"] + "/api/v2/alerts")
                               if a["labels"]["alertname"] == "Watchdog"], 90, "Watchdog in Alertmanager")
    assert alerts[0]["status"]["state"] == "active"
    assert alerts[0]["labels"]["cluster"] == "shardstack"  # external label added by Prometheus
