"""`shardstack deploy` (site.yml through ansible-runner) and `shardstack demo` (the lab end to end)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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

    d = sub.add_parser("demo", help="lab up (3 nodes) → site.yml → summary")
    d.add_argument("--name", default="demo", help="lab name (default demo)")
    d.add_argument("--keep", action="store_true", help="leave the lab running afterwards")
    d.set_defaults(func=_demo)


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--inventory", type=Path, default=DEFAULT_INVENTORY,
                   help=f"inventory file or directory (default {DEFAULT_INVENTORY})")
    p.add_argument("--tags", help="only these tags (comma-separated), e.g. os,gpu")
    p.add_argument("--skip-tags", help="skip these tags")
    p.add_argument("--limit", help="only these hosts or groups")
    p.add_argument("--check", action="store_true", help="dry run: report what would change")
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


def run_and_report(playbook: str, args: argparse.Namespace, title: str) -> RunResult:
    result = run_playbook(playbook, args.inventory, tags=args.tags, skip_tags=args.skip_tags, limit=args.limit,
                          check=args.check, on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        console.print(summary_table(result, title))
    return result


def _deploy(args: argparse.Namespace) -> int:
    result = run_and_report("site.yml", args, "deploy" + (" --check" if args.check else ""))
    return EXIT_OK if result.success else EXIT_FAILED_HOSTS


def _demo(args: argparse.Namespace) -> int:
    from shardstack.lab import lab
    from shardstack.lab.progress import Progress

    phases: list[tuple[str, float]] = []
    inventory = Path("inventory/lab/hosts.yml")
    t0 = time.monotonic()
    if args.name in lab.st.list_labs():
        console.print(f"lab {args.name} already up; reusing it")
    else:
        lab.up(args.name, 3, inventory, Progress())
    phases.append(("lab up (3 nodes)", time.monotonic() - t0))
    ns = argparse.Namespace(inventory=inventory, tags=None, skip_tags=None, limit=None, check=False, json=False)
    try:
        first = run_and_report("site.yml", ns, "site.yml, first run")
        phases.append(("site.yml", first.seconds))
        if not first.success:
            raise ShardstackError("site.yml failed on the lab; see the table above", exit_code=EXIT_FAILED_HOSTS)
        again = run_and_report("site.yml", ns, "site.yml, second run (must change nothing)")
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
    return EXIT_OK
