"""Training tokens/s per ZeRO stage on CPU (gloo), each as a ratio to stage 0 measured in the same run.

    python bench/throughput.py --world-size 2 [--model small --steps 6 --micro-batch 4 --accumulation 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _launch import machine, relaunch, under_torchrun


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per stage, interleaved (after 2 warm-up rounds)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    if not under_torchrun():
        return relaunch(args.world_size, sys.argv[1:])

    from shardstack.model.gpt import GPT, GPTConfig
    from shardstack.model.shapes import GPT_PRESETS as PRESETS
    from shardstack.train.config import EngineConfig, OptimizerConfig
    from shardstack.train.dist import init_distributed, shutdown
    from shardstack.train.engine import build_engine

    info = init_distributed("cpu")
    mcfg = GPTConfig(**PRESETS[args.model])
    tokens_per_step = args.micro_batch * args.accumulation * mcfg.seq_len * info.world_size
    if info.is_main:
        print(f"# throughput: model {args.model}, world size {info.world_size}, micro {args.micro_batch} × accum "
              f"{args.accumulation}, seq {mcfg.seq_len}, {args.precision}; {machine()}", flush=True)
    # All four engines live side by side and the timed steps interleave (stage 0, 1, 2, 3, 0, 1, …), each stage's
    # figure being the median of its steps: background load drifting during the run then hits every stage alike.
    engines = {}
    for stage in range(4):
        torch.manual_seed(0)
        engines[stage] = build_engine(GPT(mcfg), EngineConfig(stage=stage, precision=args.precision),
                                      OptimizerConfig(), info)
    g = torch.Generator().manual_seed(info.rank)
    mbs = [(x, x) for x in torch.randint(0, mcfg.vocab_size, (args.accumulation, args.micro_batch, mcfg.seq_len),
                                         generator=g)]
    times: dict[int, list[float]] = {s: [] for s in engines}
    for i in range(2 + args.steps):
        for stage, engine in engines.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engine.forward_backward(mbs)  # ends with an all-reduce of the loss: the ranks leave together
            engine.step()
            if i >= 2:
                times[stage].append(time.perf_counter() - t0)
    base = None
    for stage, ts in times.items():
        dt = statistics.median(ts)
        tps = tokens_per_step / dt
        base = base or tps
        if info.is_main:
            print(json.dumps({"stage": stage, "world_size": info.world_size, "tokens_per_second": round(tps, 1),
                              "step_seconds": round(dt, 4), "ratio_to_stage0": round(tps / base, 3)}), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
