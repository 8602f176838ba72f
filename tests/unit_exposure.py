"""Every systemd service the roles install, as a node ends up with it, scored by `systemd-analyze security`.

Each case is laid out in a scratch root the way the role leaves the node: the role's own unit template rendered
into /etc/systemd/system, or the package's unit file (Debian's, from the cache `make setup` fills) in
/usr/lib/systemd/system, plus the role's drop-ins in /etc/systemd/system/<unit>.d/ (its own templates, and the
sandboxing drop-in shardstack_common's hardening.conf.j2 renders from the role's settings). Then
`systemd-analyze security --offline=true --root=<scratch> --threshold=<N> <unit>` loads the unit with its drop-ins
exactly as systemd would and scores the result. Shared by tests/ops/test_unit_security.py (the thresholds) and
bench/unit_exposure.py (the table in bench/RESULTS.md, which can also score another checkout's roles).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ansible_vars

# Where `make setup` extracts the unit files of the Debian packages the roles install (not committed: they come
# from the archive the nodes install from).
DEBIAN_UNITS = Path(os.environ.get("SHARDSTACK_CACHE", "/var/cache/shardstack")) / "debian-units"
# Grafana's unit comes from Grafana's own repository, which neither the lab nor this host reaches. Its drop-ins are
# scored over this floor: the unit of Grafana's older packages, which set no sandboxing at all, so the score is what
# the drop-ins alone guarantee whatever the installed version ships.
GRAFANA_FLOOR = """\
[Unit]
Description=Grafana instance

[Service]
EnvironmentFile=/etc/default/grafana-server
User=grafana
Group=grafana
Type=simple
WorkingDirectory=/usr/share/grafana
ExecStart=/usr/sbin/grafana-server --config=${CONF_FILE} --pidfile=${PID_FILE_DIR}/grafana-server.pid
LimitNOFILE=10000
TimeoutStopSec=20

