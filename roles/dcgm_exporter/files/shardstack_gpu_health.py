#!/usr/bin/python3
"""GPU health patrol: nvidia-smi, the kernel's XID lines and (where a DCGM host engine answers) `dcgmi health`
turned into node_exporter textfile metrics (shardstack_gpu_health_*, one `gpu` label per card).

Shipped by the dcgm_exporter role and run by shardstack-gpu-health.timer. Standard library only: it runs with the
node's system python3, beside no venv. The output file is written by the shared writer (shardstack_textfile:
atomic, fsync'd), so node_exporter never reads half of it. `--nvidia-smi-output`, `--kernel-log` and
`--dcgmi-output` read recorded outputs instead of running the tools (tests, and replaying what a node printed).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardstack_textfile import escape, write  # beside this script (shardstack_common)

# nvidia-smi --query-gpu fields, in this order (`nvidia-smi --help-query-gpu`). clocks_throttle_reasons.* are the
# names every driver since 450 accepts (newer ones call them clocks_event_reasons.* and keep the old names).
QUERY_FIELDS = (
    "index",
    "pci.bus_id",
    "temperature.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "clocks_throttle_reasons.hw_thermal_slowdown",
    "clocks_throttle_reasons.sw_thermal_slowdown",
    "clocks_throttle_reasons.hw_power_brake_slowdown",
    "clocks_throttle_reasons.sw_power_cap",
)
THROTTLE_REASONS = ("hw_thermal", "sw_thermal", "hw_power_brake", "sw_power_cap")
DCGM_STATUS = {"healthy": 0, "warning": 1, "failure": 2}
OUTPUT_NAME = "shardstack_gpu_health.prom"

HELP = {
    "up": ("gauge", "1 if the source (nvidia-smi, dcgm) answered this run, else 0."),
    "temperature_celsius": ("gauge", "GPU core temperature (in C)."),
    "ecc_uncorrected_volatile": ("gauge", "Uncorrectable ECC errors since the last driver load."),
    "ecc_uncorrected_aggregate": ("gauge", "Uncorrectable ECC errors over the GPU's lifetime."),
    "retired_pages_pending": ("gauge", "1 if a page retirement waits for a GPU reset (pre-Ampere)."),
    "remapped_rows_pending": ("gauge", "1 if a row remap waits for a GPU reset (Ampere and later)."),
    "remapped_rows_failure": ("gauge", "1 if a row remap failed (no spare rows left)."),
    "throttle_active": ("gauge", "1 while the clocks are held down for this reason."),
    "xid_events": ("gauge", "XID lines the kernel logged for this GPU since boot, by XID."),
    "dcgm_status": ("gauge", "DCGM health check result: 0 healthy, 1 warning, 2 failure."),
    "dcgm_incidents": ("gauge", "Incidents the DCGM health check reported, by subsystem and severity."),
    "last_run_timestamp_seconds": ("gauge", "When the patrol last ran (Unix time)."),
}


@dataclass
class Report:
    """Samples by metric suffix: (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def add(self, name: str, value: float, **labels: str) -> None:
        self.samples.setdefault(name, []).append((labels, value))


def _number(raw: str) -> float | None:
    """nvidia-smi's value: a number, Yes/No, Active/Not Active; None for [N/A], [Not Supported] and the like."""
    value = raw.strip()
    lowered = value.lower()
    if lowered in {"yes", "active"}:
        return 1.0
    if lowered in {"no", "not active"}:
        return 0.0
    try:
        return float(value)
    except ValueError:
        return None


def _bus_key(bus_id: str) -> str:
    """`00000000:3B:00.0` (nvidia-smi) and `0000:3b:00` (the kernel's Xid line) to one key: `0000:3b:00`."""
    match = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?", bus_id.strip())
    if match is None:
        return bus_id.strip().lower()
    domain = int(match.group(1) or "0", 16)
    return f"{domain:04x}:{match.group(2).lower()}:{match.group(3).lower()}"


def parse_nvidia_smi(text: str, report: Report) -> dict[str, str]:
    """`nvidia-smi --query-gpu=QUERY_FIELDS --format=csv,noheader,nounits` into the report; returns bus → index."""
    buses: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(QUERY_FIELDS):
            raise ValueError(f"nvidia-smi printed {len(cells)} fields, expected {len(QUERY_FIELDS)}: {line!r}")
        row = dict(zip(QUERY_FIELDS, cells, strict=True))
        gpu = row["index"]
        buses[_bus_key(row["pci.bus_id"])] = gpu
        for metric, key in (
            ("temperature_celsius", "temperature.gpu"),
            ("ecc_uncorrected_volatile", "ecc.errors.uncorrected.volatile.total"),
            ("ecc_uncorrected_aggregate", "ecc.errors.uncorrected.aggregate.total"),
            ("retired_pages_pending", "retired_pages.pending"),
            ("remapped_rows_pending", "remapped_rows.pending"),
            ("remapped_rows_failure", "remapped_rows.failure"),
        ):
            value = _number(row[key])
            if value is not None:
                report.add(metric, value, gpu=gpu)
        for reason, key in zip(THROTTLE_REASONS, QUERY_FIELDS[8:], strict=True):
            value = _number(row[key])
            if value is not None:
                report.add("throttle_active", value, gpu=gpu, reason=reason)
    return buses


# NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.
# NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error ...
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),")


