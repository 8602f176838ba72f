"""CLI: `shardstack data prepare`, `shardstack train run`, `shardstack estimate`."""

from __future__ import annotations

import argparse
import logging

from shardstack.errors import ShardstackError

log = logging.getLogger("shardstack.train")


def register(sub: argparse._SubParsersAction) -> None:
    from shardstack import estimate

    data = sub.add_parser("data", help="prepare token shards")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = data_sub.add_parser("prepare", help="tokenise text into uint16 shards (byte-level tokenizer)")
    prep.add_argument("input", nargs="?", default=None,
                      help="a text file or a directory of *.txt (default: the corpus shipped with shardstack)")
    prep.add_argument("--out", required=True, help="output directory (meta.json + tokens-*.bin)")
    prep.set_defaults(func=_cmd_prepare)

    # `train` is shared with shardstack.ops.train (submit/status/stop/logs): join whichever parser came first.
    train = sub.choices.get("train") or sub.add_parser("train", help="run a training job")
    existing = [a for a in train._actions if isinstance(a, argparse._SubParsersAction)]
    train_sub = existing[0] if existing else train.add_subparsers(dest="train_command", metavar="ACTION",
                                                                  required=True)
    run = train_sub.add_parser("run", help="train from a job.yaml (alone, or one process per rank under torchrun)")
    run.add_argument("--config", required=True, help="job.yaml")
    run.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (short runs)")
    run.set_defaults(func=_cmd_train)

    estimate.register(sub)


def _cmd_prepare(args: argparse.Namespace) -> int:
    from shardstack.data import prepare

    meta = prepare(args.input, args.out)
    print(f"{meta['total_tokens']} tokens in {len(meta['shards'])} shard(s) → {args.out} (tokenizer: bytes)")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from shardstack import dist
    from shardstack.config import load_config
    from shardstack.trainer import train

    if args.max_steps is not None and args.max_steps < 1:
        raise ShardstackError("--max-steps must be ≥ 1")
    cfg = load_config(args.config)
    try:
        result = train(cfg, args.max_steps)
    finally:
        dist.shutdown()
    log.info("done: step %d, last loss %.4f", result.final_step, result.losses[-1] if result.losses else float("nan"))
    dist.leave_worker(0)
    return 0
