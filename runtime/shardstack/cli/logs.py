"""`shardstack logs`: every node's journal from the central store on the log collector (docs/operations.md)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.markup import escape
from rich.table import Table

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import EXIT_OK, console
from shardstack.ops import logs as logs_ops

# journald priorities 0-7; errors and worse in red, warnings in yellow.
_PRIORITY_STYLE = {0: "bold red", 1: "bold red", 2: "bold red", 3: "red", 4: "yellow"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="search every node's journal in the central store (the log collector)",
                       description="Query the central journal store on the log collector (the first "
                                   "monitoring_server): newest entries first filtered, oldest first printed.")
    p.add_argument("--host", "-H",
                   help="only this node, by inventory name: its own journal at the collector (not entries naming it)")
    p.add_argument("--unit", "-u", help="only this systemd unit (e.g. shardstack-inference.service)")
    p.add_argument("--job", "-j", help="only this training job (its unit shardstack-train@JOB on every train node)")
    p.add_argument("--identifier", "-t", help="only this syslog identifier (e.g. haproxy, logger -t NAME)")
    p.add_argument("--since", "-S", help='from this time on: "-10min", "-2h", "today", "2025-01-31 12:00"')
    p.add_argument("--grep", "-g", help="only messages matching this regular expression (PCRE2)")
    p.add_argument("--lines", "-n", type=int, default=100, help="the newest N entries (default 100)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new entries (asks every 2 s)")
    p.add_argument("--json", action="store_true", help="one JSON object per entry (JSON lines) on stdout")
    p.add_argument("--collector", default=logs_ops.COLLECTOR, metavar="HOST",
                   help="the inventory host holding the central store, when journal_collector moved it "
                        f"(default {logs_ops.COLLECTOR})")
    add_inventory_arg(p)
    p.set_defaults(func=_logs)


def _json_line(entry: logs_ops.LogEntry) -> None:
    sys.stdout.write(json.dumps(entry.to_dict(), ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _row(entry: logs_ops.LogEntry) -> tuple[str, ...]:
    style = _PRIORITY_STYLE.get(entry.priority if entry.priority is not None else 6)
    message = escape(entry.message)
    return (entry.iso, entry.host, entry.unit or "", entry.identifier,
            f"[{style}]{message}[/]" if style else message)


def _logs(args: argparse.Namespace) -> int:
    q = logs_ops.LogQuery(host=args.host, unit=args.unit, job=args.job, identifier=args.identifier, since=args.since,
                          grep=args.grep, lines=args.lines)
    cluster = load_cluster(args)
    if args.follow:
        for entry in logs_ops.follow(q, cluster, host=args.collector):
            if args.json:
                _json_line(entry)
            else:
                console.print(" ".join(_row(entry)), soft_wrap=True, highlight=False)
        return EXIT_OK
    with console.status("asking the log collector (journalctl --merge over ansible-runner)…"):
        entries = logs_ops.query(q, cluster, host=args.collector)
    if args.json:
        for entry in entries:
            _json_line(entry)
        return EXIT_OK
    table = Table(title=f"{len(entries)} entries from the central log store", show_lines=False)
    for col in ("time (UTC)", "host", "unit", "identifier", "message"):
        table.add_column(col, overflow="fold")
    for entry in entries:
        table.add_row(*_row(entry))
    console.print(table)
    return EXIT_OK