def parse_kernel_xids(text: str, buses: dict[str, str], report: Report) -> None:
    """Count the kernel's Xid lines per GPU and XID; a bus nvidia-smi did not list keeps its PCI address."""
    counts: dict[tuple[str, str], int] = {}
    for match in _XID.finditer(text):
        key = _bus_key(match.group(1))
        gpu = buses.get(key, key)
        counts[(gpu, match.group(2))] = counts.get((gpu, match.group(2)), 0) + 1
    for (gpu, xid), count in sorted(counts.items()):
        report.add("xid_events", float(count), gpu=gpu, xid=xid)


# | GPU ID: 0                 | Warning                                                  |
# |                           | PCIe system: Warning - Detected more than 8 PCIe         |
_DCGM_ROW = re.compile(r"^\|\s*(.*?)\s*\|\s*(.*?)\s*\|\s*$")
_DCGM_INCIDENT = re.compile(r"^([A-Za-z][A-Za-z0-9 ]*?) system: (Healthy|Warning|Failure)\b")


def parse_dcgmi_health(text: str, report: Report) -> bool:
    """`dcgmi health -g 0 -c` (its table) into per-GPU status and incidents; False if it is no health report."""
    if "Overall Health" not in text:
        return False
    gpu: str | None = None
    incidents: dict[tuple[str, str, str], int] = {}
    for line in text.splitlines():
        row = _DCGM_ROW.match(line)
        if row is None:
            continue
        left, right = row.groups()
        head = re.fullmatch(r"GPU ID:\s*(\d+)", left)
        if head is not None:
            gpu = head.group(1)
            status = DCGM_STATUS.get(right.split()[0].lower()) if right else None
            if status is not None:
                report.add("dcgm_status", float(status), gpu=gpu)
            continue
        if left.startswith("Overall Health"):
            gpu = None
            continue
        incident = _DCGM_INCIDENT.match(right)
        if gpu is not None and not left and incident is not None:
            key = (gpu, incident.group(1).strip().lower().replace(" ", "_"), incident.group(2).lower())
            incidents[key] = incidents.get(key, 0) + 1
    for (g, system, severity), count in sorted(incidents.items()):
        report.add("dcgm_incidents", float(count), gpu=g, system=system, severity=severity)
    return True


def render(report: Report) -> str:
    lines: list[str] = []
    for suffix, samples in sorted(report.samples.items()):
        name = f"shardstack_gpu_health_{suffix}"
        kind, text = HELP[suffix]
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            label_text = ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items()))
            number = repr(value) if value != int(value) else str(int(value))
            lines.append(f"{name}{{{label_text}}} {number}" if label_text else f"{name} {number}")
    return "\n".join(lines) + "\n"


def _run(argv: list[str]) -> str | None:
    """A tool's stdout, or None if it is missing, fails or hangs (the patrol reports it as not up)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def patrol(smi_text: str | None, kernel_text: str | None, dcgm_text: str | None) -> Report:
    report = Report()
    buses: dict[str, str] = {}
    smi_up = smi_text is not None
    if smi_text is not None:
        try:
            buses = parse_nvidia_smi(smi_text, report)
        except ValueError as exc:
            print(f"shardstack-gpu-health: {exc}", file=sys.stderr)
            smi_up = False
    report.add("up", 1.0 if smi_up else 0.0, source="nvidia-smi")
    if kernel_text is not None:
        parse_kernel_xids(kernel_text, buses, report)
    dcgm_up = dcgm_text is not None and parse_dcgmi_health(dcgm_text, report)
    report.add("up", 1.0 if dcgm_up else 0.0, source="dcgm")
    report.add("last_run_timestamp_seconds", float(int(time.time())))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--textfile-dir", type=Path, required=True, help="node_exporter's textfile directory")
    parser.add_argument("--nvidia-smi", default="nvidia-smi")
    parser.add_argument("--dcgmi", default="dcgmi", help="empty: do not ask DCGM")
    parser.add_argument("--nvidia-smi-output", type=Path, help="recorded nvidia-smi --query-gpu output")
    parser.add_argument("--kernel-log", type=Path, help="recorded kernel log (journalctl -k -b)")
    parser.add_argument("--dcgmi-output", type=Path, help="recorded dcgmi health -c output")
    args = parser.parse_args(argv)

    if args.nvidia_smi_output is not None:
        smi = args.nvidia_smi_output.read_text()
    else:
        smi = _run([args.nvidia_smi, "--query-gpu=" + ",".join(QUERY_FIELDS), "--format=csv,noheader,nounits"])
    if args.kernel_log is not None:
        kernel = args.kernel_log.read_text()
    else:
        kernel = _run(["journalctl", "-k", "-b", "-o", "cat", "--no-pager", "--grep", "NVRM: Xid"])
        kernel = kernel or ""  # --grep exits 1 when nothing matched: no XIDs
    if args.dcgmi_output is not None:
        dcgm = args.dcgmi_output.read_text()
    elif args.dcgmi:
        dcgm = _run([args.dcgmi, "health", "-g", "0", "-c"])
    else:
        dcgm = None
    path = write(args.textfile_dir / OUTPUT_NAME, render(patrol(smi, kernel, dcgm)))
    print(f"shardstack-gpu-health: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
