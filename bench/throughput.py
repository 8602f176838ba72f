"""Training tokens/s per ZeRO stage on CPU (gloo), each as a ratio to stage 0 measured in the same run.

    python bench/throughput.py --world-size 2 [--model small --steps 6 --micro-batch 4 --accumulation 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _launch import machine, relaunch, under_torchrun


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per stage (after 2 warm-up steps)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    if not under_torchrun():
        return relaunch(args.world_size, sys.argv[1:])

    from shardstack.config import EngineConfig, OptimizerConfig
    from shardstack.dist import init_distributed, shutdown
    from shardstack.engine import build_engine
    from shardstack.model import GPT, PRESETS, GPTConfig

    info = init_distributed("cpu")
    mcfg = GPTConfig(**PRESETS[args.model])
    tokens_per_step = args.micro_batch * args.accumulation * mcfg.seq_len * info.world_size
    if info.is_main:
        print(f"# throughput: model {args.model}, world size {info.world_size}, micro {args.micro_batch} × accum "
              f"{args.accumulation}, seq {mcfg.seq_len}, {args.precision}; {machine()}", flush=True)
    base = None
    g = torch.Generator().manual_seed(info.rank)
    for stage in range(4):
        torch.manual_seed(0)
        engine = build_engine(GPT(mcfg), EngineConfig(stage=stage, precision=args.precision), OptimizerConfig(), info)
        mbs = [(x, x) for x in torch.randint(0, mcfg.vocab_size, (args.accumulation, args.micro_batch, mcfg.seq_len),
                                             generator=g)]
        for _ in range(2):
            engine.forward_backward(mbs)
            engine.step()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.forward_backward(mbs)  # returns the loss after an all-reduce: the ranks stay in step
            engine.step()
        dt = time.perf_counter() - t0
        tps = tokens_per_step * args.steps / dt
        base = base or tps
        if info.is_main:
            print(json.dumps({"stage": stage, "world_size": info.world_size, "tokens_per_second": round(tps, 1),
                              "step_seconds": round(dt / args.steps, 4), "ratio_to_stage0": round(tps / base, 3)}),
                  flush=True)
        del engine
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
