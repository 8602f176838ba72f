"""Inference replicas that Slurm runs (nodes with `inference_service_scheduled`; docs/roles.md, "Inference replicas
as Slurm jobs"): one job of the inference account and QOS per replica, one whole node with the `inference` feature.
The slurm role's prolog starts that node's `shardstack-inference.service` for the job and its epilog stops it (a
drain, docs/serving.md); the job itself only holds the node while the unit runs. HAProxy lists every inference node
and follows its health checks, so a replica joins the pool once it answers /health and leaves it while it drains:
no reload, no runtime API.

`scale` submits or cancels jobs to reach a count: `shardstack serve scale` and the autoscaler call it, through a
`Slurm`: from the controller machine (`ClusterSlurm`, ansible-runner) or on a Slurm host (`LocalSlurm`, the
autoscaler's unit).
"""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass
from typing import Any, Protocol

from shardstack.errors import ShardstackError
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.slurm import CONTROLLER
from shardstack.ops.runner import run_command
from shardstack.ops.train import SLURM_NAME

JOB_NAME = "shardstack-replica"
UNIT = "shardstack-inference.service"
INFERENCE_GROUP = "inference_nodes"
# squeue's fields: job id, state, node, submit time.
_FORMAT = "%i|%T|%N|%V"


def hold_script(interval: float = 5, start_polls: int = 12) -> str:
    """The job's script, as the job account: hold the node while the unit the prolog started is starting, serving or
    restarting; end (and so free the node) once it has stopped or failed, or if it never started within
    `start_polls` × `interval` seconds. scancel ends it, and the epilog drains the unit."""
    return (f"u={UNIT}; seen=0; n=0; while :; do case $(systemctl show -p ActiveState --value $u) in "
            "active|activating|reloading|deactivating) seen=1 ;; "
            f"*) {{ [ $seen = 1 ] || [ $n -ge {start_polls} ]; }} && exit 1 ;; esac; n=$((n + 1)); sleep {interval}; "
            "done")


@dataclass(frozen=True)
class ReplicaJob:
    job_id: int
    state: str  # Slurm's: PENDING, RUNNING, COMPLETING …
    node: str  # "" while pending
    submitted: str

    @property
    def pending(self) -> bool:
        return self.state in ("PENDING", "CONFIGURING", "REQUEUED")


@dataclass(frozen=True)
class ReplicaSettings:
    """How replica jobs are submitted: the Slurm account, the QOS (the one that may preempt training) and the node
    feature."""

    account: str = "inference"
    qos: str = "inference"
    feature: str = "inference"

    def __post_init__(self) -> None:
        for what, value in (("account", self.account), ("qos", self.qos), ("feature", self.feature)):
            if not SLURM_NAME.match(value):
                raise ShardstackError(f"replica {what} {value!r} is not a Slurm name", hint="[A-Za-z0-9_.-]")


def parse(text: str) -> list[ReplicaJob]:
    """squeue's `--noheader --format %i|%T|%N|%V` lines → jobs, oldest first."""
    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0].isdigit():
            jobs.append(ReplicaJob(int(parts[0]), parts[1], "" if parts[2] in ("", "(null)") else parts[2],
                                   parts[3]))
    return sorted(jobs, key=lambda j: j.job_id)


def plan(jobs: list[ReplicaJob], want: int) -> tuple[int, list[int]]:
    """How many jobs to submit and which to cancel to have `want`: pending ones go first (they serve nothing yet),
    then the newest running ones (the oldest have warmed up the longest)."""
    if want < 0:
        raise ShardstackError(f"replicas must be 0 or more, got {want}")
    if want >= len(jobs):
        return want - len(jobs), []
    order = [j for j in reversed(jobs) if j.pending] + [j for j in reversed(jobs) if not j.pending]
    return 0, [j.job_id for j in order[:len(jobs) - want]]


def sbatch_argv(s: ReplicaSettings) -> list[str]:
    """One replica's job: one whole node with the inference feature, holding it while its unit runs."""
    return ["sbatch", "--parsable", f"--job-name={JOB_NAME}", f"--account={s.account}", f"--qos={s.qos}", "--nodes=1",
            "--exclusive", f"--constraint={s.feature}", "--output=/dev/null", "--chdir=/tmp", f"--wrap={hold_script()}"]


