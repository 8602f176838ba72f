"""`shardstack node cordon|uncordon|drain NODE` (docs/operations.md, "Cordon and drain")."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import console
from shardstack.ops import cordon as cordon_ops

HELP = {
    "cordon": "take a node out of service: HAProxy drains an inference backend; train jobs submitted later skip it",
    "drain": "cordon, and every training job running on a train node stops after its current step with a checkpoint "
             "there (resubmit: it resumes without the node)",
    "uncordon": "put a node back: HAProxy sends it requests again; train jobs may use it",
}


def register(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="cordon, drain and uncordon nodes")
    actions = node.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action in cordon_ops.ACTIONS:
        p = actions.add_parser(action, help=HELP[action])
        p.add_argument("node", help="inventory name of the node")
        add_inventory_arg(p)
        p.add_argument("--json", action="store_true", help="print the outcome as JSON")
        p.set_defaults(func=_apply)


def _apply(args: argparse.Namespace) -> int:
    cluster = load_cluster(args)
    socket = str(cluster.setting("loadbalancer_admin_socket", "loadbalancer", "loadbalancer"))
    own = cluster.hostvars.get(args.node, {}).get("node_exporter_textfile_dir")  # the node's own value wins
    textfile_dir = str(own or cluster.setting("node_exporter_textfile_dir", "node_exporter"))
    out = cordon_ops.apply(args.node, args.action, cluster, socket=socket, textfile_dir=textfile_dir)
    if args.json:
        print(json.dumps(asdict(out), indent=2))
        return 0
    verb = {"cordon": "cordoned", "drain": "drained", "uncordon": "uncordoned"}[out.action]
    console.print(f"{out.node} ({', '.join(out.roles)}): {verb}")
    if out.load_balancers:
        state = cordon_ops.HAPROXY_STATE[out.action].upper()
        console.print(f"  HAProxy server state {state} on {', '.join(out.load_balancers)}")
    if out.metric_written:
        console.print(f"  shardstack_node_cordoned {0 if out.action == 'uncordon' else 1} on {out.node}")
    for note in out.notes:
        console.print(f"  {note}")
    console.print(f"  state: {out.state_file}")
    return 0
