"""Jobs queued with Slurm: sbatch from the first train node (submit, through playbooks/train_submit.yml), read and
cancelled on the Slurm controller (squeue, sacct, scancel); their state is Slurm's, mapped into `train status`'s."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardstack.errors import ShardstackError
from shardstack.ops.jobs.common import TRAIN_GROUP, JobStatus, identifier, parse_step_lines
from shardstack.ops.runner import run_command

CONTROLLER = "slurm_controller[0]"


@dataclass
class SlurmJob:
    """The job as Slurm sees it: the newest job of that name (squeue while queued or running, then sacct)."""

    job_id: str
    state: str  # Slurm's: PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, NODE_FAIL, REQUEUED …
    reason: str  # why it waits (Priority, Resources, QOSMaxNodePerJobLimit …) or None
    elapsed: str
    nodes: int
    nodelist: str
    account: str
    qos: str
    start: str = ""  # when this run started (ISO 8601, Slurm's clock), or when it is expected to; N/A, Unknown

    @property
    def started(self) -> str | None:
        """The start of the job's current run for `journalctl --since`, once it has started."""
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", self.start) or self.state.startswith("PENDING"):
            return None
        return self.start.replace("T", " ")


# Slurm's job states, by the state `train status` reports for them.
_STATES = {
    "pending": {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD", "SUSPENDED",
                "PREEMPTED"},
    "running": {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "STOPPED"},
    "finished": {"COMPLETED"},
    "stopped": {"CANCELLED"},
}


def state_of(job: SlurmJob | None) -> str:
    if job is None:
        return "unknown"
    word = job.state.split()[0].rstrip("+")  # "CANCELLED by 0", "RUNNING+"
    return next((k for k, v in _STATES.items() if word in v), "failed")


_SQUEUE_FORMAT = "%i|%T|%r|%M|%D|%N|%a|%q|%S"
_SACCT_FIELDS = "JobIDRaw,State,Reason,Elapsed,NNodes,NodeList,Account,QOS,Start"


def parse_slurm_job(text: str) -> SlurmJob | None:
    """The newest job in squeue (`-o %i|%T|%r|%M|%D|%N|%a|%q|%S`) or sacct (`-P -X -o` the same fields) output."""
    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 9 or not parts[0].isdigit():
            continue
        job_id, state, reason, elapsed, nodes, nodelist, account, qos, start = parts
        jobs.append(SlurmJob(job_id, state, reason, elapsed, int(nodes) if nodes.isdigit() else 0, nodelist,
                             account, qos, start))
    return max(jobs, key=lambda j: int(j.job_id)) if jobs else None


def _on_controller(argv: list[str], inventory: Path) -> str:
    """A Slurm command's output on the controller (squeue, sacct, scancel read or act on its state)."""
    res = next(iter(run_command(argv, inventory, CONTROLLER).values()), None)
    if res is None:
        raise ShardstackError("the inventory has no slurm_controller host")
    if not res.success:
        raise ShardstackError(f"{argv[0]} failed on the Slurm controller {res.host}: {res.message or res.stderr}")
    return res.stdout


def status(name: str, user: str, inventory: Path) -> JobStatus:
    job = parse_slurm_job(_on_controller(["squeue", "--noheader", "--name", name, "--user", user,
                                          "--format", _SQUEUE_FORMAT], inventory))
    if job is None:  # not queued any more: the newest one accounting has (its last 30 days)
        job = parse_slurm_job(_on_controller(["sacct", "--noheader", "--parsable2", "--allocations", "--name", name,
                                              "--user", user, "--starttime", "now-30days",
                                              "--format", _SACCT_FIELDS], inventory))
    out = JobStatus(name, state_of(job), scheduler="slurm", slurm=job)
    if job is not None and job.started:  # steps of this run only (an earlier job of that name logged its own)
        logs = run_command(["journalctl", "--identifier", identifier(name), "--since", job.started, "-n", "400",
                            "--no-pager", "-o", "cat"], inventory, TRAIN_GROUP)
        out.steps = {h: step for h, r in logs.items() if r.success and (step := parse_step_lines(r.stdout))}
    return out


def stop(name: str, user: str, inventory: Path) -> dict[str, bool]:
    res = run_command(["scancel", "--name", name, "--user", user], inventory, CONTROLLER)
    if not res:
        raise ShardstackError("the inventory has no slurm_controller host")
    return {h: r.success for h, r in res.items()}


def log_selector(name: str) -> list[str]:
    """The job's agents log under the same identifier as a systemd job's."""
    return ["--identifier", identifier(name)]
