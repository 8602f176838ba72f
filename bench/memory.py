"""Per-rank bytes of parameters + gradients + optimizer states, measured from the local shards after one step,
against the estimator, for every ZeRO stage. One JSON line per stage.

    python bench/memory.py --world-size 2 [--model small]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from _launch import machine, relaunch, under_torchrun


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--model", default="small", help="a preset of shardstack.model.gpt.PRESETS")
    ap.add_argument("--micro-batch", type=int, default=2)
    args = ap.parse_args()
    if not under_torchrun():
        return relaunch(args.world_size, sys.argv[1:])

    from shardstack.model.gpt import GPT, PRESETS, GPTConfig
    from shardstack.train.config import EngineConfig, OptimizerConfig
    from shardstack.train.dist import init_distributed, shutdown
    from shardstack.train.engine import build_engine
    from shardstack.train.memory.estimate import estimate_stage

    info = init_distributed("cpu")
    mcfg = GPTConfig(**PRESETS[args.model])
    if info.is_main:
        print(f"# memory: model {args.model}, world size {info.world_size}, fp32 AdamW; {machine()}", flush=True)
    for stage in range(4):
        torch.manual_seed(0)
        engine = build_engine(GPT(mcfg), EngineConfig(stage=stage), OptimizerConfig(), info)
        x = torch.randint(0, mcfg.vocab_size, (args.micro_batch, mcfg.seq_len))
        engine.forward_backward([(x, x)])
        engine.step(measure=True)
        measured = engine.last_memory["total"]
        est = estimate_stage(engine.module, engine.cfg, stage, info.world_size, info.rank, weight_decay=0.1,
                             micro_batch=args.micro_batch, seq_len=mcfg.seq_len).total
        rows = [None] * info.world_size
        dist.all_gather_object(rows, (measured, est))
        if info.is_main:
            worst = max(rows, key=lambda r: r[0])  # the rank holding the most
            print(json.dumps({
                "stage": stage, "world_size": info.world_size, "params": sum(p.numel() for p in GPT(mcfg).parameters()),
                "measured_bytes_per_rank": worst[0], "estimated_bytes_per_rank": worst[1],
                "ratio": round(worst[0] / worst[1], 4),
                "per_rank_measured": [r[0] for r in rows],
            }), flush=True)
        del engine
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
