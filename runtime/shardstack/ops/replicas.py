"""Inference replicas that Slurm runs (nodes with `inference_service_scheduled`; docs/roles.md, "Inference replicas
as Slurm jobs"): one job of the inference account and QOS per replica, one whole node with the `inference` feature.
The slurm role's prolog starts that node's `shardstack-inference.service` for the job and its epilog stops it (a
drain, docs/serving.md); the job itself only holds the node while the unit runs. HAProxy lists every inference node
and follows its health checks, so a replica joins the pool once it answers /health and leaves it while it drains:
no reload, no runtime API.

`scale` submits or cancels jobs to reach a count: `shardstack serve scale` and the autoscaler call it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Who submits replica jobs and how: the job account (a user of the Slurm account), the account, the QOS (the
    one that may preempt training) and the node feature."""

    user: str
    account: str = "inference"
    qos: str = "inference"
    feature: str = "inference"

    def __post_init__(self) -> None:
        for what, value in (("account", self.account), ("qos", self.qos), ("feature", self.feature)):
            if not SLURM_NAME.match(value):
                raise ShardstackError(f"replica {what} {value!r} is not a Slurm name", hint="[A-Za-z0-9_.-]")

    @classmethod
    def of(cls, cluster: Cluster, account: str = "inference", qos: str = "inference") -> ReplicaSettings:
        return cls(user=cluster.job_account, account=account, qos=qos)


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
    """One replica's job, submitted as the job account on an inference node (where it exists, with Slurm's client)."""
    return ["runuser", "-u", s.user, "--", "sbatch", "--parsable", f"--job-name={JOB_NAME}", f"--account={s.account}",
            f"--qos={s.qos}", "--nodes=1", "--exclusive", f"--constraint={s.feature}", "--output=/dev/null",
            "--chdir=/tmp", f"--wrap={hold_script()}"]


def _controller(argv: list[str], cluster: Cluster) -> str:
    res = next(iter(run_command(argv, cluster.path, CONTROLLER).values()), None)
    if res is None:
        raise ShardstackError("the inventory has no slurm_controller host",
                              hint="replicas run as Slurm jobs only with shardstack_scheduler: slurm")
    if not res.success:
        raise ShardstackError(f"{argv[0]} failed on the Slurm controller {res.host}: {res.message or res.stderr}")
    return res.stdout


def replicas(cluster: Cluster) -> list[ReplicaJob]:
    """The replica jobs Slurm has now, queued or running."""
    return parse(_controller(["squeue", "--noheader", f"--name={JOB_NAME}", f"--format={_FORMAT}"], cluster))


@dataclass(frozen=True)
class ScaleResult:
    before: list[ReplicaJob]
    submitted: list[int]
    cancelled: list[int]


def scale(cluster: Cluster, want: int, settings: ReplicaSettings) -> ScaleResult:
    """Submit or cancel replica jobs so that `want` are queued or running."""
    if cluster.scheduler != "slurm":
        raise ShardstackError("replicas are Slurm jobs only where shardstack_scheduler is slurm",
                              hint="without Slurm every inference node runs its replica (systemd)")
    if not scheduled(cluster):
        raise ShardstackError("the inference nodes run their replicas themselves (systemd), not as Slurm jobs",
                              hint="set inference_service_scheduled: true for inference_nodes (docs/roles.md)")
    before = replicas(cluster)
    add, cancel = plan(before, want)
    if cancel:
        _controller(["scancel", *map(str, cancel)], cluster)
    submitted = []
    if add:
        host = cluster.group(INFERENCE_GROUP)[0]
        for _ in range(add):
            res = run_command(sbatch_argv(settings), cluster.path, host)[host]
            if not res.success:
                raise ShardstackError(f"sbatch on {host} failed: {res.stderr.strip() or res.message}",
                                      hint=f"{settings.user} must be a user of Slurm account {settings.account} "
                                           f"with QOS {settings.qos}")
            submitted.append(int(res.stdout.strip().split(";")[0]))
    return ScaleResult(before, submitted, cancel)


def scheduled(cluster: Cluster) -> bool:
    """Whether this cluster's replicas are Slurm jobs: its inference nodes say inference_service_scheduled."""
    hosts = cluster.hosts(INFERENCE_GROUP)
    return bool(hosts) and all(bool(cluster.host_setting("inference_service_scheduled", "inference_service", h))
                               for h in hosts)
