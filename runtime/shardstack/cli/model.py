"""`shardstack model put DIR`: a Hugging Face model directory of this machine onto the cluster's shared storage
(<shared>/pretrained/<name>), where every node sees it (a job's model.init_from, a tokenizer), checked file by file."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import report_copy


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
    from shardstack.ops import storage

    report_copy(storage.put_model(load_cluster(args), args.dir, args.name), as_json=args.json, use_as="model.init_from")
    return 0
