#!/usr/bin/python3
"""Slurm's nodes and queue as Prometheus metrics, for node_exporter's textfile collector.

Run by shardstack-slurm-metrics.timer on the controller: `scontrol show node -o` and `squeue`, rendered to
<dir>/slurm.prom through the shared writer (shardstack_textfile: atomic, fsync'd), so node_exporter never reads
half a file. When Slurm does not answer, only slurm_scrape_success 0 and the timestamp are written (the alerts key
on them).
Standard library only: it runs with the node's python3, not the training venv.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter

from shardstack_textfile import escape, write  # beside this script (shardstack_common)

_FIELD = re.compile(r"(\w+)=(.*?)(?=\s+\w+=|$)")


def parse_nodes(text: str) -> list[dict[str, str]]:
    """`scontrol show node -o`: one line per node, `Key=value` fields (a value may contain spaces: Reason)."""
    return [dict(_FIELD.findall(line.strip())) for line in text.splitlines() if line.startswith("NodeName=")]


def node_state(raw: str) -> tuple[str, bool]:
    """(state, responding) from scontrol's State, e.g. IDLE, MIXED+DRAIN, DOWN+NOT_RESPONDING, IDLE*. Named as
    sinfo names them: DRAIN on an idle node is "drained", on a busy one "draining"."""
    responding = "*" not in raw and "NOT_RESPONDING" not in raw
    base, *flags = raw.replace("*", "").lower().split("+")
    if base == "down":
        return "down", responding
    if "fail" in flags:
        return ("fail" if base == "idle" else "failing"), responding
    if "drain" in flags:
        return ("drained" if base == "idle" else "draining"), responding
    return base, responding


def tres(value: str, key: str) -> int:
    """One count from a TRES list (cpu=8,mem=64G,gres/gpu=2)."""
    for item in value.split(","):
        name, _, count = item.partition("=")
        if name == key and count.isdigit():
            return int(count)
    return 0


def render(nodes_text: str, jobs_text: str, now: float) -> str:
    """The textfile: node states, CPUs and GPUs per node, jobs by state and partition, pending jobs by reason."""
    out: list[str] = []

    def metric(name: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")
        for labels, value in samples:
            text = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{text}}} {value:g}" if text else f"{name} {value:g}")

    nodes = parse_nodes(nodes_text)
    states = {n["NodeName"]: node_state(n.get("State", "UNKNOWN")) for n in nodes}
    metric("slurm_node_state", "1 for the node's current state (idle, allocated, mixed, down, drained, draining, "
                               "fail, ...); reason is the admin's or Slurm's.",
           [({"slurm_node": n["NodeName"], "state": states[n["NodeName"]][0], "reason": n.get("Reason", "")}, 1)
            for n in nodes])
    metric("slurm_node_responding", "1 while the node's slurmd answers slurmctld.",
           [({"slurm_node": name}, int(responding)) for name, (_, responding) in states.items()])
    metric("slurm_node_cpus", "CPUs of the node: total and allocated to jobs.",
           [({"slurm_node": n["NodeName"], "state": s}, int(n.get(k, "0") or 0))
            for n in nodes for s, k in (("total", "CPUTot"), ("alloc", "CPUAlloc"))])
    metric("slurm_node_gpus", "GPUs (GRES gpu) of the node: total and allocated to jobs.",
           [({"slurm_node": n["NodeName"], "state": s}, tres(n.get(k, ""), "gres/gpu"))
            for n in nodes for s, k in (("total", "CfgTRES"), ("alloc", "AllocTRES"))])
    counts = Counter(state for state, _ in states.values())
    metric("slurm_nodes", "Nodes per state.", [({"state": s}, c) for s, c in sorted(counts.items())])

    jobs = [line.split("|") for line in jobs_text.splitlines() if line.count("|") >= 2]
    by_state = Counter((state.lower(), partition) for state, partition, *_ in jobs)
    metric("slurm_queue_jobs", "Jobs in the queue per state and partition.",
           [({"state": s, "partition": p}, c) for (s, p), c in sorted(by_state.items())])
    reasons = Counter(reason for state, _, reason, *_ in jobs if state == "PENDING")
    metric("slurm_queue_pending_jobs", "Pending jobs per reason (Priority, Resources, QOSMaxGRESPerUser, ...).",
           [({"reason": r}, c) for r, c in sorted(reasons.items())])
    metric("slurm_scrape_success", "1 when the last collection reached slurmctld.", [({}, 1)])
    metric("slurm_scrape_timestamp_seconds", "When the last collection ran (Unix time).", [({}, now)])
    return "\n".join(out) + "\n"


def failed(now: float) -> str:
    return ("# HELP slurm_scrape_success 1 when the last collection reached slurmctld.\n"
            "# TYPE slurm_scrape_success gauge\nslurm_scrape_success 0\n"
            "# HELP slurm_scrape_timestamp_seconds When the last collection ran (Unix time).\n"
            f"# TYPE slurm_scrape_timestamp_seconds gauge\nslurm_scrape_timestamp_seconds {now:g}\n")


def collect(now: float) -> str:
    try:
        nodes = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True, check=True,
                               timeout=30).stdout
        jobs = subprocess.run(["squeue", "-h", "-a", "-o", "%T|%P|%r"], capture_output=True, text=True,
                              check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"slurm_metrics: Slurm did not answer: {exc}", file=sys.stderr)
        return failed(now)
    return render(nodes, jobs, now)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: slurm_metrics.py TEXTFILE_DIR  (or - for stdout)", file=sys.stderr)
        return 2
    text = collect(time.time())
    if argv[1] == "-":
        sys.stdout.write(text)
    else:
        write(os.path.join(argv[1], "slurm.prom"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
