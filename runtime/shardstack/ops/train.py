"""`shardstack train submit|status|stop|logs`: training jobs on the cluster (day 2), run by the inventory's
`shardstack_scheduler`: systemd units or Slurm jobs.

submit runs playbooks/train_submit.yml: with systemd, the job config, torchrun settings and `shardstack-train@<job>`
on every train node; with Slurm, the config on every train node and an sbatch job (srun torchrun) from the first.
status, stop and logs are ad-hoc commands through ansible-runner: systemctl and journalctl on the train nodes, or
squeue/sacct/scancel on the Slurm controller. The Python API (`submit`, `status`, `stop`, `logs`, `wait_job`)
returns typed results for automation.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops import cordon, storage
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs import slurm, systemd
from shardstack.ops.jobs.common import TRAIN_GROUP, JobStatus, check_job_name
from shardstack.ops.runner import RunResult, run_command, run_playbook

SLURM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d\d){0,2}$")


def load_job(path: Path) -> dict[str, Any]:
    """Validate the job config here, before any node sees it; return it normalised (every key explicit)."""
    from shardstack.train.config import load_config  # torch: only for the commands that take a job config

    if not path.is_file():
        raise ShardstackError(f"job config {path} does not exist")
    return load_config(path).to_dict()


def shared_paths(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The job config's paths every node of the job must see the same: (key, path) of those set."""
    data, ck, model = (config.get(k) or {} for k in ("data", "checkpoint", "model"))
    found = [("data.path", data.get("path")), ("checkpoint.dir", ck.get("dir")),
             ("model.init_from", model.get("init_from"))]
    if ck.get("resume") not in (None, "auto", "never"):
        found.append(("checkpoint.resume", ck["resume"]))
    return [(k, str(v)) for k, v in found if v is not None]


def job_shared_dir(cluster: Cluster) -> str:
    """Where jobs read data and write checkpoints: training_runtime_shared_dir when the inventory sets it (a cluster
    may keep its jobs in a directory of their own on the shared storage), else the shared directory itself."""
    return str(cluster.first_hostvars(TRAIN_GROUP).get("training_runtime_shared_dir") or cluster.shared_dir)


def check_shared_paths(config: dict[str, Any], shared: str) -> None:
    """Refuse a path that is not on shared storage: each node would read (or write) its own copy."""
    for key, path in shared_paths(config):
        if not storage.on_shared(path, shared):
            raise ShardstackError(f"{key} {path} is not under the shared directory {shared}",
                                  hint="every node of a job reads its data and model and writes its checkpoints "
                                       "there: shardstack data put / model put copy them")


def missing_argv(paths: list[str]) -> list[str]:
    """Print each of `paths` that does not exist on the node (one command, nothing printed: all there)."""
    return ["sh", "-c", 'for p in "$@"; do [ -e "$p" ] || printf "%s\\n" "$p"; done', "sh", *paths]


def check_inputs(config: dict[str, Any], cluster: Cluster, host: str) -> None:
    """The prepared data set (data.path/meta.json) and init_from's config.json exist on the cluster: the job's task
    would otherwise tokenise the shipped demo corpus into data.path without a word."""
    data = (config.get("data") or {}).get("path")
    init_from = (config.get("model") or {}).get("init_from")
    wanted = {f"{data}/meta.json": "data.path", f"{init_from}/config.json": "model.init_from"}
    wanted = {p: k for p, k in wanted.items() if not p.startswith("None/")}
    if not wanted:
        return
    r = run_command(missing_argv(list(wanted)), cluster.path, host).get(host)
    if r is None or not r.success:
        raise ShardstackError(f"cannot check the job's inputs on {host}: "
                              f"{((r.stderr or r.message) if r else 'no result') or ''}".strip())
    for path in r.stdout.splitlines():
        key = wanted.get(path)
        if key == "data.path":
            raise ShardstackError(f"data.path {data} holds no prepared data set on the cluster (no meta.json)",
                                  hint="put one there: shardstack data put SHARDS --name NAME, or shardstack data "
                                       "prepare --cluster INPUT --out-name NAME")
        if key == "model.init_from":
            raise ShardstackError(f"model.init_from {init_from} is not a model directory on the cluster (no "
                                  "config.json)", hint="put it there: shardstack model put DIR")


