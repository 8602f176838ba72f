"""`shardstack train submit|status|stop|logs`: training jobs on the cluster as systemd units (day 2).

submit runs playbooks/train_submit.yml (job config + torchrun settings + `shardstack-train@<job>` on every train
node); status, stop and logs are ad-hoc commands on the train nodes through ansible-runner. The Python API
(`submit`, `status`, `stop`, `logs`) returns typed results for automation.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.runner import RunResult, run_command, run_playbook

JOB_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
TRAIN_GROUP = "train_nodes"


def unit(job: str) -> str:
    return f"shardstack-train@{job}.service"


def check_job_name(name: str) -> str:
    if not JOB_NAME.match(name):
        raise ShardstackError(f"job name {name!r} is not valid", hint="use [a-z0-9_-], up to 63 characters")
    return name


def load_job(path: Path) -> dict[str, Any]:
    """Validate the job config here, before any node sees it; return it normalised (every key explicit)."""
    from shardstack.config import load_config

    if not path.is_file():
        raise ShardstackError(f"job config {path} does not exist")
    return load_config(path).to_dict()


def submit(config: dict[str, Any], name: str, inventory: Path, *, nodes: int | None = None,
           on_event=None) -> RunResult:
    check_job_name(name)
    extravars: dict[str, Any] = {"train_job_name": name, "train_job_config": config}
    if nodes:
        extravars["train_job_nodes"] = nodes
    return run_playbook("playbooks/train_submit.yml", inventory, extravars=extravars, on_event=on_event)


@dataclass
class NodeJobState:
    host: str
    active: str  # systemd ActiveState: active | inactive | failed | activating …
    sub: str
    result: str  # systemd Result: success | exit-code | signal …
    restarts: int  # systemd restarts of the torchrun agent (worker restarts are torchrun's, in the log)
    since: str
    last_step: dict[str, Any] | None = None  # the newest JSON step line rank 0 logged on this node
    error: str | None = None


@dataclass
class JobStatus:
    job: str
    nodes: list[NodeJobState] = field(default_factory=list)

    @property
    def state(self) -> str:
        states = {n.active for n in self.nodes}
        if not self.nodes or states & {"unknown"}:
            return "unknown"
        if "failed" in states:
            return "failed"
        if states & {"active", "activating", "reloading"}:
            return "running"
        return "finished" if all(n.result == "success" for n in self.nodes) else "stopped"

    @property
    def last_step(self) -> dict[str, Any] | None:
        steps = [n.last_step for n in self.nodes if n.last_step]
        return max(steps, key=lambda s: s["step"]) if steps else None

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "state": self.state, "last_step": self.last_step,
                "nodes": [asdict(n) for n in self.nodes]}


_SHOW = "ActiveState,SubState,Result,NRestarts,StateChangeTimestamp"


def parse_step_lines(text: str) -> dict[str, Any] | None:
    """The trainer prints one JSON object per logged step; return the newest."""
    for line in reversed(text.splitlines()):
        start = line.find("{")
        if start < 0:
            continue
        try:
            rec = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "loss" in rec:
            return rec
    return None


def status(name: str, inventory: Path, pattern: str = TRAIN_GROUP) -> JobStatus:
    check_job_name(name)
    shown = run_command(["systemctl", "show", unit(name), "-p", _SHOW], inventory, pattern)
    logs = run_command(["journalctl", "-u", unit(name), "-n", "400", "--no-pager", "-o", "cat"], inventory, pattern)
    out = JobStatus(name)
    for host, res in shown.items():
        props = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
        log = logs.get(host)
        out.nodes.append(NodeJobState(
            host=host, active=props.get("ActiveState", "unknown"), sub=props.get("SubState", ""),
            result=props.get("Result", ""), restarts=int(props.get("NRestarts", "0") or 0),
            since=props.get("StateChangeTimestamp", ""),
            last_step=parse_step_lines(log.stdout) if log and log.success else None,
            error=res.message if not res.success else None))
    return out


def stop(name: str, inventory: Path, pattern: str = TRAIN_GROUP) -> dict[str, bool]:
    check_job_name(name)
    res = run_command(["systemctl", "stop", unit(name)], inventory, pattern)
    return {h: r.success for h, r in res.items()}


def logs(name: str, inventory: Path, lines: int = 50, pattern: str = TRAIN_GROUP) -> dict[str, str]:
    check_job_name(name)
    res = run_command(["journalctl", "-u", unit(name), "-n", str(lines), "--no-pager", "-o", "short-iso"],
                      inventory, pattern)
    return {h: r.stdout if r.success else f"({r.message or r.stderr})" for h, r in res.items()}


# -- CLI ---------------------------------------------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser, dest: str) -> argparse._SubParsersAction:
    """The parser's sub-command action, created if the runtime's `train` parser did not make one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return parser.add_subparsers(dest=dest, metavar="ACTION", required=True)


