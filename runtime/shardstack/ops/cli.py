"""`shardstack deploy | check | validate | demo`: the cluster through ansible-runner, with live progress.

deploy runs site.yml, check the preflight (inventory shape, every node reachable, facts), validate the
post-deploy checks (playbooks/validate.yml) and prints their report; demo drives the whole lab story end to end.
Exit codes: 0 ok, 1 a host or check failed, 2 usage or environment error (ShardstackError).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shardstack.errors import ShardstackError
from shardstack.ops.runner import Event, RunResult, run_playbook

console = Console(stderr=True)
DEFAULT_INVENTORY = Path("inventory/lab/hosts.yml")

# Exit codes that mean something to automation.
EXIT_OK, EXIT_FAILED_HOSTS, EXIT_USAGE = 0, 1, 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="run site.yml (or tagged parts of it) through ansible-runner")
    add_run_args(p)
    p.set_defaults(func=_deploy)

    c = sub.add_parser("check", help="preflight: inventory groups, every node reachable, OS facts")
    add_run_args(c, tags=False)
    c.set_defaults(func=_check)

    v = sub.add_parser("validate", help="validate a deployed cluster: GPUs, NCCL, all-reduce, storage, inference")
    add_run_args(v, tags=False)
    v.add_argument("--allreduce-mb", type=float, default=16.0, help="all-reduce tensor size (MiB, default 16)")
    v.set_defaults(func=_validate)

    d = sub.add_parser("demo", help="lab up (3 nodes) → site.yml → train → export → serve → validate → re-deploy")
    d.add_argument("--name", default="demo", help="lab name (default demo)")
    d.add_argument("--steps", type=int, default=300, help="training steps of the demo job (default 300)")
    d.add_argument("--keep", action="store_true", help="leave the lab running afterwards")
    d.set_defaults(func=_demo)


def add_run_args(p: argparse.ArgumentParser, *, tags: bool = True) -> None:
    p.add_argument("-i", "--inventory", type=Path, default=DEFAULT_INVENTORY,
                   help=f"inventory file or directory (default {DEFAULT_INVENTORY})")
    if tags:
        p.add_argument("--tags", help="only these tags (comma-separated), e.g. os,gpu")
        p.add_argument("--skip-tags", help="skip these tags")
        p.add_argument("--check", action="store_true", help="dry run: report what would change")
    p.add_argument("--limit", help="only these hosts or groups")
    p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="KEY=VALUE",
                   help="extra variable (repeatable), e.g. -e training_runtime_wheelhouse_src=/path")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


class LiveProgress:
    """One line per task as it starts and one per host that changes or fails, with elapsed time."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, event: Event) -> None:
        kind, data = event.get("event"), event.get("event_data", {})
        t = f"[dim]{time.monotonic() - self.started:6.1f}s[/]"
        if kind == "playbook_on_play_start":
            console.print(f"{t} [bold]PLAY {data.get('play', '')}[/]", highlight=False)
        elif kind == "playbook_on_task_start":
            console.print(f"{t}   {data.get('task', '')}", highlight=False)
        elif kind == "runner_on_ok" and data.get("res", {}).get("changed"):
            console.print(f"{t}     [yellow]changed[/] {data.get('host')}", highlight=False)
        elif kind == "runner_on_skipped" and (reason := data.get("res", {}).get("skip_reason")):
            console.print(f"{t}     [cyan]skipped[/] {data.get('host')}: {reason}", highlight=False)
        elif kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            msg = data.get("res", {}).get("msg", "")
            console.print(f"{t}     [red]{kind.split('_')[-1]}[/] {data.get('host')}: {msg}", highlight=False)


def summary_table(result: RunResult, title: str) -> Table:
    table = Table(title=f"{title}: {result.status} in {result.seconds:.1f}s — artifacts {result.artifact_dir}")
    for col in ("host", "ok", "changed", "failed", "unreachable", "skipped", "failed task"):
        table.add_column(col)
    for h in result.hosts.values():
        table.add_row(h.host, str(h.ok), str(h.changed), str(h.failed), str(h.unreachable), str(h.skipped),
                      f"{h.failed_task}: {h.message}" if h.failed_task else "")
    return table


