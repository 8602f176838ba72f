"""`shardstack data prepare`: text into token shards for training."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="prepare token shards")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = data_sub.add_parser("prepare", help="tokenise text into uint16/uint32 shards")
    prep.add_argument("input", nargs="?", default=None,
                      help="a text file or a directory of *.txt (default: the corpus shipped with shardstack)")
    prep.add_argument("--out", required=True, help="output directory (meta.json + tokens-*.bin)")
    prep.add_argument("--tokenizer", default="bytes", metavar="DIR|bytes",
                      help="bytes (default: token = byte) or a directory with tokenizer.json (`shardstack tokenizer "
                           "train`, or a Hugging Face model's)")
    prep.add_argument("--workers", type=int, default=None, help="encoding processes (default: one per CPU)")
    prep.add_argument("--json", action="store_true", help="print the result (meta.json's fields) as JSON on stdout")
    prep.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
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
