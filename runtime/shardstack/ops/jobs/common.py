"""What every job backend shares: the job's names on the nodes, one node's view of it, and the status `train status`
reports whichever backend runs the job (each backend maps its own states into `JobStatus.state`)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from shardstack.errors import ShardstackError

JOB_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
TRAIN_GROUP = "train_nodes"
# What a job is, in the words `train status` uses for every backend.
STATES = ("pending", "running", "finished", "stopped", "failed", "unknown")


def unit(job: str) -> str:
    return f"shardstack-train@{job}.service"


def identifier(job: str) -> str:
    """The job's journal identifier on every train node, under systemd (the unit's SyslogIdentifier) and Slurm."""
    return f"shardstack-train-{job}"


def check_job_name(name: str) -> str:
    if not JOB_NAME.match(name):
        raise ShardstackError(f"job name {name!r} is not valid", hint="use [a-z0-9_-], up to 63 characters")
    return name


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
    state: str  # one of STATES, as the backend that runs the job maps its own
    nodes: list[NodeJobState] = field(default_factory=list)
    scheduler: str = "systemd"
    # The Slurm job, a jobs.slurm.SlurmJob (scheduler slurm; None: no job of that name). Not typed as one: the
    # backends import this module, never the other way round.
    slurm: Any = None
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)  # Slurm: host → newest logged step there

    @property
    def last_step(self) -> dict[str, Any] | None:
        steps = [n.last_step for n in self.nodes if n.last_step] + list(self.steps.values())
        return max(steps, key=lambda s: s["step"]) if steps else None

    def to_dict(self) -> dict[str, Any]:
        out = {"job": self.job, "scheduler": self.scheduler, "state": self.state, "last_step": self.last_step,
               "nodes": [asdict(n) for n in self.nodes]}
        if self.scheduler == "slurm":
            out["slurm"] = asdict(self.slurm) if self.slurm else None
        return out


def step_records(text: str) -> list[dict[str, Any]]:
    """The trainer prints one JSON object per logged step (after a journal prefix or none): every one, in order."""
    records = []
    for line in text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            rec = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "loss" in rec:
            records.append(rec)
    return records


def parse_step_lines(text: str) -> dict[str, Any] | None:
    """The newest logged step."""
    records = step_records(text)
    return records[-1] if records else None