[Install]
WantedBy=multi-user.target
"""

FACTS: dict[str, Any] = {
    "os_family": "Debian", "distribution": "Debian", "distribution_major_version": "12",
    "architecture": "x86_64", "virtualization_type": "container",
}
# The sandboxing drop-in: shardstack_common's template (tasks/hardening.yml), from the role's settings variable.
HARDENING = "50-shardstack-hardening.conf"
# A tree from before that template (issue 27) had one per role: scored with it, as it deployed.
LEGACY_HARDENING = {"prometheus.service": "prometheus-hardening.conf.j2",
                    "prometheus-alertmanager.service": "alertmanager-hardening.conf.j2"}


@dataclass(frozen=True)
class Case:
    label: str  # the row of the table
    unit: str  # what systemd-analyze scores (a template unit's instance)
    threshold: float
    role: str
    template: str | None = None  # the role's own unit, rendered into /etc/systemd/system
    packaged: str | None = None  # a package's unit file from DEBIAN_UNITS (or GRAFANA_FLOOR), in /usr/lib
    dropins: tuple[tuple[str, str], ...] = ()  # (role template, file name under <unit>.d/)
    hardening: str | None = None  # the role's settings for shardstack_common's drop-in, e.g. "__grafana_hardening"
    variables: dict[str, Any] = field(default_factory=dict)

    @property
    def unit_file(self) -> str:
        return re.sub(r"@[^.]+\.", "@.", self.unit)


# A two-node pipeline-parallel replica (inference_service_pipeline_parallel); n1 is its head.
PIPELINE: dict[str, Any] = {"inference_service_engine": "vllm", "inference_service_pipeline_parallel": 2,
                            "inference_service_replica_group": "replica", "groups": {"replica": ["n1", "n2"]},
                            "inventory_hostname": "n1", "hostvars": {"n1": {}, "n2": {}}}

CASES = [
    Case("inference service", "shardstack-inference.service", 2.0, "inference_service",
         template="shardstack-inference.service.j2"),
    Case("inference service (vLLM)", "shardstack-inference.service", 2.0, "inference_service",
         template="shardstack-inference.service.j2", variables={"inference_service_engine": "vllm"}),
    Case("inference service (vLLM, pipeline head)", "shardstack-inference.service", 2.0, "inference_service",
         template="shardstack-inference.service.j2", variables=PIPELINE),
    Case("Ray head (vLLM pipeline)", "shardstack-ray.service", 2.0, "inference_service",
         template="shardstack-ray.service.j2", variables=PIPELINE),
    Case("Ray worker (vLLM pipeline)", "shardstack-ray.service", 2.0, "inference_service",
         template="shardstack-ray.service.j2", variables={**PIPELINE, "inventory_hostname": "n2"}),
    Case("inference autoscaler", "shardstack-autoscale.service", 2.5, "inference_service",
         template="shardstack-autoscale.service.j2"),
    Case("training job", "shardstack-train@job.service", 3.0, "training_runtime",
         template="shardstack-train@.service.j2"),
    Case("dcgm-exporter", "dcgm-exporter.service", 3.0, "dcgm_exporter", template="dcgm-exporter.service.j2"),
    Case("node_exporter (package)", "prometheus-node-exporter.service", 3.0, "node_exporter",
         packaged="prometheus-node-exporter.service", hardening="__node_exporter_hardening"),
    Case("node_exporter (binary)", "prometheus-node-exporter.service", 3.0, "node_exporter",
         template="node_exporter.service.j2", hardening="__node_exporter_hardening",
         variables={"node_exporter_install_method": "binary"}),
    Case("prometheus (package)", "prometheus.service", 3.0, "prometheus", packaged="prometheus.service",
         hardening="__prometheus_hardening[0].settings"),
    Case("prometheus (binary)", "prometheus.service", 3.0, "prometheus", template="prometheus.service.j2",
         hardening="__prometheus_hardening[0].settings", variables={"prometheus_install_method": "binary"}),
    Case("alertmanager (package)", "prometheus-alertmanager.service", 3.0, "prometheus",
         packaged="prometheus-alertmanager.service", hardening="__prometheus_hardening[1].settings"),
    Case("alertmanager (binary)", "prometheus-alertmanager.service", 3.0, "prometheus",
         template="alertmanager.service.j2", hardening="__prometheus_hardening[1].settings",
         variables={"prometheus_install_method": "binary"}),
    Case("haproxy (package)", "haproxy.service", 3.0, "loadbalancer", packaged="haproxy.service",
         hardening="__loadbalancer_hardening"),
    Case("grafana (package)", "grafana-server.service", 3.0, "grafana", packaged="grafana-server.service",
         dropins=(("grafana-server.override.conf.j2", "shardstack.conf"),), hardening="__grafana_hardening"),
    Case("firewall loader", "shardstack-firewall.service", 3.0, "firewall",
         template="shardstack-firewall.service.j2"),
    Case("journal heartbeat", "shardstack-journal-heartbeat.service", 3.0, "journal",
         template="shardstack-journal-heartbeat.service.j2"),
    Case("log arrival metrics", "shardstack-log-metrics.service", 3.0, "journal",
         template="shardstack-log-metrics.service.j2"),
    Case("log store vacuum", "shardstack-log-vacuum.service", 3.0, "journal",
         template="shardstack-log-vacuum.service.j2"),
    Case("GPU health patrol", "shardstack-gpu-health.service", 2.5, "dcgm_exporter",
         template="shardstack-gpu-health.service.j2"),
    Case("journal gate", "shardstack-journal-gate.service", 3.0, "journal",
         template="shardstack-journal-gate.service.j2"),
    Case("log forwarder", "shardstack-log-forward.service", 3.0, "journal",
         template="shardstack-log-forward.service.j2",
         variables={"journal_forward_url": "https://es.example:9200"}),
    Case("artifacts prune", "shardstack-artifacts-prune.service", 3.0, "shared_storage",
         template="shardstack-artifacts-prune.service.j2"),
    Case("munged (package)", "munge.service", 3.0, "munge", packaged="munge.service",
         hardening="__munge_hardening"),
    Case("slurmctld (package)", "slurmctld.service", 3.0, "slurm", packaged="slurmctld.service",
         hardening="__slurm_hardening"),
    Case("slurmdbd (package)", "slurmdbd.service", 3.0, "slurm", packaged="slurmdbd.service",
         hardening="__slurm_hardening"),
    Case("Slurm metrics", "shardstack-slurm-metrics.service", 3.0, "slurm",
         template="shardstack-slurm-metrics.service.j2"),
]


def packaged_unit(name: str) -> str:
    if name == "grafana-server.service":
        return GRAFANA_FLOOR
    path = DEBIAN_UNITS / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `make setup` extracts it from the Debian package")
    return path.read_text()


def lay_out(case: Case, root: Path, roles: Path | None = None) -> list[str]:
    """Write the case's unit and drop-ins under `root`; return the files written (relative). A drop-in template the
    role (of another checkout) does not have is left out, so an older tree is scored as it deploys: one from before
    shardstack_common's hardening template with the role's own (LEGACY_HARDENING), one from before any without."""
    roles = roles or ansible_vars.ROLES
    saved, ansible_vars.ROLES = ansible_vars.ROLES, roles
    try:
        ev = ansible_vars.RoleEval(case.role, FACTS, **case.variables)
    finally:
        ansible_vars.ROLES = saved
    written = []
    if case.template:
        rel = f"etc/systemd/system/{case.unit_file}"
        text = ev.render(case.template)
    else:
        rel = f"usr/lib/systemd/system/{case.unit_file}"
        text = packaged_unit(case.unit_file)
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
    written.append(rel)
    dropins = {name: ev.render(template) for template, name in case.dropins
               if (roles / case.role / "templates" / template).is_file()}
    if case.hardening:
        legacy = LEGACY_HARDENING.get(case.unit_file, "hardening.conf.j2")
        if (roles / "shardstack_common" / "templates" / "hardening.conf.j2").is_file():
            dropins[HARDENING] = ev.render_hardening(case.hardening, case.unit_file.removesuffix(".service"))
        elif (roles / case.role / "templates" / legacy).is_file():
            dropins[HARDENING] = ev.render(legacy)
    for name, text in dropins.items():
        rel = f"etc/systemd/system/{case.unit_file}.d/{name}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        written.append(rel)
    return written


@dataclass
class Score:
    case: Case
    exposure: float
    passed: bool  # systemd-analyze's own verdict against the threshold (exit code)
    files: list[str]
    output: str


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if not tool:
        raise FileNotFoundError("systemd-analyze is missing: `make setup` installs systemd")
    return tool


def analyze(root: Path, unit: str, threshold: float) -> tuple[float, bool, str]:
    """(exposure, within the threshold by systemd-analyze's own exit code, its output) of `unit` under `root`.
    systemd 252 takes the threshold in tenths (0-100), as it counts the exposure internally."""
    proc = subprocess.run(
        [systemd_analyze(), "security", "--no-pager", "--offline=true", f"--root={root}",
         f"--threshold={round(threshold * 10)}", unit],
        capture_output=True, text=True, cwd=root)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    if not m:
        raise RuntimeError(f"{unit}: no exposure level in systemd-analyze's output:\n{proc.stdout}{proc.stderr}")
    return float(m[1]), proc.returncode == 0, proc.stdout + proc.stderr


def score(case: Case, root: Path, roles: Path | None = None) -> Score:
    files = lay_out(case, root, roles)
    exposure, passed, output = analyze(root, case.unit, case.threshold)
    return Score(case, exposure, passed, files, output)
