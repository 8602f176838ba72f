"""Jobs as systemd units: `shardstack-train@<job>` on every train node of the job (submit starts them through
playbooks/train_submit.yml); their state is the units'."""

from __future__ import annotations

from pathlib import Path

from shardstack.ops.jobs.common import TRAIN_GROUP, JobStatus, NodeJobState, parse_step_lines, unit
from shardstack.ops.runner import run_command

_SHOW = "ActiveState,SubState,Result,NRestarts,StateChangeTimestamp"


def state_of(nodes: list[NodeJobState]) -> str:
    """The job's state from its units': failed if one failed, running while one runs, then finished when every
    unit succeeded, else stopped."""
    states = {n.active for n in nodes}
    if not nodes or states & {"unknown"}:
        return "unknown"
    if "failed" in states:
        return "failed"
    if states & {"active", "activating", "reloading"}:
        return "running"
    return "finished" if all(n.result == "success" for n in nodes) else "stopped"


def status(name: str, inventory: Path, pattern: str = TRAIN_GROUP) -> JobStatus:
    shown = run_command(["systemctl", "show", unit(name), "-p", _SHOW], inventory, pattern)
    logs = run_command(["journalctl", "-u", unit(name), "-n", "400", "--no-pager", "-o", "cat"], inventory, pattern)
    nodes = []
    for host, res in shown.items():
        props = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
        log = logs.get(host)
        nodes.append(NodeJobState(
            host=host, active=props.get("ActiveState", "unknown"), sub=props.get("SubState", ""),
            result=props.get("Result", ""), restarts=int(props.get("NRestarts", "0") or 0),
            since=props.get("StateChangeTimestamp", ""),
            last_step=parse_step_lines(log.stdout) if log and log.success else None,
            error=res.message if not res.success else None))
    return JobStatus(name, state_of(nodes), nodes)


def stop(name: str, inventory: Path, pattern: str = TRAIN_GROUP) -> dict[str, bool]:
    res = run_command(["systemctl", "stop", unit(name)], inventory, pattern)
    return {h: r.success for h, r in res.items()}


def log_selector(name: str) -> list[str]:
    """The unit's journal, with systemd's lines about it."""
    return ["-u", unit(name)]
