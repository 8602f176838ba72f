"""All-reduce check across the train nodes: `torchrun … -m shardstack.node.allreduce [--mb 16] [--iters 5]`.

Every rank contributes tensors filled with its rank + 1, so the reduced sum is checkable exactly
(world·(world+1)/2); the timing gives bus bandwidth as nccl-tests define it: busbw = algbw · 2(n−1)/n.
Rank 0 prints one JSON line. NCCL on GPUs, gloo on CPU — the same choice the trainer makes (shardstack.accel):
a node with NVIDIA GPUs that cannot run CUDA exits 2 with the cause instead of measuring gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from shardstack.errors import ShardstackError


def measure(mb: float, iters: int) -> dict:
    import torch
    import torch.distributed as dist

    from shardstack.accel import decide_device, probe

    choice = decide_device(probe(), "auto", setting="the all-reduce check's device")
    use_cuda, backend = choice.type == "cuda", choice.backend
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    numel = max(1, int(mb * 2**20) // 4)
    x = torch.empty(numel, dtype=torch.float32, device=device)
    expected = world * (world + 1) / 2
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())

    def once() -> float:
        x.fill_(rank + 1)
        if use_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_reduce(x)
        if use_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    once()  # warm-up: connection setup is not bandwidth
    times = [once() for _ in range(iters)]
    correct = bool(torch.all(x == expected).item())
    ok = torch.tensor([1 if correct else 0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    best = min(times)
    size = numel * 4
    algbw = size / best
    return {
        "backend": backend, "world_size": world, "nodes": len(set(hosts)), "hosts": sorted(set(hosts)),
        "bytes": size, "iters": iters, "seconds_min": best, "seconds_mean": sum(times) / len(times),
        "algbw_gbps": algbw * 8 / 1e9, "busbw_gbps": algbw * 8 / 1e9 * (2 * (world - 1) / world if world > 1 else 1),
        "correct": bool(ok.item()), "rank": rank,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardstack.node.allreduce", description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=16.0, help="tensor size in MiB (default 16)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    args = p.parse_args(argv)
    try:
        result = measure(args.mb, args.iters)
    except ShardstackError as exc:
        print(f"shardstack.node.allreduce: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    if result["rank"] == 0:
        print(json.dumps(result), flush=True)
    code = 0 if result["correct"] else 1
    from shardstack.train.dist import leave_worker

    leave_worker(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