def submit(config: dict[str, Any], name: str, cluster: Cluster, *, nodes: int | None = None,
           account: str | None = None, qos: str | None = None, time_limit: str | None = None,
           allow_config_change: bool = False, prepare_demo_data: bool = False, on_event=None) -> RunResult:
    """Start the job (systemd) or queue it (Slurm: `account`, `qos` and `time_limit` go to sbatch). The config sent
    names the job (its checkpoints record it); `allow_config_change` sets checkpoint.allow_config_change in it.

    Its data, checkpoint and init_from paths must be under the shared directory, and data.path must hold a prepared
    data set on the cluster; `prepare_demo_data` (the demo) asks for the shipped demo corpus to be
    prepared into data.path instead when it holds none."""
    check_job_name(name)
    if config.get("name") not in (None, name):
        raise ShardstackError(f"the job config names job {config['name']!r}, but it is submitted as {name!r}",
                              hint="drop --name, or change name: in the job config")
    config = {**config, "name": name}
    if allow_config_change:
        config["checkpoint"] = {**(config.get("checkpoint") or {}), "allow_config_change": True}
    slurm_opts = {"account": account, "qos": qos, "time": time_limit}
    given = {k: v for k, v in slurm_opts.items() if v is not None}
    if given and cluster.scheduler != "slurm":
        raise ShardstackError(f"--{'/--'.join(given)} need Slurm; this cluster's shardstack_scheduler is systemd",
                              hint="submit without them, or deploy Slurm (docs/operations.md, \"Slurm\")")
    for key, value in given.items():
        if not (SLURM_TIME if key == "time" else SLURM_NAME).match(value):
            raise ShardstackError(f"--{key} {value!r} is not valid",
                                  hint="a time limit is [days-]hours[:minutes[:seconds]]" if key == "time"
                                  else "Slurm names are [A-Za-z0-9_.-]")
    check_shared_paths(config, job_shared_dir(cluster))
    # Cordoned train nodes (`shardstack node cordon`) are left out; the playbook refuses if too few remain.
    excluded = cordon.cordoned(cluster, "train")
    if not prepare_demo_data:
        usable = [h for h in cluster.group(TRAIN_GROUP) if h not in excluded]
        if usable:  # none: the playbook's first play says so
            check_inputs(config, cluster, usable[0])
    extravars: dict[str, Any] = {"train_job_name": name, "train_job_config": config}
    extravars.update({f"train_job_{k}": v for k, v in given.items()})
    if nodes:
        extravars["train_job_nodes"] = nodes
    if excluded:
        extravars["train_job_exclude"] = excluded
    if prepare_demo_data:
        extravars["train_job_prepare_demo_data"] = True
    return run_playbook("playbooks/train_submit.yml", cluster.path, extravars=extravars, on_event=on_event)


def status(name: str, cluster: Cluster, pattern: str = TRAIN_GROUP) -> JobStatus:
    check_job_name(name)
    if cluster.scheduler == "slurm":
        return slurm.status(name, cluster.job_account, cluster.path)
    return systemd.status(name, cluster.path, pattern)


def stop(name: str, cluster: Cluster, pattern: str = TRAIN_GROUP) -> dict[str, bool]:
    """Stop the job: `systemctl stop` of its unit on every train node, or `scancel` on the Slurm controller. Either
    sends SIGTERM first, on which the trainer saves a checkpoint at the step all ranks reach (TimeoutStopSec or
    Slurm's KillWait before SIGKILL)."""
    check_job_name(name)
    if cluster.scheduler == "slurm":
        return slurm.stop(name, cluster.job_account, cluster.path)
    return systemd.stop(name, cluster.path, pattern)


def logs(name: str, cluster: Cluster, lines: int = 50, pattern: str = TRAIN_GROUP) -> dict[str, str]:
    check_job_name(name)
    which = systemd.log_selector(name) if cluster.scheduler == "systemd" else slurm.log_selector(name)
    res = run_command(["journalctl", *which, "-n", str(lines), "--no-pager", "-o", "short-iso"], cluster.path,
                      pattern)
    return {h: r.stdout if r.success else f"({r.message or r.stderr})" for h, r in res.items()}


def wait_job(name: str, cluster: Cluster, timeout: float, *, poll: float = 5.0,
             on_status: Callable[[JobStatus], None] | None = None) -> JobStatus:
    """Poll `train status` until the job has finished (or failed, or the timeout passed); a queued Slurm job is
    waited for too. The inventory is read once, not on every poll: `cluster` keeps what it read."""
    deadline = time.monotonic() + timeout
    seen_running = False
    while True:
        st = status(name, cluster)
        if on_status:
            on_status(st)
        seen_running |= st.state == "running"
        # A freshly started unit may not be active yet on every node: "finished" counts only after it ran.
        if st.state == "failed" or (st.state in ("finished", "stopped") and (seen_running or st.last_step)):
            return st
        if time.monotonic() > deadline:
            raise ShardstackError(f"job {name} still {st.state} after {timeout:.0f}s",
                                  hint=f"shardstack train logs {name}")
        time.sleep(poll)
