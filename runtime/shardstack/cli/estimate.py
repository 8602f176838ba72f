"""`shardstack estimate`: per-rank memory of a job at each ZeRO stage, before it runs (formulas: docs/runtime.md)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from shardstack.errors import ShardstackError


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="predict per-rank memory for each ZeRO stage")
    p.add_argument("--config", required=True, help="job.yaml")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: WORLD_SIZE or 1); with engine.tensor_parallel K, K × the data-parallel ranks")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], action="append", help="only these stages")
    p.add_argument("--json", action="store_true", help="one JSON object per stage")
    p.set_defaults(func=_cmd_estimate)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from shardstack.train.config import load_config
    from shardstack.train.memory.estimate import estimate

    cfg = load_config(args.config)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    if world < 1:
        raise ShardstackError("--world-size must be ≥ 1")
    results = estimate(cfg, world, stages=args.stage)
    if args.json:
        for r in results:
            print(json.dumps(asdict(r)))
        return 0
    first = results[0]
    tp = cfg.engine.tensor_parallel
    mesh = f" = {world // tp} (dp) × {tp} (tp)" if tp > 1 else ""
    print(f"per-rank memory, world size {world}{mesh}, precision {first.precision}, offload {cfg.engine.offload}, "
          f"micro-batch {first.micro_batch}, activation checkpointing {first.activation_checkpointing} "
          f"({first.checkpointed_blocks} blocks recomputed), AdamW {first.optimizer_impl} (formulas: docs/runtime.md)")
    cols = ("params", "grads", "optimizer", "= state", "working", "activations", "opt. temp", "peak", "first step",
            "init")
    print(f"{'stage':>5} " + " ".join(f"{c:>11}" for c in cols))
    for r in results:
        vals = (r.params, r.grads, r.optimizer, r.total, r.working_params + r.accumulation_grads, r.activations,
                r.optimizer_temporaries, r.peak, r.first_step_peak, r.init_peak)
        print(f"{r.stage:>5} " + " ".join(f"{_fmt(v):>11}" for v in vals))
    return 0
