"""Running the acceptance on a cluster: its run directory on shared storage, one job at a time (submit, wait,
read back the step records), the worker kill, Prometheus' GPU samples, and the order of the items."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops import cordon, train
from shardstack.ops.acceptance.judge import (
    gpu_train_nodes,
    judge_bandwidth,
    judge_gpu,
    judge_loss,
    judge_resume,
    judge_scaling,
    judge_time,
    logged_resume_step,
)
from shardstack.ops.acceptance.records import Acceptance, Item, Run, Settings, Thresholds
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.common import TRAIN_GROUP, JobStatus, unit
from shardstack.ops.runner import RunnerEvent, run_command
from shardstack.ops.validate import run_validate

_FAILED = 1  # the CLI's EXIT_FAILED_HOSTS (ops does not import cli)
# The run directory's name under <shared>/checkpoints/: its UTC start, which sorts as text in time order.
_RUN_TIME = "%Y%m%dT%H%M%SZ"
_RUN_NAME = re.compile(r"acceptance-\d{8}T\d{6}Z")


def _silent(*_: Any) -> None:
    pass


@dataclass
class Hooks:
    """What the caller shows while the acceptance runs; silent by default."""

    echo: Callable[[str], None] = _silent  # a line of progress
    item: Callable[[Item], None] = _silent  # an item judged
    events: Callable[[], Callable[[RunnerEvent], None] | None] = lambda: None  # a live view for one playbook run


def job_config(settings: Settings, shared_dir: str, run_dir: str, name: str, *, stage: int, nodes: int,
               steps: int, checkpoint_interval: int | None = None) -> dict[str, Any]:
    """The demo's tiny byte-level GPT job (ops.demo.demo_job, its corpus prepared on the cluster), sized for the
    acceptance: `stage`, batch_per_node × nodes, a step record per step into the run directory, and checkpoints
    only where the kill test needs them."""
    from shardstack.ops.demo import demo_job
    from shardstack.train.config import config_from_dict

    cfg = demo_job(steps, shared_dir, name)
    cfg["name"] = name
    cfg["seed"] = settings.seed
    cfg["model"] = {**cfg["model"], "size": settings.model_size}
    cfg["engine"]["stage"] = stage
    cfg["batch"] = {"global_batch": settings.batch_per_node * nodes, "micro_batch": settings.batch_per_node}
    cfg["schedule"] = {**cfg["schedule"], "warmup_steps": min(10, steps // 10), "total_steps": steps}
    cfg["metrics"] = {**cfg["metrics"], "log_every": 1, "json_log": f"{run_dir}/{name}.jsonl"}
    if checkpoint_interval:
        # keep all (0): the kill waits for one checkpoint's manifest, which pruning could remove first
        cfg["checkpoint"] = {**cfg["checkpoint"], "dir": f"{run_dir}/{name}",
                             "interval": checkpoint_interval, "keep": 0}
    else:
        cfg["checkpoint"] = {**cfg["checkpoint"], "dir": None}
    return config_from_dict(cfg).to_dict()


def parse_records(text: str) -> list[dict[str, Any]]:
    """The trainer's json_log: one JSON object per step."""
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "loss" in rec:
            out.append(rec)
    return out


def run_name(started: float) -> str:
    """The run directory's name for an acceptance started at `started` (Unix time)."""
    return "acceptance-" + time.strftime(_RUN_TIME, time.gmtime(started))


def runs_to_prune(names: Iterable[str], keep: int, current: str) -> list[str]:
    """Of the directory names under checkpoints/, the acceptance runs to remove before run `current` starts so that
    `keep` remain with it, oldest first. Only names of this module's own form are candidates (a job named
    "acceptance-x" is not an acceptance run), and never `current` itself."""
    if keep < 1:
        raise ShardstackError(f"keep-runs must be ≥ 1, not {keep}")
    runs = sorted({n for n in names if _RUN_NAME.fullmatch(n) and n != current})
    return runs[:max(len(runs) - (keep - 1), 0)]


