"""`shardstack lab up|down|status|exec|list`: the local lab of systemd-nspawn nodes (docs/lab.md)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.table import Table

from shardstack.cli.output import EXIT_FAILED_HOSTS, Progress, stdout
from shardstack.errors import ShardstackError
from shardstack.lab import lab, state

DEFAULT_NAME = "lab"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lab", help="local lab of systemd-nspawn nodes (needs root)")
    lsub = p.add_subparsers(dest="lab_command", metavar="ACTION", required=True)

    up = lsub.add_parser("up", help="build the node image once, boot N nodes, write an inventory")
    up.add_argument("--name", default=DEFAULT_NAME, help=f"lab name, 1-8 of [a-z0-9] (default {DEFAULT_NAME})")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--inventory", type=Path, default=None,
                    help="where to write the Ansible inventory (default inventory/lab/hosts.yml)")
    up.set_defaults(func=_up)

    down = lsub.add_parser("down", help="shut the nodes down and remove everything the lab created")
    down.add_argument("--name", default=DEFAULT_NAME)
    down.set_defaults(func=_down)

    status = lsub.add_parser("status", help="nodes, addresses, state, leader PID, memory")
    status.add_argument("--name", default=DEFAULT_NAME)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)

    ls = lsub.add_parser("list", help="labs on this host")
    ls.set_defaults(func=lambda a: print("\n".join(state.list_labs())) or 0)

    ex = lsub.add_parser("exec", help="run a command inside a node: shardstack lab exec NODE -- CMD …")
    ex.add_argument("--name", default=DEFAULT_NAME)
    ex.add_argument("node", help="node name (e.g. lab-n1) or index (1)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    ex.set_defaults(func=_exec)


def _up(args: argparse.Namespace) -> int:
    inventory = args.inventory or Path("inventory/lab/hosts.yml")
    started = time.monotonic()
    lab.up(args.name, args.nodes, inventory, Progress())
    print(f"lab {args.name} up in {time.monotonic() - started:.1f}s")
    return 0


def _down(args: argparse.Namespace) -> int:
    lab.down(args.name, Progress())
    left = lab.leftovers(args.name)
    if left:
        raise ShardstackError("teardown left things behind: " + ", ".join(left), exit_code=EXIT_FAILED_HOSTS)
    return 0


def _status(args: argparse.Namespace) -> int:
    state.validate_name(args.name)
    info = lab.status(args.name)
    if args.json:
        print(lab.dumps(info))
        return 0
    table = Table(title=f"lab {info['name']} — {info['subnet']} on {info['bridge']}, apt proxy {info['apt_proxy']}")
    for col in ("node", "address", "state", "leader pid", "memory", "ssh"):
        table.add_column(col)
    for n in info["nodes"]:
        table.add_row(n["name"], n["address"], n["state"], str(n["leader_pid"] or "-"),
                      f"{n['memory_bytes'] / 2**20:.0f} MiB", "yes" if n["ssh"] else "no")
    stdout.print(table)
    return 0 if all(n["state"] in ("running", "degraded") for n in info["nodes"]) else 1


def _exec(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return lab.exec_in(args.name, args.node, cmd).returncode
