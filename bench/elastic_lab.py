"""Elastic, mixed training + inference through Slurm on a 3-node lab (issue 26's acceptance), end to end:

    python bench/elastic_lab.py [--steps 4000] [--keep] [--inventory INV]

A lab of its own (`el`, the default group layout but every node a Slurm compute node and the two inference nodes'
replicas Slurm-run: inference_service_scheduled), deployed by site.yml with molecule slurm's QOS and accounts. Then:
an uninterrupted 2-node reference job, exported and published; one replica (`serve scale`); the same job again on the
two other nodes; the autoscaler's unit on the Slurm controller (min 1, max 2, deployed with short cooldowns and
held stopped until now) and a load ramp through the load balancer until its second replica has preempted the
training job; the load stops, the replica goes after the cooldown, the
job resumes on its nodes and finishes; its losses against the reference's; last, `serve scale` to 0 and back.
Prints each phase with its time and the figures; exits non-zero when a check fails. --inventory: a lab already
deployed this way (no lab up, no deploy, not taken down). --keep: leave the lab up.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from shardstack.build.wheelhouse import build
from shardstack.cli.output import Progress
from shardstack.lab import lab
from shardstack.ops import endpoint, replicas, train
from shardstack.ops import serve as opserve
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.common import identifier, step_records
from shardstack.ops.runner import project_dir, run_command, run_playbook
from shardstack.train.config import config_from_dict

LAB = "el"
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"FAILED: {what}")
    say(f"ok: {what}")


def wait(what: str, probe: Any, timeout: float = 600, poll: float = 3) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise SystemExit(f"FAILED: timed out waiting for {what}")
        time.sleep(poll)
    return value


def lab_inventory(inventory: Path) -> None:
    """Every node a Slurm compute node, the inference nodes' replicas Slurm-run; molecule slurm's QOS and accounts."""
    doc = yaml.safe_load(inventory.read_text())
    doc["all"]["children"]["train_nodes"] = {"hosts": {h: {} for h in sorted(doc["all"]["hosts"])}}
    inventory.write_text(yaml.safe_dump(doc))
    scenario = yaml.safe_load((project_dir() / "molecule/slurm/molecule.yml").read_text())
    slurm = scenario["provisioner"]["inventory"]["group_vars"]["all"]
    group_vars = inventory.parent / "group_vars"
    group_vars.mkdir()
    (group_vars / "all.yml").write_text(yaml.safe_dump({
        **{k: slurm[k] for k in ("shardstack_scheduler", "slurm_qos", "slurm_accounts", "slurm_users",
                                 "slurm_cred_expire", "slurm_kill_wait", "slurm_slurmd_timeout")},
        "slurm_account_units": {"inference": "shardstack-inference.service"},
        # The autoscaler's unit, on a short clock; the scenario starts it for the load and stops it after.
        "inference_service_autoscale": True, "inference_service_autoscale_target_load": 1,
        "inference_service_autoscale_max_waiting": 1, "inference_service_autoscale_max_ttft_p95": 60,
        "inference_service_autoscale_up_cooldown": 10, "inference_service_autoscale_down_cooldown": 90,
        "inference_service_autoscale_interval": 5, "inference_service_autoscale_window": "30s",
        "prometheus_scrape_interval": "5s", "prometheus_scrape_timeout": "4s",
        "journal_collector_keep_free_percent": 0,
        # The load comes from one address: the edge's per-client limit (600 requests / 10 s) would answer it 429.
        "loadbalancer_rate_limit_requests": 1000000}))
    (group_vars / "inference_nodes.yml").write_text(yaml.safe_dump({"inference_service_scheduled": True}))


def job(cluster: Cluster, name: str, steps: int) -> dict[str, Any]:
    shared = cluster.shared_dir
    return config_from_dict({
        "model": {"size": "tiny"}, "data": {"path": f"{shared}/data/corpus"}, "engine": {"stage": 3},
        "schedule": {"warmup_steps": 2, "total_steps": steps}, "batch": {"global_batch": 4, "micro_batch": 2},
        "checkpoint": {"dir": f"{shared}/checkpoints/{name}", "interval": 100},
        "metrics": {"port": 0, "log_every": 10}}).to_dict()


def journal(cluster: Cluster, name: str, since: float, grep: str) -> str:
    res = run_command(["journalctl", "--identifier", identifier(name), "--since", f"@{int(since)}", "--no-pager",
                       "-o", "cat", "--grep", grep], cluster.path, "train_nodes")
    return "\n".join(r.stdout for r in res.values() if r.success)


def losses(text: str) -> dict[int, float]:
    return {rec["step"]: rec["loss"] for rec in step_records(text)}


def running(slurm: replicas.Slurm) -> list[replicas.ReplicaJob]:
    return [j for j in replicas.replicas(slurm) if j.state == "RUNNING"]


def autoscaler(cluster: Cluster, action: str) -> str:
    """systemctl ACTION shardstack-autoscale on the Slurm controller; its output."""
    res = next(iter(run_command(["systemctl", action, "shardstack-autoscale.service"], cluster.path,
                                "slurm_controller[0]").values()))
    return res.stdout.strip() or res.stderr.strip()


def decisions_since(cluster: Cluster, since: float) -> list[str]:
    res = next(iter(run_command(["journalctl", "-u", "shardstack-autoscale.service", "--since", f"@{int(since)}",
                                 "--no-pager", "-o", "cat", "--grep", "autoscale: (up|down|hold) "], cluster.path,
                                "slurm_controller[0]").values()))
    return res.stdout.splitlines()


def serves(ep: endpoint.Endpoint) -> bool:
    return endpoint.complete(ep, "Once upon a time", max_tokens=2, timeout=30).status == 200


def scenario(cluster: Cluster, steps: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    settings, slurm = replicas.ReplicaSettings(), replicas.ClusterSlurm.of(cluster)
    ep = endpoint.endpoint(cluster)
    # A fresh start on a lab used before: no autoscaler yet, no replica, no checkpoint of these jobs.
    autoscaler(cluster, "stop")
    replicas.scale(slurm, 0, settings)
    head = cluster.group("train_nodes")[0]
    for name in ("ref", "elastic"):
        train.stop(name, cluster)
        run_command(["rm", "-rf", f"{cluster.shared_dir}/checkpoints/{name}"], cluster.path, head)

    # The reference: uninterrupted, on two nodes, nothing else running; its last checkpoint is the served model.
    ref_started = time.time()
    sub = train.submit(job(cluster, "ref", steps), "ref", cluster, nodes=2, account="research", prepare_demo_data=True)
    check(sub.success, "reference job submitted")
    check(train.wait_job("ref", cluster, timeout=3600, poll=5).state == "finished", "reference job finished")
    ref = losses(journal(cluster, "ref", ref_started, '"loss"'))
    say(f"reference: {len(ref)} logged losses, last {ref.get(steps)}")
    published = opserve.publish(cluster, "ref", rollout_after=False)
    say(f"published {published.job} step {published.step}")

    # One replica, by hand.
    t = time.monotonic()
    replicas.scale(slurm, 1, settings)
    wait("one replica serving", lambda: len(running(slurm)) == 1 and serves(ep), timeout=600, poll=3)
    first = running(slurm)[0]
    figures["first replica serving (s)"] = round(time.monotonic() - t, 1)
    say(f"replica job {first.job_id} serves from {first.node}")

    # The same training job on the two other nodes.
    started = time.time()
    check(train.submit(job(cluster, "elastic", steps), "elastic", cluster, nodes=2, account="research").success,
          "training job submitted")
    st = wait("training at step 5", lambda: (s := train.status("elastic", cluster)).last_step
              and s.last_step["step"] >= 5 and s, timeout=900)
    job_id = st.slurm.job_id
    say(f"training job {job_id} on {st.slurm.nodelist} at step {st.last_step['step']}")

    # The autoscaler's unit and a load ramp until the second replica has taken a node from the training job.
    scaling_since = time.time()
    check(autoscaler(cluster, "start") == "" and autoscaler(cluster, "is-active") == "active", "the autoscaler runs")
    codes: Counter = Counter()
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            r = endpoint.complete(ep, f"Once upon a time {i}", max_tokens=32, timeout=120)
            codes[r.status] += 1
            if r.status == 429:
                time.sleep(1)  # Retry-After

    try:
        clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        t = time.monotonic()
        for c in clients:
            c.start()
        try:
            wait("the second replica serving and the training job preempted",
                 lambda: len(running(slurm)) == 2 and train.status("elastic", cluster).state == "pending",
                 timeout=900, poll=5)
            figures["load → 2 replicas (s)"] = round(time.monotonic() - t, 1)
            time.sleep(30)  # load on two replicas
        finally:
            stop.set()
            for c in clients:
                c.join(150)
        figures["requests under load"] = dict(codes)
        say(f"load stopped: {dict(codes)}")
        t = time.monotonic()
        wait("the scale-in", lambda: any("down 2→1" in d for d in decisions_since(cluster, scaling_since))
             and len(replicas.replicas(slurm)) == 1, timeout=900, poll=5)
        figures["load off → 1 replica (s)"] = round(time.monotonic() - t, 1)
    finally:
        autoscaler(cluster, "stop")
    check(autoscaler(cluster, "is-active") == "inactive", "the autoscaler stopped cleanly on SIGTERM (not failed)")
    decisions = decisions_since(cluster, scaling_since)
    figures["decisions"] = Counter(re.findall(r"autoscale: (up|down|hold) ", "\n".join(decisions)))
    say("decisions that changed the count (journal of shardstack-autoscale):\n  "
        + "\n  ".join(d for d in decisions if " up " in d or " down " in d))
    check(set(codes) <= {200, 429} and codes[200] > 0, f"no failed request across scale-out and scale-in: {codes}")

    final = train.wait_job("elastic", cluster, timeout=3600, poll=5)
    check(final.state == "finished", "the preempted job finished")
    saved = re.findall(r"stopping after step (\d+) on (?:SIGUSR1|a signal on another rank)",
                       journal(cluster, "elastic", started, "stopping after step"))
    resumed = re.findall(r"resumed from \S*/step_(\d+) ", journal(cluster, "elastic", started, "resumed from"))
    check(bool(saved) and [int(r) for r in resumed] == [int(saved[0])], f"checkpointed at {saved}, resumed {resumed}")
    got = losses(journal(cluster, "elastic", started, '"loss"'))
    worst = max(abs(got[k] - ref[k]) / max(1.0, abs(ref[k])) for k in ref)
    check(set(ref) <= set(got) and worst <= 1e-5, f"losses as the reference's (max relative difference {worst:.1e})")
    figures.update({"preempted after step": int(saved[0]), "max relative loss difference": f"{worst:.1e}"})

    # By hand: none, and back.
    replicas.scale(slurm, 0, settings)
    wait("no replica", lambda: not replicas.replicas(slurm), timeout=300)
    down = endpoint.complete(ep, "x", max_tokens=2)
    check(down.status == 503, f"no replica: the edge answers 503 ({down.status})")
    t = time.monotonic()
    replicas.scale(slurm, 1, settings)
    wait("a replica again", lambda: len(running(slurm)) == 1 and serves(ep), timeout=600)
    figures["0 → 1 replica serving (s)"] = round(time.monotonic() - t, 1)
    replicas.scale(slurm, 0, settings)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000, help="the training job's steps (default 4000)")
    p.add_argument("--inventory", type=Path, help="a lab already deployed this way")
    p.add_argument("--keep", action="store_true", help="leave the lab up")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the lab needs root")
    if args.inventory:
        figures = scenario(Cluster.load(args.inventory), args.steps)
    else:
        wh = build(project_dir(), log=lambda m: print(m, file=sys.stderr))
        if LAB in lab.st.list_labs():
            lab.down(LAB, Progress())
        inventory = Path(tempfile.mkdtemp(prefix="elastic-")) / "hosts.yml"
        lab.up(LAB, 3, inventory, Progress())
        try:
            lab_inventory(inventory)
            t = time.monotonic()
            deployed = run_playbook("site.yml", inventory, extravars={"training_runtime_wheelhouse_src": str(wh.path)})
            check(deployed.success, f"site.yml ({time.monotonic() - t:.0f}s): "
                  f"{ {h: r.failed_task for h, r in deployed.hosts.items() if not r.success} }")
            figures = scenario(Cluster.load(inventory), args.steps)
        finally:
            if args.keep:
                say(f"lab kept: {inventory}")
            else:
                lab.down(LAB, Progress())
    print("\nelastic lab (issue 26):")
    for k, v in figures.items():
        print(f"  {k}: {dict(v) if isinstance(v, Counter) else v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
