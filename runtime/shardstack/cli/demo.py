"""`shardstack demo`: the lab end to end — lab up (3 nodes), then shardstack.ops.demo's phases (site.yml, the
pretrained Llama on shared storage, a 2-node ZeRO-3 fine-tune, export, serve, a completion, validate, a second deploy
that must change nothing), then lab down. Here: the arguments, the lab, and how the phases are shown."""

from __future__ import annotations

import argparse
import json
import time

from rich.table import Table

from shardstack.cli.deploy import validate_tables
from shardstack.cli.inventory import LAB_INVENTORY
from shardstack.cli.output import EXIT_OK, LiveProgress, Progress, console, summary_table
from shardstack.lab import lab
from shardstack.ops import demo
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import RunResult


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="lab up (3 nodes) → site.yml → train → export → serve → validate → re-deploy")
    d.add_argument("--name", default="demo", help="lab name (default demo)")
    d.add_argument("--steps", type=int, default=60, help="fine-tuning steps of the demo job (default 60)")
    d.add_argument("--keep", action="store_true", help="leave the lab running afterwards")
    d.add_argument("--json", action="store_true",
                   help="print the outcome (phases with seconds, the completion, the error if any) as JSON on stdout; "
                        "progress and tables stay on stderr")
    d.set_defaults(func=_demo)


def _echo(message: str) -> None:
    console.print(message, highlight=False)


def _phase(name: str, seconds: float) -> None:
    console.print(f"[bold green]✓[/] {name}: {seconds:.1f}s", highlight=False)


def _ran(result: RunResult, title: str) -> None:
    console.print(summary_table(result, title))


def _validated(data: dict) -> None:
    for table in validate_tables(data):
        console.print(table)


HOOKS = demo.DemoHooks(echo=_echo, phase=_phase, events=LiveProgress, ran=_ran, validated=_validated)


def _demo(args: argparse.Namespace) -> int:
    out = demo.DemoResult(args.name)
    inventory = LAB_INVENTORY  # the lab this command brings up writes it here
    t0 = time.monotonic()
    if args.name in lab.st.list_labs():
        console.print(f"lab {args.name} already up; reusing it")
    else:
        lab.up(args.name, 3, inventory, Progress())
    out.phases.append(("lab up (3 nodes)", time.monotonic() - t0))
    _phase(*out.phases[-1])
    try:
        demo.run(Cluster.load(inventory), args.steps, HOOKS, out)
    finally:
        if not args.keep:
            t = time.monotonic()
            lab.down(args.name, Progress())
            out.phases.append(("lab down", time.monotonic() - t))
        table = Table(title="demo phases")
        table.add_column("phase")
        table.add_column("seconds", justify="right")
        for name, secs in out.phases:
            table.add_row(name, f"{secs:.1f}")
        console.print(table)
        if args.json:  # also when a phase failed: which one, and how long the others took
            print(json.dumps(out.to_dict(), indent=2))
    if out.completion and not args.json:
        console.print(f"[bold]completion from the trained model[/] ({out.completion.seconds * 1e3:.0f} ms): "
                      f"{demo.PROMPT!r} → {out.completion.text!r}", highlight=False)
    return EXIT_OK