class Slurm(Protocol):
    """Where Slurm's commands run: `query` (squeue, scancel) and `submit` (sbatch, as the job account)."""

    def query(self, argv: list[str]) -> str: ...

    def submit(self, argv: list[str]) -> str: ...


@dataclass(frozen=True)
class ClusterSlurm:
    """From the controller machine, through ansible-runner: squeue and scancel on the Slurm controller, sbatch as
    the job account on the first inference node (a Slurm node, with the account)."""

    cluster: Cluster

    @classmethod
    def of(cls, cluster: Cluster) -> ClusterSlurm:
        if cluster.scheduler != "slurm":
            raise ShardstackError("replicas are Slurm jobs only where shardstack_scheduler is slurm",
                                  hint="without Slurm every inference node runs its replica (systemd)")
        if not scheduled(cluster):
            raise ShardstackError("the inference nodes run their replicas themselves (systemd), not as Slurm jobs",
                                  hint="set inference_service_scheduled: true for inference_nodes (docs/roles.md)")
        return cls(cluster)

    def query(self, argv: list[str]) -> str:
        res = next(iter(run_command(argv, self.cluster.path, CONTROLLER).values()), None)
        if res is None:
            raise ShardstackError("the inventory has no slurm_controller host",
                                  hint="replicas run as Slurm jobs only with shardstack_scheduler: slurm")
        if not res.success:
            raise ShardstackError(f"{argv[0]} failed on the Slurm controller {res.host}: {res.message or res.stderr}")
        return res.stdout

    def submit(self, argv: list[str]) -> str:
        host = self.cluster.group(INFERENCE_GROUP)[0]
        res = run_command(["runuser", "-u", self.cluster.job_account, "--", *argv], self.cluster.path, host)[host]
        if not res.success:
            raise ShardstackError(f"{argv[0]} on {host} failed: {res.stderr.strip() or res.message}",
                                  hint=f"{self.cluster.job_account} must be a user of the replicas' Slurm account "
                                       "and QOS")
        return res.stdout


@dataclass(frozen=True)
class LocalSlurm:
    """On a Slurm host (the autoscaler's unit on the controller): the commands here; sbatch as `job_user` (a user of
    the replicas' Slurm account) when this process is root (the child drops to it before exec: only CAP_SETUID and
    CAP_SETGID, no setuid binary), as this process's user when empty."""

    job_user: str = ""
    timeout: float = 60.0

    def _run(self, argv: list[str], **as_user: Any) -> str:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, check=False, **as_user)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ShardstackError(f"{argv[0]}: {exc}") from None
        if proc.returncode != 0:
            raise ShardstackError(f"{argv[0]} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def query(self, argv: list[str]) -> str:
        return self._run(argv)

    def submit(self, argv: list[str]) -> str:
        if not self.job_user:
            return self._run(argv)
        try:
            pw = pwd.getpwnam(self.job_user)
        except KeyError:
            raise ShardstackError(f"the job account {self.job_user!r} is not a user here") from None
        env = {**os.environ, "HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name}
        return self._run(argv, user=pw.pw_uid, group=pw.pw_gid,
                         extra_groups=os.getgrouplist(pw.pw_name, pw.pw_gid), env=env)


def replicas(slurm: Slurm) -> list[ReplicaJob]:
    """The replica jobs Slurm has now, queued or running."""
    return parse(slurm.query(["squeue", "--noheader", f"--name={JOB_NAME}", f"--format={_FORMAT}"]))


@dataclass(frozen=True)
class ScaleResult:
    before: list[ReplicaJob]
    submitted: list[int]
    cancelled: list[int]


def scale(slurm: Slurm, want: int, settings: ReplicaSettings) -> ScaleResult:
    """Submit or cancel replica jobs so that `want` are queued or running."""
    before = replicas(slurm)
    add, cancel = plan(before, want)
    if cancel:
        slurm.query(["scancel", *map(str, cancel)])
    submitted = [int(slurm.submit(sbatch_argv(settings)).strip().split(";")[0]) for _ in range(add)]
    return ScaleResult(before, submitted, cancel)


def scheduled(cluster: Cluster) -> bool:
    """Whether this cluster's replicas are Slurm jobs: its inference nodes say inference_service_scheduled."""
    hosts = cluster.hosts(INFERENCE_GROUP)
    return bool(hosts) and all(bool(cluster.host_setting("inference_service_scheduled", "inference_service", h))
                               for h in hosts)
