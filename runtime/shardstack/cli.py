"""The `shardstack` command. Each sub-command lives in its own module and registers itself here.

A module in `_COMMAND_MODULES` exposes `register(subparsers)`, which adds its parser(s) and sets
`func(args) -> int` as the handler. Imports are lazy per module so `shardstack lab …` does not pay for torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from shardstack import __version__
from shardstack.errors import ShardstackError

# (sub-command name, module that registers it, one-line help)
_COMMAND_MODULES: list[tuple[str, str, str]] = [
    ("lab", "shardstack.lab.cli", "local lab of systemd-nspawn nodes"),
    ("deploy", "shardstack.ops.cli", "run site.yml (or parts of it) through ansible-runner"),
    ("data", "shardstack.train_cli", "prepare token shards for training"),
    ("train", "shardstack.train_cli", "run a sharded training job (ZeRO stage 0-3)"),
    ("train", "shardstack.ops.train", "training jobs on the cluster: submit, status, stop, logs"),
    ("estimate", "shardstack.train_cli", "predict per-rank training memory for each ZeRO stage"),
    ("checkpoint", "shardstack.checkpoint_cli", "list and verify training checkpoints"),
    ("export", "shardstack.checkpoint_cli", "consolidate a checkpoint into safetensors for serving"),
    ("serve", "shardstack.serve.cli", "OpenAI-compatible inference service for an exported model"),
    ("serve", "shardstack.ops.serve", "serve rollout: upgrade the inference nodes one at a time"),
    ("check", "shardstack.ops.cli", "preflight: reach every node, check the inventory"),
    ("validate", "shardstack.ops.cli", "validate a deployed cluster: GPUs, NCCL, all-reduce, storage, inference"),
    ("wheelhouse", "shardstack.ops.wheelhouse", "build the offline wheelhouse the nodes install shardstack from"),
    ("demo", "shardstack.ops.cli", "the lab end to end: lab up, site.yml, summary"),
]


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardstack", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"shardstack {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    seen: set[str] = set()
    for name, module, help_ in _COMMAND_MODULES:
        if module in seen:
            continue
        if wanted is None or wanted not in {n for n, m, _ in _COMMAND_MODULES if m == module}:
            if name not in sub.choices:  # several modules may add to one command (e.g. train)
                sub.add_parser(name, help=help_, add_help=False)
            continue
        seen.add(module)
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ShardstackError as exc:
        print(f"shardstack: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("shardstack: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
