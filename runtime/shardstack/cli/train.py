"""`shardstack train run` (a job here: alone, or one process per rank under torchrun) and
`shardstack train submit|status|stop|logs` (jobs on the cluster's train nodes, docs/operations.md)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rich.table import Table

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, console, summary_table
from shardstack.errors import ShardstackError
from shardstack.ops import train as train_ops

log = logging.getLogger("shardstack.train")


def register(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="run a training job here, or manage jobs on the cluster")
    actions = train.add_subparsers(dest="train_command", metavar="ACTION", required=True)

    run = actions.add_parser("run", help="train from a job.yaml (alone, or one process per rank under torchrun)")
    run.add_argument("--config", required=True, help="job.yaml")
    run.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (short runs)")
    run.add_argument("--allow-config-change", action="store_true",
                     help="resume a checkpoint written under another config hash, or adopt one that names no job "
                          "(sets checkpoint.allow_config_change)")
    run.add_argument("--json", action="store_true",
                     help="print the result (steps, final loss, tokens/s, stop signal) as JSON on stdout (rank 0); "
                          "the per-step lines go to stderr")
    run.set_defaults(func=_run)

    def common(p: argparse.ArgumentParser) -> None:
        add_inventory_arg(p)
        p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    p = actions.add_parser("submit", help="start a job on the train nodes: shardstack-train@<job> units (systemd), "
                                          "or an sbatch job (Slurm), as the inventory's shardstack_scheduler says")
    p.add_argument("--config", type=Path, required=True, help="job.yaml (validated here first)")
    p.add_argument("--name", help="job name (default: the config file's stem)")
    p.add_argument("--nodes", type=int, default=None,
                   help="systemd: the first N train nodes; Slurm: N nodes (default: every train node)")
    p.add_argument("--account", help="Slurm: the account (team) to charge (default: the user's default)")
    p.add_argument("--qos", help="Slurm: the QOS (default: the account's default)")
    p.add_argument("--time", dest="time_limit", metavar="LIMIT", help="Slurm: time limit, [days-]hours:minutes:seconds")
    p.add_argument("--allow-config-change", action="store_true",
                   help="let the job resume its checkpoints although its config hash changed, or adopt ones that "
                        "name no job (sets checkpoint.allow_config_change in the job's config on the nodes)")
    common(p)
    p.set_defaults(func=_submit)

    p = actions.add_parser("status", help="per-node unit state (Slurm: the job's state, reason, elapsed time) and "
                                          "the newest logged step")
    p.add_argument("name")
    common(p)
    p.set_defaults(func=_status)

    p = actions.add_parser("stop", help="stop the job at a checkpoint: systemctl stop on every train node, or scancel")
    p.add_argument("name")
    common(p)
    p.set_defaults(func=_stop)

    p = actions.add_parser("logs", help="the job's journal from every train node")
    p.add_argument("name")
    p.add_argument("-n", "--lines", type=int, default=50)
    common(p)
    p.set_defaults(func=_logs)


def _run(args: argparse.Namespace) -> int:
    from shardstack.train import dist
    from shardstack.train.config import job_name_from_path, load_config
    from shardstack.train.trainer import train

    if args.max_steps is not None and args.max_steps < 1:
        raise ShardstackError("--max-steps must be ≥ 1")
    cfg = load_config(args.config)
    if cfg.name is None:
        cfg.name = job_name_from_path(args.config)
    if args.allow_config_change:
        cfg.checkpoint.allow_config_change = True
    try:
        result = train(cfg, args.max_steps, out=sys.stderr if args.json else None)
    finally:
        dist.shutdown()
    if args.json and os.environ.get("RANK", "0") == "0":  # one document per job, not one per rank
        print(json.dumps({"job": cfg.name, "start_step": result.start_step, "final_step": result.final_step,
                          "steps": len(result.steps),
                          "final_loss": result.losses[-1] if result.losses else None,
                          "tokens_per_second": result.tokens_per_second, "stopped_by": result.stopped_by,
                          "memory_measured": result.memory_measured}, indent=2), flush=True)
    if result.stopped_by:
        log.info("stopped on %s at step %d, last loss %.4f", result.stopped_by, result.final_step,
                 result.losses[-1] if result.losses else float("nan"))
    else:
        log.info("done: step %d, last loss %.4f", result.final_step,
                 result.losses[-1] if result.losses else float("nan"))
    from shardstack.cli import owns_process

    dist.leave_worker(0, own_process=owns_process())
    return 0


def _submit(args: argparse.Namespace) -> int:
    if args.nodes is not None and args.nodes < 1:
        raise ShardstackError("--nodes must be ≥ 1")
    config = train_ops.load_job(args.config)
    name = train_ops.check_job_name(args.name or config["name"] or args.config.stem.lower().replace(".", "-"))
    result = train_ops.submit(config, name, load_cluster(args), nodes=args.nodes, account=args.account, qos=args.qos,
                              time_limit=args.time_limit, allow_config_change=args.allow_config_change,
                              on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps({"job": name, **result.to_dict()}, indent=2))
    else:
        console.print(summary_table(result, f"train submit {name}"))
        if result.success:
            console.print(f"follow it: shardstack train status {name}; shardstack train logs {name}")
    return EXIT_OK if result.success else EXIT_FAILED_HOSTS


def _status(args: argparse.Namespace) -> int:
    st = train_ops.status(args.name, load_cluster(args))
    if args.json:
        print(json.dumps(st.to_dict(), indent=2))
        return 0 if st.state != "failed" else 1
    last = st.last_step
    title = f"job {st.job}: {st.state}" + (f", step {last['step']} loss {last['loss']}" if last else "")
    if st.scheduler == "slurm":
        table = Table(title=title)
        for col in ("slurm job", "state", "reason", "elapsed", "nodes", "account", "qos"):
            table.add_column(col)
        if (j := st.slurm) is not None:
            table.add_row(j.job_id, j.state, j.reason, j.elapsed, f"{j.nodes} {j.nodelist}".strip(), j.account, j.qos)
        console.print(table)
        if j is None:
            console.print(f"no Slurm job named {st.job} (queued, running, or in the last 30 days' accounting)")
        return 0 if st.state not in ("failed", "unknown") else 1
    table = Table(title=title)
    for col in ("host", "state", "result", "agent restarts", "since", "last step"):
        table.add_column(col)
    for n in st.nodes:
        table.add_row(n.host, f"{n.active}/{n.sub}", n.result, str(n.restarts), n.since,
                      str(n.last_step["step"]) if n.last_step else (n.error or ""))
    console.print(table)
    return 0 if st.state != "failed" else 1


def _stop(args: argparse.Namespace) -> int:
    done = train_ops.stop(args.name, load_cluster(args))
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        for host, ok in done.items():
            print(f"{host}: {'stopped' if ok else 'FAILED to stop'}")
    return 0 if done and all(done.values()) else 1


def _unanswered(text: str) -> bool:
    """train_ops.logs gives a node that did not answer (down, unreachable, journalctl failed) as `(why)`; journalctl's
    own output starts with a timestamp or `-- No entries --`."""
    return text.startswith("(") and text.rstrip().endswith(")")


def _logs(args: argparse.Namespace) -> int:
    out = train_ops.logs(args.name, load_cluster(args), args.lines)
    failed = sorted(h for h, text in out.items() if _unanswered(text))
    code = EXIT_FAILED_HOSTS if failed or not out else EXIT_OK
    if args.json:
        print(json.dumps(out, indent=2))
        return code
    for host, text in out.items():
        for line in text.splitlines():
            sys.stdout.write(f"{host} | {line}\n")
    if failed:
        console.print(f"[red]no journal from[/] {', '.join(failed)}", highlight=False)
    elif not out:
        console.print("no train node answered", highlight=False)
    return code
