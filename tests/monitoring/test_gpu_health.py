"""The GPU health patrol (roles/dcgm_exporter/files/shardstack_gpu_health.py) on recorded nvidia-smi, kernel-log
and dcgmi outputs: the metrics it derives, promtool's verdict on its textfile, and the atomic write."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import ROLES, role_vars, tool

SCRIPT = ROLES / "dcgm_exporter" / "files" / "shardstack_gpu_health.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu_health"


@pytest.fixture(scope="module")
def patrol() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shardstack_gpu_health", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def _samples(text: str) -> dict[str, float]:
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def _run_script(tmp_path: Path, smi: str, dcgm: str | None) -> tuple[Path, subprocess.CompletedProcess[str]]:
    argv = [sys.executable, str(SCRIPT), "--textfile-dir", str(tmp_path),
            "--nvidia-smi-output", str(FIXTURES / smi), "--kernel-log", str(FIXTURES / "kernel-xid.log")]
    argv += ["--dcgmi-output", str(FIXTURES / dcgm)] if dcgm else ["--dcgmi", ""]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return tmp_path / "shardstack_gpu_health.prom", proc


def _promtool_check(path: Path) -> None:
    proc = subprocess.run([tool("promtool"), "check", "metrics"], input=path.read_text(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_faulty_node_metrics(patrol: ModuleType) -> None:
    report = patrol.patrol((FIXTURES / "nvidia-smi-faulty.csv").read_text(), (FIXTURES / "kernel-xid.log").read_text(),
                           (FIXTURES / "dcgmi-health-faulty.txt").read_text())
    got = _samples(patrol.render(report))
    expected = {
        'shardstack_gpu_health_up{source="nvidia-smi"}': 1,
        'shardstack_gpu_health_up{source="dcgm"}': 1,
        'shardstack_gpu_health_temperature_celsius{gpu="1"}': 88,
        'shardstack_gpu_health_ecc_uncorrected_volatile{gpu="1"}': 2,
        'shardstack_gpu_health_ecc_uncorrected_aggregate{gpu="1"}': 5,
        'shardstack_gpu_health_ecc_uncorrected_aggregate{gpu="2"}': 12,
        'shardstack_gpu_health_remapped_rows_pending{gpu="1"}': 1,
        'shardstack_gpu_health_remapped_rows_pending{gpu="2"}': 0,
        'shardstack_gpu_health_remapped_rows_failure{gpu="2"}': 1,
        'shardstack_gpu_health_throttle_active{gpu="1",reason="hw_thermal"}': 1,
        'shardstack_gpu_health_throttle_active{gpu="1",reason="sw_thermal"}': 1,
        'shardstack_gpu_health_throttle_active{gpu="1",reason="hw_power_brake"}': 0,
        'shardstack_gpu_health_throttle_active{gpu="2",reason="hw_power_brake"}': 1,
        # Kernel PCI addresses mapped to nvidia-smi's indices; a bus nvidia-smi no longer lists keeps its address.
        'shardstack_gpu_health_xid_events{gpu="1",xid="48"}': 1,
        'shardstack_gpu_health_xid_events{gpu="1",xid="94"}': 2,
        'shardstack_gpu_health_xid_events{gpu="2",xid="63"}': 1,
        'shardstack_gpu_health_xid_events{gpu="0000:b1:00",xid="79"}': 1,
        'shardstack_gpu_health_dcgm_status{gpu="1"}': 2,
        'shardstack_gpu_health_dcgm_status{gpu="2"}': 1,
        'shardstack_gpu_health_dcgm_incidents{gpu="1",severity="failure",system="memory"}': 1,
        'shardstack_gpu_health_dcgm_incidents{gpu="1",severity="warning",system="pcie"}': 1,
        'shardstack_gpu_health_dcgm_incidents{gpu="2",severity="warning",system="memory"}': 1,
    }
    assert {k: got.get(k) for k in expected} == expected
    # [N/A] (unsupported, or a GPU that stopped answering) is left out, never exported as 0.
    assert not [k for k in got if 'gpu="3"' in k]
    assert not [k for k in got if k.startswith("shardstack_gpu_health_retired_pages_pending")]


def test_healthy_node_metrics(patrol: ModuleType) -> None:
    report = patrol.patrol((FIXTURES / "nvidia-smi-healthy.csv").read_text(), "",
                           (FIXTURES / "dcgmi-health-healthy.txt").read_text())
    got = _samples(patrol.render(report))
    assert got['shardstack_gpu_health_up{source="dcgm"}'] == 1
    # The power cap at TDP is normal under load: exported, but only hardware brakes and thermal limits alert.
    assert got['shardstack_gpu_health_throttle_active{gpu="1",reason="sw_power_cap"}'] == 1
    bad = [k for k, v in got.items() if v and ("ecc" in k or "remapped" in k or "xid" in k or "dcgm_" in k
                                               or "thermal" in k or "brake" in k)]
    assert bad == []
    assert sum(k.startswith("shardstack_gpu_health_temperature_celsius") for k in got) == 4


def test_dcgm_unavailable_and_bad_nvidia_smi(patrol: ModuleType) -> None:
    # dcgmi without a host engine fails (no output); an nvidia-smi that prints the wrong columns is not trusted.
    got = _samples(patrol.render(patrol.patrol("0, 00000000:18:00.0, 33\n", None, None)))
    assert got['shardstack_gpu_health_up{source="nvidia-smi"}'] == 0
    assert got['shardstack_gpu_health_up{source="dcgm"}'] == 0
    assert not [k for k in got if "gpu=" in k]
    assert patrol.parse_dcgmi_health("Error: unable to establish a connection to the specified host: localhost\n",
                                     patrol.Report()) is False


@pytest.mark.parametrize(("smi", "dcgm"), [("nvidia-smi-faulty.csv", "dcgmi-health-faulty.txt"),
                                           ("nvidia-smi-healthy.csv", "dcgmi-health-healthy.txt"),
                                           ("nvidia-smi-healthy.csv", None)])
def test_script_output_passes_promtool(tmp_path: Path, smi: str, dcgm: str | None) -> None:
    path, proc = _run_script(tmp_path, smi, dcgm)
    assert proc.returncode == 0, proc.stderr
    _promtool_check(path)
    assert [p.name for p in tmp_path.iterdir()] == ["shardstack_gpu_health.prom"]  # no temporary file left
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_rewrite_replaces_the_file(tmp_path: Path) -> None:
    first, _ = _run_script(tmp_path, "nvidia-smi-faulty.csv", "dcgmi-health-faulty.txt")
    inode = first.stat().st_ino
    second, proc = _run_script(tmp_path, "nvidia-smi-healthy.csv", "dcgmi-health-healthy.txt")
    assert proc.returncode == 0, proc.stderr
    assert second.stat().st_ino != inode  # renamed into place, never rewritten in place
    assert 'shardstack_gpu_health_remapped_rows_failure{gpu="2"} 0' in second.read_text()


def test_patrol_units_render(patrol: ModuleType) -> None:
    r = role_vars("dcgm_exporter")
    service = r.render("shardstack-gpu-health.service.j2")
    assert ("ExecStart=/usr/bin/python3 /usr/local/libexec/shardstack/shardstack_gpu_health.py "
            "--textfile-dir /var/lib/prometheus/node-exporter\n") in service
    assert "ExecStartPre=-/usr/bin/dcgmi health -g 0 -s a\n" in service
    # Hardened: the textfile directory is the only writable path, no capabilities; not PrivateDevices (GPUs).
    for line in ("ProtectSystem=strict", "ReadWritePaths=/var/lib/prometheus/node-exporter", "CapabilityBoundingSet=",
                 "NoNewPrivileges=true", "Type=oneshot"):
        assert line + "\n" in service
    assert "PrivateDevices=" not in service and "PrivateNetwork=" not in service
    assert patrol.OUTPUT_NAME.endswith(".prom")
    timer = r.render("shardstack-gpu-health.timer.j2")
    assert "OnUnitActiveSec=5min\n" in timer and "WantedBy=timers.target" in timer

    no_dcgm = role_vars("dcgm_exporter", dcgm_exporter_patrol_dcgm=False, dcgm_exporter_patrol_interval="2min")
    service = no_dcgm.render("shardstack-gpu-health.service.j2")
    assert "ExecStartPre" not in service and service.count("--dcgmi ''") == 1
    assert "OnUnitActiveSec=2min\n" in no_dcgm.render("shardstack-gpu-health.timer.j2")


def test_the_overview_dashboard_shows_gpu_health_and_cordoned_nodes(patrol: ModuleType) -> None:
    """Panels for the patrol's findings and for cordoned nodes, reading only metrics that exist: every
    shardstack_gpu_health_* name is one the patrol writes, and shardstack_node_cordoned is what `shardstack node`
    writes on the node (its textfile, shardstack.ops.cordon.metric_text)."""
    import json
    import re

    from shardstack.ops import cordon

    from .conftest import DASHBOARDS_DIR

    d = json.loads((DASHBOARDS_DIR / "cluster-overview.json").read_text())
    titles = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in d["panels"]}
    exprs = [e for es in titles.values() for e in es]
    written = {f"shardstack_gpu_health_{suffix}" for suffix in patrol.HELP}
    read = set(re.findall(r"shardstack_gpu_health_[a-z_]+", " ".join(exprs)))
    assert {"shardstack_gpu_health_ecc_uncorrected_volatile", "shardstack_gpu_health_dcgm_status",
            "shardstack_gpu_health_xid_events", "shardstack_gpu_health_last_run_timestamp_seconds"} <= read
    assert read <= written, read - written
    assert any(t.startswith("GPU health") for t in titles)
    cordoned = titles["Cordoned nodes"]
    assert any("shardstack_node_cordoned" in e for e in cordoned)
    assert "shardstack_node_cordoned 1" in cordon.metric_text("cordon")
    assert "shardstack_node_cordoned 0" in cordon.metric_text("uncordon")
