"""`shardstack data prepare`: text into token shards for training."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="prepare token shards")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = data_sub.add_parser("prepare", help="tokenise text into uint16 shards (byte-level tokenizer)")
    prep.add_argument("input", nargs="?", default=None,
                      help="a text file or a directory of *.txt (default: the corpus shipped with shardstack)")
    prep.add_argument("--out", required=True, help="output directory (meta.json + tokens-*.bin)")
    prep.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from shardstack.train.data import prepare

    meta = prepare(args.input, args.out)
    print(f"{meta['total_tokens']} tokens in {len(meta['shards'])} shard(s) → {args.out} (tokenizer: bytes)")
    return 0
