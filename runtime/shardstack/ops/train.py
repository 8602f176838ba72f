"""`shardstack train submit|status|stop|logs`: training jobs on the cluster (day 2), run by the inventory's
`shardstack_scheduler`: systemd units or Slurm jobs.

submit runs playbooks/train_submit.yml: with systemd, the job config, torchrun settings and `shardstack-train@<job>`
on every train node; with Slurm, the config on every train node and an sbatch job (srun torchrun) from the first.
status, stop and logs are ad-hoc commands through ansible-runner: systemctl and journalctl on the train nodes, or
squeue/sacct/scancel on the Slurm controller. The Python API (`submit`, `status`, `stop`, `logs`, `wait_job`)
returns typed results for automation.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops import cluster, cordon, storage
from shardstack.ops.runner import RunResult, run_command, run_playbook

JOB_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
SLURM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d\d){0,2}$")
TRAIN_GROUP = "train_nodes"
SLURM_CONTROLLER = "slurm_controller[0]"


def unit(job: str) -> str:
    return f"shardstack-train@{job}.service"


def identifier(job: str) -> str:
    """The job's journal identifier on every train node, under systemd (the unit's SyslogIdentifier) and Slurm."""
    return f"shardstack-train-{job}"


def scheduler(inventory: Path) -> str:
    """Who runs training jobs on this cluster: the inventory's shardstack_scheduler (systemd or slurm)."""
    value = cluster.setting(cluster.inventory_hosts(inventory), "shardstack_scheduler", "shardstack_common",
                            TRAIN_GROUP)
    if value not in ("systemd", "slurm"):
        raise ShardstackError(f"shardstack_scheduler is {value!r}", hint="set systemd or slurm in group_vars")
    return str(value)


def _job_user(inventory: Path) -> str:
    """The account Slurm jobs run as: training_runtime_user, whose default is shardstack_common's shardstack_user."""
    inv = cluster.inventory_hosts(inventory)
    if "training_runtime_user" in (inv["hostvars"].get((inv["groups"].get(TRAIN_GROUP) or [""])[0]) or {}):
        return str(cluster.setting(inv, "training_runtime_user", "training_runtime", TRAIN_GROUP))
    return str(cluster.setting(inv, "shardstack_user", "shardstack_common", TRAIN_GROUP))


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


