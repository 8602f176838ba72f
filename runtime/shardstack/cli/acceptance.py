"""`shardstack acceptance -i INV [--out DIR]`: the deployment guides' acceptance on a deployed cluster
(shardstack.ops.acceptance), shown as it runs, its verdicts in one table, its report (Markdown + PNG plots) in DIR.
Exit 0 when no item failed, 1 when one did or a train node cannot be reached (before anything starts), 2 for
bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, console
from shardstack.errors import ShardstackError
from shardstack.ops.acceptance import records, report
from shardstack.ops.acceptance.run import Hooks, run_acceptance

_STYLE = {"pass": "green", "fail": "bold red", "n/a": "yellow"}


def register(sub: argparse._SubParsersAction) -> None:
    d = records.Settings()
    t = records.Thresholds()
    p = sub.add_parser("acceptance", help="the acceptance on a deployed cluster: loss with ZeRO off/on, scaling, "
                                          "all-reduce bandwidth, GPU use, kill and resume; a report with plots")
    add_inventory_arg(p)
    p.add_argument("--out", type=Path, default=Path("acceptance"),
                   help="report directory: acceptance.md and its PNGs (default ./acceptance)")
    p.add_argument("--json", action="store_true", help="also print the whole result (every run's step records) as "
                                                        "JSON on stdout; progress and tables stay on stderr")
    p.add_argument("--keep-runs", type=int, default=d.keep_runs, metavar="N",
                   help=f"acceptance run directories (records, the kill job's checkpoints) kept under "
                        f"<shared>/checkpoints/, this run's included; older ones are removed before it starts "
                        f"(default {d.keep_runs})")
    g = p.add_argument_group("sizes of the runs")
    g.add_argument("--steps", type=int, default=d.steps, help=f"steps of each loss/throughput run (default {d.steps})")
    g.add_argument("--kill-steps", type=int, default=d.kill_steps,
                   help=f"steps of the kill-and-resume job (default {d.kill_steps})")
    g.add_argument("--checkpoint-interval", type=int, default=d.checkpoint_interval,
                   help=f"the kill job's checkpoint interval; the kill waits for the second (default "
                        f"{d.checkpoint_interval})")
    g.add_argument("--batch-per-node", type=int, default=d.batch_per_node,
                   help=f"sequences per node per step (weak scaling; default {d.batch_per_node})")
    g.add_argument("--model-size", default=d.model_size, help=f"GPT size of the jobs (default {d.model_size})")
    g.add_argument("--seed", type=int, default=d.seed, help=f"the jobs' seed (default {d.seed})")
    g.add_argument("--max-nodes", type=int, default=None, help="scale up to this many train nodes (default: all)")
    g.add_argument("--allreduce-mb", type=float, default=None,
                   help="validate's all-reduce size in MiB, the largest of its sweep where it sweeps (default: "
                        "validate's own)")
    g.add_argument("--job-timeout", type=float, default=d.job_timeout,
                   help=f"seconds one job may take (default {d.job_timeout:.0f})")
    h = p.add_argument_group("thresholds (defaults: honest for the lab's shared CPUs; docs/operations.md)")
    h.add_argument("--loss-rtol", type=float, default=t.loss_rtol,
                   help=f"stage 0 vs stage 3: max relative loss difference (default {t.loss_rtol:g})")
    h.add_argument("--min-scaling-efficiency", type=float, default=t.min_scaling_efficiency,
                   help=f"tps(N) / (N · tps(1)) at the most nodes (default {t.min_scaling_efficiency:g})")
    h.add_argument("--max-scaling-efficiency", type=float, default=t.max_scaling_efficiency,
                   help=f"above this the runs were not alike and the item fails (default {t.max_scaling_efficiency:g})")
    h.add_argument("--max-comm-fraction", type=float, default=t.max_comm_fraction,
                   help=f"gradient traffic at the measured busbw / step time (default {t.max_comm_fraction:g})")
    h.add_argument("--min-gpu-utilization", type=float, default=t.min_gpu_utilization,
                   help=f"mean DCGM GPU utilisation over the run, 0–1 (default {t.min_gpu_utilization:g})")
    h.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                   help="the whole acceptance must finish within this (default: reported, not judged)")
    p.set_defaults(func=_acceptance)


def _echo(message: str) -> None:
    console.print(f"  {message}", highlight=False)


def _item(item: records.Item) -> None:
    console.print(f"[{_STYLE[item.status]}]{report.MARK[item.status]}[/] {item.title} "
                  f"({item.seconds:.0f}s): {item.measured}", highlight=False)


def verdict_table(result: records.Acceptance) -> Table:
    table = Table(title=f"acceptance: {'passed' if result.passed else 'FAILED'} in {result.seconds / 60:.1f} min")
    for col in ("item", "result", "measured", "threshold", "seconds"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for item, (title, mark, measured, threshold, secs) in zip(result.items, report.verdict_rows(result),
                                                             strict=True):
        table.add_row(title, f"[{_STYLE[item.status]}]{mark}[/]", measured, threshold, secs)
    return table


def _acceptance(args: argparse.Namespace) -> int:
    settings = records.Settings(
        steps=args.steps, kill_steps=args.kill_steps, checkpoint_interval=args.checkpoint_interval,
        batch_per_node=args.batch_per_node, model_size=args.model_size, seed=args.seed, max_nodes=args.max_nodes,
        allreduce_mb=args.allreduce_mb, job_timeout=args.job_timeout,
        time_budget=None if args.time_budget is None else args.time_budget * 60, keep_runs=args.keep_runs)
    thresholds = records.Thresholds(
        loss_rtol=args.loss_rtol, min_scaling_efficiency=args.min_scaling_efficiency,
        max_scaling_efficiency=args.max_scaling_efficiency,
        max_comm_fraction=args.max_comm_fraction, min_gpu_utilization=args.min_gpu_utilization)
    # The model size is checked here, before any node is asked: a typo should not cost a validate run.
    from shardstack.train.config import config_from_dict

    try:
        config_from_dict({"model": {"size": args.model_size}})
    except ShardstackError as exc:
        raise ShardstackError(f"--model-size: {exc}") from None
    cluster = load_cluster(args)
    result = records.Acceptance(str(cluster.path), settings, thresholds)
    hooks = Hooks(echo=_echo, item=_item, events=LiveProgress)
    console.print(f"[bold]acceptance[/] on {cluster.path}: report → {args.out}/acceptance.md", highlight=False)
    try:
        run_acceptance(cluster, settings, thresholds, hooks, result)
    finally:
        if result.items:  # what ran is reported even when a later step raised
            console.print(verdict_table(result))
            path = report.write(result, args.out)
            console.print(f"report: {path} (plots: {', '.join(sorted(p.name for p in args.out.glob('*.png')))})",
                          highlight=False)
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
    return EXIT_OK if result.passed else EXIT_FAILED_HOSTS
