"""The `shardstack` command: one module per command group under shardstack.cli, each with
`register(subparsers)`, which adds its parser(s) and sets `func(args) -> int` as the handler. Only the group of
the command being run is imported, so `shardstack lab …` does not pay for torch. Nothing outside this package
imports it: the library (model, train, serve, ops, lab) stays usable without the CLI.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from shardstack import __version__
from shardstack.cli.inventory import resolve_inventory
from shardstack.errors import ShardstackError

# (sub-command name, module that registers it, one-line help)
_COMMAND_MODULES: list[tuple[str, str, str]] = [
    ("lab", "shardstack.cli.lab", "local lab of systemd-nspawn nodes"),
    ("deploy", "shardstack.cli.deploy", "run site.yml (or parts of it) through ansible-runner"),
    ("check", "shardstack.cli.deploy", "preflight: reach every node, check the inventory"),
    ("validate", "shardstack.cli.deploy", "validate a deployed cluster: GPUs, NCCL, all-reduce, storage, inference"),
    ("data", "shardstack.cli.data", "prepare token shards for training; put data on the cluster"),
    ("model", "shardstack.cli.model", "put a Hugging Face model directory on the cluster's shared storage"),
    ("tokenizer", "shardstack.cli.tokenizer", "train a byte-level BPE tokenizer"),
    ("pretrained", "shardstack.cli.pretrained", "build the demo's small pretrained Llama here (cached)"),
    ("train", "shardstack.cli.train", "training: run a job here, or submit/status/stop/logs on the cluster"),
    ("estimate", "shardstack.cli.estimate", "predict per-rank training memory for each ZeRO stage"),
    ("checkpoint", "shardstack.cli.checkpoint", "list and verify training checkpoints"),
    ("export", "shardstack.cli.checkpoint", "consolidate a checkpoint into safetensors for serving"),
    ("serve", "shardstack.cli.serve", "OpenAI-compatible inference service (serve rollout: on the cluster)"),
    ("node", "shardstack.cli.node", "cordon, drain and uncordon nodes (HAProxy runtime API, train job exclusion)"),
    ("status", "shardstack.cli.status", "the cluster in one table: nodes, failed units, training, backends, alerts"),
    ("artifacts", "shardstack.cli.artifacts", "training artefacts on shared storage: prune old ones"),
    ("logs", "shardstack.cli.logs", "search every node's journal in the central log store"),
    ("wheelhouse", "shardstack.cli.wheelhouse", "build the offline wheelhouse the nodes install shardstack from"),
    ("acceptance", "shardstack.cli.acceptance", "the acceptance on a deployed cluster: loss ZeRO off/on, scaling, "
     "bandwidth, GPU use, kill and resume; a Markdown report with plots"),
    ("demo", "shardstack.cli.demo", "the lab end to end: lab up, site.yml, train, export, serve, validate"),
]


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardstack", description="GPU training and inference clusters: provisioning (Ansible), the lab, a "
        "sharded training runtime and an inference service")
    parser.add_argument("--version", action="version", version=f"shardstack {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    module = next((m for n, m, _ in _COMMAND_MODULES if n == wanted), None)
    if module:
        importlib.import_module(module).register(sub)
    for name, _module, help_ in _COMMAND_MODULES:  # the rest only for --help's list
        if name not in sub.choices:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


_OWN_PROCESS = False


def owns_process() -> bool:
    """True in the `shardstack` program (console script, `python -m shardstack`), false when main() is called
    in-process."""
    return _OWN_PROCESS


def entry() -> None:
    global _OWN_PROCESS
    _OWN_PROCESS = True
    sys.exit(main())


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
        resolve_inventory(args)
        return int(args.func(args) or 0)
    except ShardstackError as exc:
        print(f"shardstack: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("shardstack: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    entry()
