"""Which inventory a cluster command targets: `-i PATH`, else $SHARDSTACK_INVENTORY, else the lab's inventory when a
lab wrote one here. Never the lab silently when nothing says so: with neither, the command stops with one line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from shardstack.errors import ShardstackError

if TYPE_CHECKING:  # main() imports this module for every command: the ops layer only for those that use it
    from shardstack.ops.inventory import Cluster

INVENTORY_ENV = "SHARDSTACK_INVENTORY"
LAB_INVENTORY = Path("inventory/lab/hosts.yml")  # what `shardstack lab up` writes, relative to the working directory
# Set on every parser that takes -i, so main() resolves the default only for commands that use an inventory.
_RESOLVE = "_resolve_inventory"


def add_inventory_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--inventory", type=Path, default=None,
                   help=f"inventory file or directory (default: ${INVENTORY_ENV} when set, else {LAB_INVENTORY} "
                        "when it exists; neither: an error)")
    p.set_defaults(**{_RESOLVE: True})


def default_inventory() -> Path:
    """$SHARDSTACK_INVENTORY wins over the lab: a configured real inventory is never replaced by the lab's."""
    if env := os.environ.get(INVENTORY_ENV):
        return Path(env)
    if LAB_INVENTORY.exists():
        return LAB_INVENTORY
    raise ShardstackError(f"no inventory: pass -i PATH or set {INVENTORY_ENV}")


def resolve_inventory(args: argparse.Namespace) -> None:
    """Fill in args.inventory for a command that takes -i and was given none."""
    if getattr(args, _RESOLVE, False) and args.inventory is None:
        args.inventory = default_inventory()


def load_cluster(args: argparse.Namespace) -> Cluster:
    """The cluster the command targets, loaded once for the whole command (its inventory is read on first use)."""
    from shardstack.ops.inventory import Cluster

    return Cluster.load(args.inventory or default_inventory())
