"""`shardstack artifacts prune`: the lifecycle of training artefacts on shared storage (docs/operations.md)."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, console
from shardstack.ops import lifecycle


def register(sub: argparse._SubParsersAction) -> None:
    art = sub.add_parser("artifacts", help="training artefacts on shared storage: prune old ones")
    actions = art.add_subparsers(dest="artifacts_command", metavar="ACTION", required=True)
    p = actions.add_parser("prune", help="delete old exports, leftover and quarantined checkpoint directories",
                           description="Runs on the first storage_server. Never deletes the export exports/current "
                                       "points to, the newest sound checkpoint of a job, anything newer than it, "
                                       "or anything younger than --older-than days.")
    p.add_argument("--dry-run", action="store_true", help="list what would go, with sizes; delete nothing")
    p.add_argument("--keep-exports", type=int, default=3, metavar="N", help="newest exports kept (default 3)")
    p.add_argument("--older-than", type=float, default=7.0, metavar="DAYS",
                   help="nothing younger is deleted (default 7)")
    p.add_argument("--all", action="store_true", help="list what is kept too, with the reason")
    p.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    add_inventory_arg(p)
    p.set_defaults(func=_prune)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _prune(args: argparse.Namespace) -> int:
    plan, _ = lifecycle.prune(load_cluster(args), keep_exports=args.keep_exports, older_than_days=args.older_than,
                              dry_run=args.dry_run, on_event=None if args.json else LiveProgress())
    code = EXIT_FAILED_HOSTS if plan.errors else EXIT_OK
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return code
    # Applied: only what really went (a path the owner may not delete is an error, listed below the table).
    gone = plan.deletions if plan.dry_run else [i for i in plan.deletions if i.path in plan.deleted]
    verb = "would delete" if plan.dry_run else "deleted"
    title = (f"{plan.shared_dir}: {verb} {len(gone)} item(s), {human(sum(i.bytes for i in gone))} "
             f"(keep {plan.keep_exports} exports, nothing younger than {plan.older_than_days:g} days)")
    table = Table(title=title)
    for col in ("action", "kind", "path", "size", "age (days)", "why"):
        table.add_column(col, overflow="fold")
    for item in plan.items:
        if item.action == "delete" or args.all:
            action = ("keep" if item.action != "delete" else "would delete" if plan.dry_run
                      else "deleted" if item.path in plan.deleted else "not deleted")
            table.add_row(action, item.kind, item.path, human(item.bytes), f"{item.age_days:g}", item.reason)
    console.print(table)
    for err in plan.errors:
        console.print(f"[red]error:[/] {err}")
    return code