def register(sub: argparse._SubParsersAction) -> None:
    from shardstack.ops.cli import DEFAULT_INVENTORY

    train = sub.choices.get("train") or sub.add_parser("train", help="training jobs")
    actions = _subparsers(train, "train_command")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-i", "--inventory", type=Path, default=DEFAULT_INVENTORY,
                       help=f"inventory (default {DEFAULT_INVENTORY})")
        p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    p = actions.add_parser("submit", help="start a job on the train nodes as shardstack-train@<job> (systemd)")
    p.add_argument("--config", type=Path, required=True, help="job.yaml (validated here first)")
    p.add_argument("--name", help="job name (default: the config file's stem)")
    p.add_argument("--nodes", type=int, default=None, help="use only the first N train nodes")
    common(p)
    p.set_defaults(func=_submit)

    p = actions.add_parser("status", help="per-node unit state and the newest logged step")
    p.add_argument("name")
    common(p)
    p.set_defaults(func=_status)

    p = actions.add_parser("stop", help="stop the job on every train node (torchrun stops its workers)")
    p.add_argument("name")
    common(p)
    p.set_defaults(func=_stop)

    p = actions.add_parser("logs", help="the job's journal from every train node")
    p.add_argument("name")
    p.add_argument("-n", "--lines", type=int, default=50)
    common(p)
    p.set_defaults(func=_logs)


def _submit(args: argparse.Namespace) -> int:
    from shardstack.ops.cli import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, console, summary_table

    name = check_job_name(args.name or args.config.stem.lower().replace(".", "-"))
    config = load_job(args.config)
    result = submit(config, name, args.inventory, nodes=args.nodes, on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps({"job": name, **result.to_dict()}, indent=2))
    else:
        console.print(summary_table(result, f"train submit {name}"))
        if result.success:
            console.print(f"follow it: shardstack train status {name}; shardstack train logs {name}")
    return EXIT_OK if result.success else EXIT_FAILED_HOSTS


def _status(args: argparse.Namespace) -> int:
    from rich.table import Table

    from shardstack.ops.cli import console

    st = status(args.name, args.inventory)
    if args.json:
        print(json.dumps(st.to_dict(), indent=2))
        return 0 if st.state != "failed" else 1
    last = st.last_step
    table = Table(title=f"job {st.job}: {st.state}" + (f", step {last['step']} loss {last['loss']}" if last else ""))
    for col in ("host", "state", "result", "agent restarts", "since", "last step"):
        table.add_column(col)
    for n in st.nodes:
        table.add_row(n.host, f"{n.active}/{n.sub}", n.result, str(n.restarts), n.since,
                      str(n.last_step["step"]) if n.last_step else (n.error or ""))
    console.print(table)
    return 0 if st.state != "failed" else 1


def _stop(args: argparse.Namespace) -> int:
    done = stop(args.name, args.inventory)
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        for host, ok in done.items():
            print(f"{host}: {'stopped' if ok else 'FAILED to stop'}")
    return 0 if done and all(done.values()) else 1


def _logs(args: argparse.Namespace) -> int:
    out = logs(args.name, args.inventory, args.lines)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for host, text in out.items():
        for line in text.splitlines():
            sys.stdout.write(f"{host} | {line}\n")
    return 0
