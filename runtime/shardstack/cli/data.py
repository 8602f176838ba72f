"""`shardstack data prepare`: text into token shards for training, here or (--cluster) on the first train node into
<shared>/data/<name>; `shardstack data put`: a corpus or prepared shards of this machine onto shared storage."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.errors import ShardstackError


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="prepare token shards; put data on the cluster")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = data_sub.add_parser("prepare", help="tokenise text into uint16/uint32 shards, here or (--cluster) on the "
                                               "cluster's shared storage")
    prep.add_argument("input", nargs="?", default=None,
                      help="a text file or a directory of *.txt (default: the corpus shipped with shardstack); with "
                           "--cluster required: a path under the shared directory, or a file or directory here (put "
                           "first to <shared>/data/NAME-text)")
    prep.add_argument("--out", default=None, help="output directory (meta.json + tokens-*.bin); required here")
    prep.add_argument("--tokenizer", default="bytes", metavar="DIR|bytes",
                      help="bytes (default: token = byte) or a directory with tokenizer.json (`shardstack tokenizer "
                           "train`, or a Hugging Face model's); with --cluster a directory on shared storage (e.g. "
                           "one `shardstack model put` placed)")
    prep.add_argument("--workers", type=int, default=None, help="encoding processes (default: one per CPU)")
    prep.add_argument("--cluster", action="store_true",
                      help="run on the first train node as the job account, writing <shared>/data/OUT_NAME")
    prep.add_argument("--out-name", default=None, metavar="NAME",
                      help="--cluster: the data set's name under <shared>/data (a job's data.path)")
    # -i only means something with --cluster: resolved lazily there, so a local prepare needs no inventory.
    prep.add_argument("-i", "--inventory", type=Path, default=None,
                      help="--cluster: inventory file or directory (default: $SHARDSTACK_INVENTORY when set, else "
                           "inventory/lab/hosts.yml when it exists)")
    prep.add_argument("--json", action="store_true", help="print the result (meta.json's fields) as JSON on stdout")
    prep.set_defaults(func=_prepare)

    put = data_sub.add_parser("put", help="copy a corpus (a text file, a directory) or prepared token shards to "
                                          "<shared>/data/NAME through the first train node, sha256 checked there")
    put.add_argument("src", type=Path, help="a file or directory here")
    put.add_argument("--name", default=None, help="name under <shared>/data (default: SRC's name, a file's stem)")
    add_inventory_arg(put)
    put.add_argument("--json", action="store_true", help="print {path, files, bytes} as JSON on stdout")
    put.set_defaults(func=_put)


def _prepare(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        raise ShardstackError("--workers must be ≥ 1")
    if args.cluster:
        return _prepare_on_cluster(args)
    if args.out is None:
        raise ShardstackError("data prepare needs --out DIR (or --cluster --out-name NAME)")
    if args.out_name is not None or args.inventory is not None:
        raise ShardstackError("--out-name and -i are options of --cluster")

    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from shardstack.cli.output import console
    from shardstack.train.data import prepare

    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=args.json) as bar:
        task = bar.add_task("tokenising", total=None)
        meta = prepare(args.input, args.out, tokenizer=args.tokenizer, workers=args.workers,
                       progress=lambda done, total: bar.update(task, completed=done, total=total))
    if args.json:
        print(json.dumps({"out": str(args.out), **meta}, indent=2))
        return 0
    print(f"{meta['total_tokens']} tokens in {len(meta['shards'])} shard(s) of {meta['dtype']} → {args.out} "
          f"(tokenizer: {meta['tokenizer']}, vocabulary {meta['vocab_size']})")
    return 0


def _prepare_on_cluster(args: argparse.Namespace) -> int:
    if args.out is not None:
        raise ShardstackError("--cluster writes <shared>/data/NAME: pass --out-name NAME, not --out")
    if args.out_name is None:
        raise ShardstackError("data prepare --cluster needs --out-name NAME (the data set's name under <shared>/data)")
    if args.input is None:  # never the shipped demo corpus by omission on a cluster
        raise ShardstackError("data prepare --cluster needs INPUT: a path under the shared directory, or a file or "
                              "directory here")
    from shardstack.ops import storage

    done = storage.prepare_on_cluster(load_cluster(args), args.input, args.out_name, tokenizer=args.tokenizer,
                                      workers=args.workers)
    if args.json:
        print(json.dumps({"host": done.host, "input": done.source, **done.meta, "out": done.out,
                          "copied": None if done.copied is None else {"path": done.copied.path,
                                                                      "files": done.copied.files,
                                                                      "bytes": done.copied.bytes}}, indent=2))
        return 0
    meta = done.meta
    print(f"{meta.get('total_tokens')} tokens in {len(meta.get('shards', []))} shard(s) of {meta.get('dtype')} → "
          f"{done.out} on {done.host} (tokenizer: {meta.get('tokenizer')}); use it as data.path: {done.out}")
    return 0


def _put(args: argparse.Namespace) -> int:
    from shardstack.cli.output import report_copy
    from shardstack.ops import storage

    report_copy(storage.put_data(load_cluster(args), args.src, args.name), as_json=args.json)
    return 0
