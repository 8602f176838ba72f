"""`shardstack train submit|status|stop|logs`: training jobs on the cluster as systemd units (day 2).

submit runs playbooks/train_submit.yml (job config + torchrun settings + `shardstack-train@<job>` on every train
node); status, stop and logs are ad-hoc commands on the train nodes through ansible-runner. The Python API
(`submit`, `status`, `stop`, `logs`) returns typed results for automation.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops import cordon
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
    from shardstack.train.config import load_config  # torch: only for the commands that take a job config

    if not path.is_file():
        raise ShardstackError(f"job config {path} does not exist")
    return load_config(path).to_dict()


def submit(config: dict[str, Any], name: str, inventory: Path, *, nodes: int | None = None,
           on_event=None) -> RunResult:
    check_job_name(name)
    extravars: dict[str, Any] = {"train_job_name": name, "train_job_config": config}
    if nodes:
        extravars["train_job_nodes"] = nodes
    # Cordoned train nodes (`shardstack node cordon`) are left out; the playbook refuses if too few remain.
    if excluded := cordon.cordoned(inventory, "train"):
        extravars["train_job_exclude"] = excluded
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


def demo_job(steps: int, shared_dir: str, name: str = "demo", *, init_from: str | None = None) -> dict[str, Any]:
    """The demo's job (also the e2e's): ZeRO stage 3 (FSDP2) across 2 nodes on CPU, on the shipped corpus. With
    `init_from` (a Hugging Face directory every train node sees, e.g. the pretrained model `cluster.place_model` put
    on shared storage) it fine-tunes that model, the corpus prepared with its tokenizer; without, it trains a tiny
    byte-level GPT from scratch."""
    from shardstack.train.config import config_from_dict

    if init_from is None:
        model: dict[str, Any] = {"size": "tiny"}
        data: dict[str, Any] = {"path": f"{shared_dir}/data/corpus"}
        lr, warmup = 3e-3, min(20, steps // 10)
    else:
        model = {"init_from": init_from}
        data = {"path": f"{shared_dir}/data/corpus-{Path(init_from).name}", "tokenizer": init_from}
        # A model pretrained on this corpus: a tenth of its peak learning rate, a short warm-up.
        lr, warmup = 3e-4, min(10, steps // 10)
    cfg = {
        "model": model,
        "data": data,
        "engine": {"stage": 3, "device": "auto"},
        "optimizer": {"lr": lr},
        "schedule": {"warmup_steps": warmup, "total_steps": steps},
        "batch": {"global_batch": 8, "micro_batch": 4},
        "checkpoint": {"dir": f"{shared_dir}/checkpoints/{name}", "interval": max(10, steps // 6), "keep": 2},
        "metrics": {"port": 9400, "log_every": 10},
    }
    return config_from_dict(cfg).to_dict()