def kill_script(job: str, checkpoint_dir: str, after: int, polls: int = 1200) -> str:
    """The `sh -c` script of the kill: wait (`polls` × 0.5 s) for the step-`after` checkpoint's manifest, then
    SIGKILL the worker of the job's unit. Exit 3: no checkpoint, 4: the unit not running, 5: no worker. The path and
    the unit come from the inventory and the job's name, so they are quoted: a space or `;` stays part of the word."""
    ckpt = shlex.quote(f"{checkpoint_dir}/step_{after:08d}/manifest.json")
    return (f"for i in $(seq {int(polls)}); do [ -e {ckpt} ] && break; sleep 0.5; done; [ -e {ckpt} ] || exit 3; "
            f"agent=$(systemctl show -p MainPID --value {shlex.quote(unit(job))}); [ \"$agent\" -gt 0 ] || exit 4; "
            "worker=$(pgrep -P \"$agent\"); [ -n \"$worker\" ] || exit 5; "
            "kill -KILL $worker && echo \"killed worker $worker (agent $agent)\"")


class _Cluster:
    """The acceptance's view of the cluster: its train nodes, the run directory, and one job at a time."""

    def __init__(self, cluster: Cluster, settings: Settings, hooks: Hooks, run_name: str) -> None:
        self.c, self.s, self.hooks = cluster, settings, hooks
        excluded = set(cordon.cordoned(cluster, "train"))
        self.nodes = [h for h in cluster.group(TRAIN_GROUP) if h not in excluded]
        if not self.nodes:
            raise ShardstackError("the inventory has no usable train node (train_nodes empty or all cordoned)",
                                  hint="shardstack node uncordon NODE, or add hosts to train_nodes")
        self.head = self.nodes[0]
        self.shared = train.job_shared_dir(cluster)
        # Under checkpoints/: the directory the roles make for the job account's output (the shared directory's
        # root is not the job account's). The artefact prune leaves it alone (no step_N directly inside it);
        # prune_runs keeps the newest `keep_runs` of these.
        self.runs_dir = f"{self.shared}/checkpoints"
        self.run_name = run_name
        self.run_dir = f"{self.runs_dir}/{run_name}"

    def reach(self) -> None:
        """Every train node answers, before anything is started: otherwise one clear error, not a failed item."""
        res = run_command(["true"], self.c.path, TRAIN_GROUP, timeout=120)
        down = {h: (r.message or r.stderr or "no answer").strip() for h, r in res.items() if not r.success}
        down.update({h: "no answer" for h in self.nodes if h not in res})
        if down:
            raise ShardstackError("cannot reach train node(s): " + "; ".join(f"{h}: {m}" for h, m in
                                                                             sorted(down.items())),
                                  hint=f"shardstack check -i {self.c.path}", exit_code=_FAILED)

    def prune_runs(self, keep: int) -> list[str]:
        """Remove the oldest acceptance run directories so that `keep` remain with this run's; say which. Housekeeping
        only: a listing or removal that fails is said and the acceptance goes on. argv, no shell, so the paths reach
        find and rm as single words; as the job account, which made them (root may be squashed on shared storage)."""
        as_job = ["runuser", "-u", self.c.job_account, "--"]
        ls = run_command([*as_job, "find", self.runs_dir, "-mindepth", "1", "-maxdepth", "1", "-type", "d",
                          "-name", "acceptance-*", "-printf", "%f\\n"], self.c.path, self.head)[self.head]
        if not ls.success:
            self.hooks.echo(f"old acceptance runs not pruned: cannot list {self.runs_dir} on {self.head}: "
                            f"{(ls.stderr or ls.message).strip()}")
            return []
        old = runs_to_prune(ls.stdout.splitlines(), keep, self.run_name)
        if not old:
            return []
        rm = run_command([*as_job, "rm", "-rf", "--", *(f"{self.runs_dir}/{n}" for n in old)], self.c.path,
                         self.head, timeout=600)[self.head]
        if not rm.success:
            self.hooks.echo(f"old acceptance runs not all removed from {self.runs_dir}: "
                            f"{(rm.stderr or rm.message).strip()}")
            return []
        self.hooks.echo(f"removed {len(old)} old acceptance run(s) from {self.runs_dir} (keeping {keep} with this "
                        f"one): {', '.join(old)}")
        return old

    def make_run_dir(self) -> None:
        # The jobs run as the job account: it owns the directory their records and checkpoints go to.
        r = run_command(["runuser", "-u", self.c.job_account, "--", "mkdir", "-p", self.run_dir], self.c.path,
                        self.head)[self.head]
        if not r.success:
            raise ShardstackError(f"cannot create {self.run_dir} on {self.head}: {r.stderr or r.message}",
                                  exit_code=_FAILED)

    def records(self, name: str) -> list[dict[str, Any]]:
        path = f"{self.run_dir}/{name}.jsonl"
        r = run_command(["cat", path], self.c.path, self.head)[self.head]
        return parse_records(r.stdout) if r.success else []

    def submit(self, run: Run, config: dict[str, Any]) -> bool:
        self.hooks.echo(f"submit {run.job}: stage {run.stage} on {run.nodes} node(s), "
                        f"{config['schedule']['total_steps']} steps")
        sub = train.submit(config, run.job, self.c, nodes=run.nodes, prepare_demo_data=True,
                           on_event=self.hooks.events())
        if not sub.success:
            failed = [f"{h.host}: {h.failed_task}: {h.message}" for h in sub.hosts.values() if h.failed_task]
            run.state, run.error = "not started", "train submit failed: " + ("; ".join(failed) or sub.status)
        return sub.success

    def wait(self, run: Run, steps: int) -> None:
        def show(st: JobStatus) -> None:
            last = st.last_step
            self.hooks.echo(f"  {run.job}: {st.state}" + (
                f", step {last['step']}/{steps} loss {last['loss']:.3f} {last['tokens_per_second']:,.0f} tok/s"
                if last else ""))

        try:
            st = train.wait_job(run.job, self.c, timeout=self.s.job_timeout, on_status=show)
            run.state = st.state
            if st.state != "finished":
                run.error = f"job ended {st.state} (shardstack train logs {run.job})"
        except ShardstackError as exc:
            run.state, run.error = "timeout", str(exc)

    def job(self, run: Run, config: dict[str, Any]) -> Run:
        t = time.monotonic()
        if self.submit(run, config):
            self.wait(run, config["schedule"]["total_steps"])
            run.records = self.records(run.job)
            if run.state == "finished" and len(run.records) != config["schedule"]["total_steps"]:
                run.error = (f"{len(run.records)} step records for {config['schedule']['total_steps']} steps in "
                             f"{self.run_dir}/{run.job}.jsonl")
        run.seconds = time.monotonic() - t
        return run

    def kill_worker(self, job: str, checkpoint_dir: str, after: int, victim: str) -> str | None:
        """On `victim`: wait for the step-`after` checkpoint, then SIGKILL the job's worker (the torchrun agent's
        child, not the agent). One ad-hoc command, so the kill lands mid-run whatever the controller's latency."""
        r = run_command(["sh", "-c", kill_script(job, checkpoint_dir, after)], self.c.path, victim,
                        timeout=900)[victim]
        if r.success and "killed worker" in r.stdout:
            return f"{victim}: {r.stdout.strip()}"
        why = {3: f"no step-{after} checkpoint within 10 min", 4: "the job's unit was not running",
               5: "the agent had no worker"}.get(r.rc, r.stderr or r.message)
        self.hooks.echo(f"  the kill on {victim} failed: {why}")
        return None

    def gpu_samples(self, nodes: list[str], seconds: float) -> dict[str, float | None]:
        """DCGM's utilisation (mean) and framebuffer use (max) on `nodes` over the last `seconds`, as the
        Prometheus recording rules define them; None for a series Prometheus does not have."""
        from shardstack.ops.status import prom_query, sources

        prometheus, _ = sources(self.c)
        if prometheus is None:
            return {"utilization": None, "memory": None}
        sel = "{node=~\"" + "|".join(nodes) + "\"}"
        window = f"{max(int(seconds), 30)}s"
        out: dict[str, float | None] = {}
        for key, q in (("utilization", f"avg(avg_over_time(shardstack:gpu_utilization:ratio{sel}[{window}]))"),
                       ("memory", f"max(max_over_time(shardstack:gpu_memory_used:ratio{sel}[{window}]))")):
            try:
                res = prom_query(prometheus, q)
            except ShardstackError as exc:
                self.hooks.echo(f"  Prometheus: {exc}")
                res = []
            out[key] = float(res[0]["value"][1]) if res else None
        return out


