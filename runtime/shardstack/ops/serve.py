"""`shardstack serve rollout`: upgrade the inference nodes one at a time behind the load balancer
(playbooks/rolling_upgrade.yml through ansible-runner); `shardstack serve publish JOB[@STEP]`: export a job's
checkpoint on a train node (which holds the signing key) to <shared>/exports, switch exports/current to it, roll out."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops import storage
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import RunResult, run_command, run_playbook

_JOB_REF = re.compile(r"^([a-z0-9][a-z0-9_-]{0,62})(?:@(\d{1,8}))?$")  # a job name as `train submit` takes it


def rollout(cluster: Cluster, *, limit: str | None = None, extravars: dict[str, Any] | None = None,
            on_event=None) -> RunResult:
    return run_playbook("playbooks/rolling_upgrade.yml", cluster.path, limit=limit, extravars=extravars,
                        on_event=on_event)


def parse_job_ref(text: str) -> tuple[str, int | None]:
    """JOB or JOB@STEP (STEP a checkpoint's step number) → (job, step or None: the newest valid checkpoint)."""
    m = _JOB_REF.match(text)
    if not m:
        raise ShardstackError(f"{text!r} is not JOB or JOB@STEP",
                              hint="a job name ([a-z0-9_-]), optionally @ and a step number, e.g. run1@1200")
    return m[1], int(m[2]) if m[2] is not None else None


def step_dir(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step_{step:08d}"  # shardstack.train.checkpoint.layout.step_dir_name


def export_name(job: str, step: int) -> str:
    """One directory per published step, so exports/current switches between whole exports and never rewrites the
    one being served."""
    return f"{job}-step_{step:08d}"


@dataclass
class JobCheckpoints:
    """Where a job's checkpoints are and how they are signed, from its config on the first train node."""

    host: str
    root: str
    key_file: str
    signed: bool


def job_checkpoints(cluster: Cluster, job: str) -> JobCheckpoints:
    """The job's checkpoint.dir and signing settings as the train nodes have them (<jobs_dir>/<job>.yaml, written by
    `train submit`): the checkpoints are wherever its config put them."""
    import yaml

    head = cluster.group("train_nodes")[0]
    jobs_dir = cluster.setting("training_runtime_jobs_dir", "training_runtime", "train_nodes")
    path = f"{jobs_dir}/{job}.yaml"
    r = run_command(["cat", "--", path], cluster.path, head).get(head)
    if r is None or not r.success:
        raise ShardstackError(f"no job {job} on {head}: cannot read {path}",
                              hint="shardstack train submit names the job; `train status JOB` shows it")
    config = yaml.safe_load(r.stdout) or {}
    ck = config.get("checkpoint") or {}
    if not ck.get("dir"):
        raise ShardstackError(f"job {job} saves no checkpoints (checkpoint.dir is not set in {path})")
    from shardstack.signing import DEFAULT_KEY_FILE

    return JobCheckpoints(head, str(ck["dir"]), str(ck.get("signing_key_file") or DEFAULT_KEY_FILE),
                          bool(ck.get("require_signature", True)))


def newest_valid_step(cluster: Cluster, where: JobCheckpoints, user: str, venv: str) -> int:
    """The newest checkpoint `shardstack checkpoint ls` finds valid (sizes and signature; export checks sha256)."""
    argv = ["runuser", "-u", user, "--", f"{venv}/bin/shardstack", "checkpoint", "ls", where.root, "--json",
            *(["--key-file", where.key_file] if where.signed else ["--allow-unsigned"])]
    r = run_command(argv, cluster.path, where.host).get(where.host)
    if r is None or not r.success:
        detail = ((r.stderr or r.message or "") if r else "no result").strip().splitlines()
        raise ShardstackError(f"checkpoint ls {where.root} on {where.host} failed: {detail[-1] if detail else ''}")
    return pick_newest_valid(json.loads(r.stdout[r.stdout.index("{"):]), where.root)


def pick_newest_valid(listing: dict[str, Any], root: str) -> int:
    valid = [c["step"] for c in listing.get("checkpoints", []) if c.get("valid")]
    if not valid:
        raise ShardstackError(f"no valid checkpoint under {root}", hint=f"shardstack checkpoint verify {root} (on a "
                              "train node) says why")
    return max(valid)


@dataclass
class Published:
    job: str
    step: int
    export: storage.ClusterExport
    rollout: RunResult | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "step": self.step, "host": self.export.host, "path": self.export.out_dir,
                "current": self.export.current, "signed": self.export.signed,
                "rollout": self.rollout.to_dict() if self.rollout else None}


def publish(cluster: Cluster, ref: str, *, rollout_after: bool = True, on_event=None) -> Published:
    """Export JOB's checkpoint at STEP (or its newest valid one) on the first train node as the job account, signed
    with the node's key, to <shared>/exports/<job>-step_<N>; point exports/current at it; roll the inference nodes
    out unless told not to."""
    job, step = parse_job_ref(ref)
    where = job_checkpoints(cluster, job)
    venv = str(cluster.setting("training_runtime_venv", "training_runtime", "train_nodes"))
    if step is None:
        step = newest_valid_step(cluster, where, cluster.job_account, venv)
    exp = storage.export_current(cluster, step_dir(where.root, step), export_name(job, step),
                                 key_file=where.key_file, allow_unsigned=not where.signed)
    out = Published(job, exp.step if exp.step is not None else step, exp)
    if rollout_after:
        out.rollout = rollout(cluster, on_event=on_event)
    return out
