"""`shardstack serve rollout`: upgrade the inference nodes one at a time behind the load balancer.

Adds a `rollout` action to the serving helper's `shardstack serve` parser (whose own use, `serve --model DIR`,
stays as it is) and runs playbooks/rolling_upgrade.yml through ansible-runner.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.runner import RunResult, run_playbook


def rollout(inventory: Path, *, limit: str | None = None, extravars: dict[str, Any] | None = None,
            on_event=None) -> RunResult:
    return run_playbook("playbooks/rolling_upgrade.yml", inventory, limit=limit, extravars=extravars,
                        on_event=on_event)


def register(sub: argparse._SubParsersAction) -> None:
    from shardstack.ops.cli import DEFAULT_INVENTORY

    serve = sub.choices.get("serve") or sub.add_parser("serve", help="inference service")
    # `serve rollout` needs no --model: make it optional on the parent and check it where the server starts.
    model = next((a for a in serve._actions if a.dest == "model"), None)
    if model is not None and model.required:
        model.required = False
        serve_func = serve.get_default("func")

        def serve_with_model(args: argparse.Namespace) -> int:
            if args.model is None:
                raise ShardstackError("`shardstack serve` needs --model DIR (or the action `rollout`)")
            return serve_func(args)

        serve.set_defaults(func=serve_with_model)
    actions = serve.add_subparsers(dest="serve_command", metavar="ACTION")
    p = actions.add_parser("rollout", help="upgrade the inference nodes one at a time (drain, upgrade, healthy, next)")
    p.add_argument("-i", "--inventory", type=Path, default=DEFAULT_INVENTORY,
                   help=f"inventory (default {DEFAULT_INVENTORY})")
    p.add_argument("--limit", help="only these inference nodes")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=_rollout)


def _rollout(args: argparse.Namespace) -> int:
    from shardstack.ops.cli import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, console, summary_table

    result = rollout(args.inventory, limit=args.limit, on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        console.print(summary_table(result, "serve rollout"))
    return EXIT_OK if result.success else EXIT_FAILED_HOSTS