def parse_extra_vars(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ShardstackError(f"extra variable {pair!r} is not KEY=VALUE")
        out[key] = value
    return out


def run_and_report(playbook: str, args: argparse.Namespace, title: str, *,
                   extravars: dict[str, Any] | None = None) -> RunResult:
    extravars = {**parse_extra_vars(getattr(args, "extra_vars", None) or []), **(extravars or {})}
    result = run_playbook(playbook, args.inventory, tags=getattr(args, "tags", None),
                          skip_tags=getattr(args, "skip_tags", None), limit=args.limit,
                          check=getattr(args, "check", False), extravars=extravars,
                          on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        console.print(summary_table(result, title))
    return result


def _deploy(args: argparse.Namespace) -> int:
    result = run_and_report("site.yml", args, "deploy" + (" --check" if args.check else ""))
    return EXIT_OK if result.success else EXIT_FAILED_HOSTS



REQUIRED_GROUPS = ("train_nodes", "inference_nodes", "loadbalancer")


def check_inventory(inventory: Path) -> list[str]:
    """Problems with the inventory's shape (empty = fine); the reachability check is the preflight playbook's."""
    from shardstack.ops.cluster import inventory_hosts

    inv = inventory_hosts(inventory)
    problems = [f"group {g} has no hosts" for g in REQUIRED_GROUPS if not inv["groups"].get(g)]
    if len(inv["groups"].get("loadbalancer", [])) > 1:
        problems.append("more than one loadbalancer host: rollouts drain each, but clients need one address")
    return problems


def _check(args: argparse.Namespace) -> int:
    problems = check_inventory(args.inventory)
    for p in problems:
        console.print(f"[red]inventory:[/] {p}", highlight=False)
    result = run_and_report("playbooks/preflight.yml", args, "check (preflight)")
    return EXIT_OK if result.success and not problems else EXIT_FAILED_HOSTS


def validate_findings(data: dict[str, Any]) -> list[str]:
    """What failed in validate.yml's published measurements (empty = everything passed)."""
    bad = []
    ar = data.get("validate_allreduce")
    if not ar:
        bad.append("all-reduce: no result")
    elif not ar.get("correct"):
        bad.append("all-reduce: wrong sum")
    for host, st in (data.get("validate_storage") or {}).items():
        if not st.get("peer_checksum_matches"):
            bad.append(f"storage: {host} read different bytes than {st.get('read_of')} wrote")
    if not data.get("validate_storage"):
        bad.append("storage: no result")
    inf = data.get("validate_inference")
    if not inf:
        bad.append("inference: no result")
    elif int(inf.get("status", -1)) != 200:
        bad.append(f"inference: load balancer answered {inf.get('status')}")
    return bad


def validate_tables(data: dict[str, Any]) -> list[Table]:
    tables = []
    nodes = Table(title="validate: nodes")
    for col in ("host", "GPUs / driver", "NCCL config", "storage write", "storage read (peer)", "same bytes"):
        nodes.add_column(col)
    gpu, storage = data.get("validate_gpu") or {}, data.get("validate_storage") or {}
    for host in sorted(set(gpu) | set(storage)):
        g, s = gpu.get(host, {}), storage.get(host, {})
        nodes.add_row(host, ", ".join(g.get("gpus") or []) or g.get("driver", ""),
                      "\n".join(g.get("nccl_conf") or []) or "-", _dd_rate(s.get("write", "")),
                      f"{_dd_rate(s.get('read', ''))} ({s.get('read_of', '')})",
                      str(s.get("peer_checksum_matches", "")))
    tables.append(nodes)
    if ar := data.get("validate_allreduce"):
        t = Table(title="validate: all-reduce across the train nodes")
        for col in ("backend", "nodes", "ranks", "size", "time", "algbw", "busbw", "sum correct"):
            t.add_column(col)
        t.add_row(ar["backend"], str(ar["nodes"]), str(ar["world_size"]), f"{ar['bytes'] / 2**20:.0f} MiB",
                  f"{ar['seconds_min'] * 1e3:.1f} ms", f"{ar['algbw_gbps']:.2f} Gbit/s",
                  f"{ar['busbw_gbps']:.2f} Gbit/s", str(ar["correct"]))
        tables.append(t)
    if inf := data.get("validate_inference"):
        t = Table(title="validate: inference")
        for col in ("backends /health", "through the load balancer", "seconds", "text"):
            t.add_column(col)
        t.add_row(" ".join(f"{h}={c}" for h, c in (inf.get("backends") or {}).items()), str(inf.get("status")),
                  f"{float(inf.get('seconds', -1)):.3f}", repr(str(inf.get("text", ""))[:60]))
        tables.append(t)
    return tables


def _dd_rate(line: str) -> str:
    # dd's summary: "33554432 bytes (34 MB, 32 MiB) copied, 0.05 s, 671 MB/s"
    return line.rsplit(",", 1)[-1].strip() if "copied" in line else line


def run_validate(inventory: Path, *, allreduce_mb: float = 16.0, limit: str | None = None,
                 extravars: dict[str, Any] | None = None, quiet: bool = False) -> tuple[RunResult, list[str]]:
    result = run_playbook("playbooks/validate.yml", inventory, limit=limit,
                          extravars={**(extravars or {}), "validate_allreduce_mb": allreduce_mb},
                          on_event=None if quiet else LiveProgress())
    return result, validate_findings(result.data)


def _validate(args: argparse.Namespace) -> int:
    result, findings = run_validate(args.inventory, allreduce_mb=args.allreduce_mb, limit=args.limit,
                                    extravars=parse_extra_vars(args.extra_vars), quiet=args.json)
    if args.json:
        print(json.dumps({**result.to_dict(), "findings": findings}, indent=2))
    else:
        console.print(summary_table(result, "validate"))
        for t in validate_tables(result.data):
            console.print(t)
        for f in findings:
            console.print(f"[red]FAILED[/] {f}", highlight=False)
    return EXIT_OK if result.success and not findings else EXIT_FAILED_HOSTS


def demo_job(steps: int, shared_dir: str, name: str = "demo") -> dict[str, Any]:
    """The demo's job: a tiny GPT, ZeRO stage 3 (FSDP2) across 2 nodes on CPU, the shipped corpus."""
    from shardstack.config import config_from_dict

    cfg = {
        "model": {"size": "tiny"},
        "data": {"path": f"{shared_dir}/data/corpus"},
        "engine": {"stage": 3, "device": "auto"},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": min(20, steps // 10), "total_steps": steps},
        "batch": {"global_batch": 8, "micro_batch": 4},
        "checkpoint": {"dir": f"{shared_dir}/checkpoints/{name}", "interval": max(10, steps // 6), "keep": 2},
        "metrics": {"port": 9400, "log_every": 10},
    }
    return config_from_dict(cfg).to_dict()


def _demo(args: argparse.Namespace) -> int:
    from shardstack.lab import lab
    from shardstack.lab.progress import Progress
    from shardstack.ops import cluster, serve, train
    from shardstack.ops.runner import project_dir
    from shardstack.ops.wheelhouse import build

    phases: list[tuple[str, float]] = []
    inventory = Path("inventory/lab/hosts.yml")

    def phase(name: str, started: float) -> None:
        phases.append((name, time.monotonic() - started))
        console.print(f"[bold green]✓[/] {name}: {phases[-1][1]:.1f}s", highlight=False)

    t0 = time.monotonic()
    if args.name in lab.st.list_labs():
        console.print(f"lab {args.name} already up; reusing it")
    else:
        lab.up(args.name, 3, inventory, Progress())
    phase("lab up (3 nodes)", t0)
    ns = argparse.Namespace(inventory=inventory, tags=None, skip_tags=None, limit=None, check=False, json=False)
    completion = None
    try:
        # One wheelhouse for every run of the demo, so the second deploy compares like with like.
        t = time.monotonic()
        wh = build(project_dir(), log=lambda m: console.print(m, highlight=False))
        pinned = {"training_runtime_wheelhouse_src": str(wh.path)}
        phase(f"wheelhouse ({'built' if wh.built else 'cached'}, {wh.bytes / 2**20:.0f} MiB)", t)

        first = run_and_report("site.yml", ns, "site.yml, first run", extravars=pinned)
        phases.append(("site.yml", first.seconds))
        if not first.success:
            raise ShardstackError("site.yml failed on the lab; see the table above", exit_code=EXIT_FAILED_HOSTS)

        t = time.monotonic()
        job = demo_job(args.steps, cluster.SHARED_DIR)
        sub = train.submit(job, "demo", inventory, nodes=2, on_event=LiveProgress())
        if not sub.success:
            console.print(summary_table(sub, "train submit demo"))
            raise ShardstackError("train submit failed", exit_code=EXIT_FAILED_HOSTS)

        def show(st: train.JobStatus) -> None:
            last = st.last_step
            console.print(f"  job demo: {st.state}" + (f", step {last['step']}/{args.steps} loss {last['loss']:.3f}"
                                                       f" {last['tokens_per_second']:.0f} tok/s" if last else ""),
                          highlight=False)

        st = cluster.wait_job("demo", inventory, timeout=max(600, args.steps * 5), on_status=show)
        if st.state != "finished":
            raise ShardstackError(f"the demo job ended {st.state}", hint="shardstack train logs demo",
                                  exit_code=EXIT_FAILED_HOSTS)
        phase(f"train: 2 nodes, ZeRO-3, {args.steps} steps", t)

        t = time.monotonic()
        exp = cluster.export_current(inventory, job["checkpoint"]["dir"], "demo")
        phase(f"export → {exp.current}", t)

        t = time.monotonic()
        ro = serve.rollout(inventory, extravars=pinned, on_event=LiveProgress())
        if not ro.success:
            console.print(summary_table(ro, "serve rollout"))
            raise ShardstackError("serve rollout failed", exit_code=EXIT_FAILED_HOSTS)
        phase("serve rollout (inference nodes load the model)", t)

        t = time.monotonic()
        # Sampled, not greedy: a few hundred CPU steps of a tiny byte-level model make greedy decoding repeat spaces.
        completion = cluster.complete(cluster.lb_url(inventory), "The ", token=cluster.load_token(inventory),
                                      max_tokens=48, temperature=0.8)
        if completion.status != 200:
            raise ShardstackError(f"completion through the load balancer answered {completion.status}: "
                                  f"{completion.body}", exit_code=EXIT_FAILED_HOSTS)
        phase("a completion through the load balancer", t)

        t = time.monotonic()
        val, findings = run_validate(inventory, quiet=True)
        for table in validate_tables(val.data):
            console.print(table)
        if findings or not val.success:
            raise ShardstackError("validate failed: " + "; ".join(findings or ["see the artifacts"]),
                                  exit_code=EXIT_FAILED_HOSTS)
        phase("validate", t)

        again = run_and_report("site.yml", ns, "site.yml, second run (must change nothing)", extravars=pinned)
        phases.append((f"site.yml again ({again.changed} changed)", again.seconds))
        if not again.success or again.changed:
            raise ShardstackError(f"second deploy was not clean: {again.changed} changed, {again.failed} failed",
                                  exit_code=EXIT_FAILED_HOSTS)
    finally:
        if not args.keep:
            t = time.monotonic()
            lab.down(args.name, Progress())
            phases.append(("lab down", time.monotonic() - t))
        table = Table(title="demo phases")
        table.add_column("phase")
        table.add_column("seconds", justify="right")
        for name, secs in phases:
            table.add_row(name, f"{secs:.1f}")
        console.print(table)
    if completion:
        console.print(f"[bold]completion from the trained model[/] ({completion.seconds * 1e3:.0f} ms): "
                      f"'The ' → {completion.text!r}", highlight=False)
    return EXIT_OK
