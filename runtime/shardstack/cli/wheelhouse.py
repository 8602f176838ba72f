"""`shardstack wheelhouse`: build (or find cached) the offline wheelhouse the nodes install shardstack from."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardstack.ops.runner import project_dir
from shardstack.ops.wheelhouse import build


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wheelhouse", help="build the offline wheelhouse the nodes install shardstack from")
    p.add_argument("--cache", type=Path, default=None, help="cache directory (default $SHARDSTACK_CACHE/wheelhouse)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    wh = build(project_dir(), args.cache, log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(wh.to_dict(), indent=2))
    else:
        state = "built" if wh.built else "cached"
        print(f"{wh.path}  ({state}, {wh.files} wheels, {wh.bytes / 2**20:.0f} MiB, {wh.seconds:.1f}s)")
    return 0