def shared_paths(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The job config's paths every node of the job must see the same: (key, path) of those set."""
    data, ck, model = (config.get(k) or {} for k in ("data", "checkpoint", "model"))
    found = [("data.path", data.get("path")), ("checkpoint.dir", ck.get("dir")),
             ("model.init_from", model.get("init_from"))]
    if ck.get("resume") not in (None, "auto", "never"):
        found.append(("checkpoint.resume", ck["resume"]))
    return [(k, str(v)) for k, v in found if v is not None]


def job_shared_dir(inv: dict[str, Any]) -> str:
    """Where jobs read data and write checkpoints: training_runtime_shared_dir when the inventory sets it (a cluster
    may keep its jobs in a directory of their own on the shared storage), else the shared directory itself."""
    hostvars = cluster.inventory_vars(inv, TRAIN_GROUP)
    return str(hostvars.get("training_runtime_shared_dir") or cluster.shared_dir(inv))


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


def check_inputs(config: dict[str, Any], inventory: Path, host: str) -> None:
    """The prepared data set (data.path/meta.json) and init_from's config.json exist on the cluster: the job's task
    would otherwise tokenise the shipped demo corpus into data.path without a word."""
    data = (config.get("data") or {}).get("path")
    init_from = (config.get("model") or {}).get("init_from")
    wanted = {f"{data}/meta.json": "data.path", f"{init_from}/config.json": "model.init_from"}
    wanted = {p: k for p, k in wanted.items() if not p.startswith("None/")}
    if not wanted:
        return
    r = run_command(missing_argv(list(wanted)), inventory, host).get(host)
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


def submit(config: dict[str, Any], name: str, inventory: Path, *, nodes: int | None = None,
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
    if given and scheduler(inventory) != "slurm":
        raise ShardstackError(f"--{'/--'.join(given)} need Slurm; this cluster's shardstack_scheduler is systemd",
                              hint="submit without them, or deploy Slurm (docs/operations.md, \"Slurm\")")
    for key, value in given.items():
        if not (SLURM_TIME if key == "time" else SLURM_NAME).match(value):
            raise ShardstackError(f"--{key} {value!r} is not valid",
                                  hint="a time limit is [days-]hours[:minutes[:seconds]]" if key == "time"
                                  else "Slurm names are [A-Za-z0-9_.-]")
    inv = cluster.inventory_hosts(inventory)
    check_shared_paths(config, job_shared_dir(inv))
    # Cordoned train nodes (`shardstack node cordon`) are left out; the playbook refuses if too few remain.
    excluded = cordon.cordoned(inventory, "train")
    if not prepare_demo_data:
        usable = [h for h in cluster.group(inv, TRAIN_GROUP) if h not in excluded]
        if usable:  # none: the playbook's first play says so
            check_inputs(config, inventory, usable[0])
    extravars: dict[str, Any] = {"train_job_name": name, "train_job_config": config}
    extravars.update({f"train_job_{k}": v for k, v in given.items()})
    if nodes:
        extravars["train_job_nodes"] = nodes
    if excluded:
        extravars["train_job_exclude"] = excluded
    if prepare_demo_data:
        extravars["train_job_prepare_demo_data"] = True
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


# Slurm's job states, as the systemd path names its unit states.
_SLURM_STATES = {
    "pending": {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD", "SUSPENDED",
                "PREEMPTED"},
    "running": {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "STOPPED"},
    "finished": {"COMPLETED"},
    "stopped": {"CANCELLED"},
}


@dataclass
class JobStatus:
    job: str
    nodes: list[NodeJobState] = field(default_factory=list)
    scheduler: str = "systemd"
    slurm: SlurmJob | None = None  # the Slurm job (scheduler slurm; None: no job of that name)
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)  # Slurm: host → newest logged step there

    @property
    def state(self) -> str:
        if self.scheduler == "slurm":
            if self.slurm is None:
                return "unknown"
            word = self.slurm.state.split()[0].rstrip("+")  # "CANCELLED by 0", "RUNNING+"
            return next((k for k, v in _SLURM_STATES.items() if word in v), "failed")
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
        steps = [n.last_step for n in self.nodes if n.last_step] + list(self.steps.values())
        return max(steps, key=lambda s: s["step"]) if steps else None

    def to_dict(self) -> dict[str, Any]:
        out = {"job": self.job, "scheduler": self.scheduler, "state": self.state, "last_step": self.last_step,
               "nodes": [asdict(n) for n in self.nodes]}
        if self.scheduler == "slurm":
            out["slurm"] = asdict(self.slurm) if self.slurm else None
        return out


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
    res = next(iter(run_command(argv, inventory, SLURM_CONTROLLER).values()), None)
    if res is None:
        raise ShardstackError("the inventory has no slurm_controller host")
    if not res.success:
        raise ShardstackError(f"{argv[0]} failed on the Slurm controller {res.host}: {res.message or res.stderr}")
    return res.stdout


def _slurm_status(name: str, inventory: Path) -> JobStatus:
    user = _job_user(inventory)
    job = parse_slurm_job(_on_controller(["squeue", "--noheader", "--name", name, "--user", user,
                                          "--format", _SQUEUE_FORMAT], inventory))
    if job is None:  # not queued any more: the newest one accounting has (its last 30 days)
        job = parse_slurm_job(_on_controller(["sacct", "--noheader", "--parsable2", "--allocations", "--name", name,
                                              "--user", user, "--starttime", "now-30days",
                                              "--format", _SACCT_FIELDS], inventory))
    out = JobStatus(name, scheduler="slurm", slurm=job)
    if job is not None and job.started:  # steps of this run only (an earlier job of that name logged its own)
        logs = run_command(["journalctl", "--identifier", identifier(name), "--since", job.started, "-n", "400",
                            "--no-pager", "-o", "cat"], inventory, TRAIN_GROUP)
        out.steps = {h: step for h, r in logs.items() if r.success and (step := parse_step_lines(r.stdout))}
    return out


def status(name: str, inventory: Path, pattern: str = TRAIN_GROUP) -> JobStatus:
    check_job_name(name)
    if scheduler(inventory) == "slurm":
        return _slurm_status(name, inventory)
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
    """Stop the job: `systemctl stop` of its unit on every train node, or `scancel` on the Slurm controller. Either
    sends SIGTERM first, on which the trainer saves a checkpoint at the step all ranks reach (TimeoutStopSec or
    Slurm's KillWait before SIGKILL)."""
    check_job_name(name)
    if scheduler(inventory) == "slurm":
        res = run_command(["scancel", "--name", name, "--user", _job_user(inventory)], inventory, SLURM_CONTROLLER)
        if not res:
            raise ShardstackError("the inventory has no slurm_controller host")
    else:
        res = run_command(["systemctl", "stop", unit(name)], inventory, pattern)
    return {h: r.success for h, r in res.items()}


def logs(name: str, inventory: Path, lines: int = 50, pattern: str = TRAIN_GROUP) -> dict[str, str]:
    check_job_name(name)
    # The unit's journal (with systemd's lines about it); a Slurm job's agents log under the same identifier.
    which = ["-u", unit(name)] if scheduler(inventory) == "systemd" else ["--identifier", identifier(name)]
    res = run_command(["journalctl", *which, "-n", str(lines), "--no-pager", "-o", "short-iso"], inventory, pattern)
    return {h: r.stdout if r.success else f"({r.message or r.stderr})" for h, r in res.items()}


def wait_job(name: str, inventory: Path, timeout: float, *, poll: float = 5.0, on_status=None) -> JobStatus:
    """Poll `train status` until the job has finished (or failed, or the timeout passed); a queued Slurm job is
    waited for too."""
    deadline = time.monotonic() + timeout
    seen_running = False
    while True:
        st = status(name, inventory)
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


def demo_job(steps: int, shared_dir: str, name: str = "demo", *, init_from: str | None = None) -> dict[str, Any]:
    """The demo's job (also the e2e's): ZeRO stage 3 (FSDP2) across 2 nodes on CPU, on the shipped corpus. With
    `init_from` (a Hugging Face directory every train node sees, e.g. the pretrained model `storage.place_model` put
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