def run_acceptance(cluster: Cluster, settings: Settings, thresholds: Thresholds, hooks: Hooks | None = None,
        result: Acceptance | None = None) -> Acceptance:
    """The acceptance on `cluster`, recorded in `result` (returned). Unreachable train nodes raise before anything
    starts; a run that fails fails its item and the rest go on."""
    hooks = hooks or Hooks()
    t0 = time.monotonic()
    result = result or Acceptance(str(cluster.path), settings, thresholds)
    cl = _Cluster(cluster, settings, hooks, run_name(result.started))
    result.run_dir = cl.run_dir
    cl.reach()
    cl.prune_runs(settings.keep_runs)
    top = min(len(cl.nodes), settings.max_nodes or len(cl.nodes))

    def done(item: Item, started: float) -> Item:
        item.seconds = time.monotonic() - started
        result.items.append(item)
        hooks.item(item)
        return item

    size = "validate's default size" if settings.allreduce_mb is None else f"up to {settings.allreduce_mb:g} MiB"
    hooks.echo(f"validate (all-reduce, {size}; node facts)")
    t = time.monotonic()
    # Only a size that was asked for is passed: validate's own default is the one for the nodes' backend.
    size_arg = {} if settings.allreduce_mb is None else {"allreduce_mb": settings.allreduce_mb}
    val, findings = run_validate(cluster, **size_arg, on_event=hooks.events())
    validate_seconds = time.monotonic() - t
    result.allreduce = val.data.get("validate_allreduce")
    result.validate_findings = findings
    result.validate_gpu = val.data.get("validate_gpu") or {}
    gpu_nodes = gpu_train_nodes(result.validate_gpu, cl.nodes[:top])

    cl.make_run_dir()

    def cfg(name: str, stage: int, nodes: int, steps: int, interval: int | None = None) -> dict[str, Any]:
        return job_config(settings, cl.shared, cl.run_dir, name, stage=stage, nodes=nodes, steps=steps,
                          checkpoint_interval=interval)

    # Partitioning on at the most nodes first: the scaling item's top point and the GPU window too.
    t = time.monotonic()
    on = cl.job(Run(f"acc-s3-n{top}", top, 3), cfg(f"acc-s3-n{top}", 3, top, settings.steps))
    samples = cl.gpu_samples(gpu_nodes, on.seconds) if gpu_nodes else None
    off = cl.job(Run(f"acc-s0-n{top}", top, 0), cfg(f"acc-s0-n{top}", 0, top, settings.steps))
    result.runs += [on, off]
    done(judge_loss(off, on, thresholds.loss_rtol), t)

    t = time.monotonic()
    scale = [on]
    for n in range(top - 1, 0, -1):
        scale.append(cl.job(Run(f"acc-s3-n{n}", n, 3), cfg(f"acc-s3-n{n}", 3, n, settings.steps)))
    result.runs += scale[1:]
    item = done(judge_scaling(scale, thresholds.min_scaling_efficiency, thresholds.max_scaling_efficiency), t)
    item.seconds += on.seconds  # the top point's run is shared with the loss item
    item.details.append(f"the {top}-node point is the loss item's stage-3 run ({on.seconds:.0f} s, counted in both)")

    t = time.monotonic()
    bw = judge_bandwidth(result.allreduce, on if top > 1 else None, thresholds.max_comm_fraction)
    bw.details += [f"validate: {f}" for f in findings if f.startswith(("all-reduce", "backend"))]
    done(bw, t).seconds += validate_seconds

    peak_mem = max((int(r.get("memory_bytes") or 0) for r in on.records), default=0) or None
    done(judge_gpu(gpu_nodes, samples, peak_mem, thresholds.min_gpu_utilization), time.monotonic())

    t = time.monotonic()
    name = "acc-kill"
    kill = Run(name, top, 3)
    interval = settings.checkpoint_interval
    after = 2 * interval
    if cluster.scheduler != "systemd":
        item = Item("resume", "a worker killed, the job resumed", "n/a",
                    "not run: the kill drives the systemd unit; this cluster queues jobs with Slurm",
                    f"resumes from step ≥ {after}")
        done(item, t)
    else:
        config = cfg(name, 3, top, settings.kill_steps, interval)
        killed = None
        if cl.submit(kill, config):
            killed = cl.kill_worker(name, config["checkpoint"]["dir"], after, cl.nodes[top - 1])
            cl.wait(kill, settings.kill_steps)
            kill.records = cl.records(name)
        kill.seconds = time.monotonic() - t
        result.runs.append(kill)
        logged = None
        if killed:
            log = "\n".join(train.logs(name, cluster, lines=5000).values())
            logged = logged_resume_step(log, config["checkpoint"]["dir"])
        done(judge_resume(kill, killed, settings.kill_steps, thresholds.loss_rtol, after, logged), t)

    result.seconds = time.monotonic() - t0
    done(judge_time(result.seconds, settings.time_budget), time.monotonic()).seconds = result.seconds
    return result
