"""`shardstack model put DIR`: a Hugging Face model directory of this machine onto the cluster's shared storage
(<shared>/pretrained/<name>), where every node sees it (a job's model.init_from, a tokenizer), checked file by file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardstack.cli.inventory import add_inventory_arg
from shardstack.cli.output import console


def register(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="put a Hugging Face model directory on the cluster's shared storage")
    actions = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    put = actions.add_parser("put", help="copy DIR to <shared>/pretrained/NAME through the first train node and "
                                         "check every file's sha256 there")
    put.add_argument("dir", type=Path, help="a Hugging Face model directory (config.json, weights, tokenizer)")
    put.add_argument("--name", default=None, help="directory name on shared storage (default: DIR's name)")
    add_inventory_arg(put)
    put.add_argument("--json", action="store_true", help="print {path, files, bytes} as JSON on stdout")
    put.set_defaults(func=_put)


def _put(args: argparse.Namespace) -> int:
    from shardstack.ops import cluster

    done = cluster.put_model(args.inventory, args.dir, args.name)
    if args.json:
        print(json.dumps({"path": done.path, "files": done.files, "bytes": done.bytes, "extra": done.extra},
                         indent=2))
        return 0
    print(done.path)
    console.print(f"{done.files} file(s), {done.bytes / 2**20:.1f} MiB, sha256 checked on the cluster; use it as "
                  f"model.init_from: {done.path}", highlight=False)
    if done.extra:
        console.print(f"also there (from an earlier copy): {', '.join(done.extra)}", highlight=False)
    return 0
