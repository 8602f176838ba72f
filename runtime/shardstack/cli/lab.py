"""`shardstack lab up|down|status|exec|list`: the local lab of systemd-nspawn nodes (docs/lab.md)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.table import Table

from shardstack.cli.inventory import LAB_INVENTORY
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, Progress, stdout
from shardstack.errors import ShardstackError
from shardstack.lab import lab, state
from shardstack.lab.image import DEFAULT_RELEASE, RELEASES

DEFAULT_NAME = "lab"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lab", help="local lab of systemd-nspawn nodes (needs root)")
    lsub = p.add_subparsers(dest="lab_command", metavar="ACTION", required=True)

    up = lsub.add_parser("up", help="build the node image once, boot N nodes, write an inventory")
    up.add_argument("--name", default=DEFAULT_NAME, help=f"lab name, 1-8 of [a-z0-9] (default {DEFAULT_NAME})")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--release", choices=sorted(RELEASES), default=DEFAULT_RELEASE,
                    help=f"the nodes' Debian release (default {DEFAULT_RELEASE})")
    # An output, so not -i/--inventory, which every other command reads.
    up.add_argument("--write-inventory", type=Path, default=None, metavar="PATH",
                    help=f"where to write the lab's Ansible inventory (default {LAB_INVENTORY})")
    up.add_argument("--json", action="store_true", help="print the result (name, nodes, inventory, seconds) as JSON")
    up.set_defaults(func=_up)

    down = lsub.add_parser("down", help="shut the nodes down and remove everything the lab created")
    down.add_argument("--name", default=DEFAULT_NAME)
    down.add_argument("--json", action="store_true", help="print the result (name, leftovers) as JSON")
    down.set_defaults(func=_down)

    status = lsub.add_parser("status", help="nodes, addresses, state, leader PID, memory")
    status.add_argument("--name", default=DEFAULT_NAME)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)

    ls = lsub.add_parser("list", help="labs on this host")
    ls.add_argument("--json", action="store_true", help='print {"labs": [...]} as JSON')
    ls.set_defaults(func=_list)

    ex = lsub.add_parser("exec", help="run a command inside a node: shardstack lab exec NODE -- CMD …")
    ex.add_argument("--name", default=DEFAULT_NAME)
    ex.add_argument("node", help="node name (e.g. lab-n1) or index (1)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    ex.set_defaults(func=_exec)


def _up(args: argparse.Namespace) -> int:
    inventory = args.write_inventory or LAB_INVENTORY
    started = time.monotonic()
    lab.up(args.name, args.nodes, inventory, Progress(quiet=args.json), release=args.release)
    seconds = time.monotonic() - started
    if args.json:
        print(json.dumps({"name": args.name, "nodes": args.nodes, "release": args.release, "inventory": str(inventory),
                          "seconds": round(seconds, 1)}, indent=2))
    else:
        print(f"lab {args.name} up in {seconds:.1f}s")
    return 0


def _down(args: argparse.Namespace) -> int:
    lab.down(args.name, Progress(quiet=args.json))
    left = lab.leftovers(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "down": not left, "leftovers": left}, indent=2))
        return EXIT_FAILED_HOSTS if left else EXIT_OK
    if left:
        raise ShardstackError("teardown left things behind: " + ", ".join(left), exit_code=EXIT_FAILED_HOSTS)
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    labs = state.list_labs()
    print(json.dumps({"labs": labs}) if args.json else "\n".join(labs))
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    state.validate_name(args.name)
    info = lab.status(args.name)
    healthy = all(n["state"] in ("running", "degraded") for n in info["nodes"])
    if args.json:  # 0 whatever the states: molecule's create reads the addresses of nodes still booting
        print(lab.dumps(info))
        return EXIT_OK
    table = Table(title=f"lab {info['name']} ({info['release']}) — {info['subnet']} on {info['bridge']}, "
                        f"apt proxy {info['apt_proxy']}")
    for col in ("node", "address", "state", "leader pid", "memory", "ssh"):
        table.add_column(col)
    for n in info["nodes"]:
        table.add_row(n["name"], n["address"], n["state"], str(n["leader_pid"] or "-"),
                      f"{n['memory_bytes'] / 2**20:.0f} MiB", "yes" if n["ssh"] else "no")
    stdout.print(table)
    return EXIT_OK if healthy else EXIT_FAILED_HOSTS


def _exec(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return lab.exec_in(args.name, args.node, cmd).returncode
