"""All-reduce check across the train nodes: `torchrun --nproc-per-node=<GPUs or 1> … -m shardstack.node.allreduce
[--max-mb N] [--busbw-min auto|GBIT]`.

A sweep from 1 MiB doubling to the largest size (default: 8 GiB on GPUs, nccl-tests' range; 16 MiB on CPU, where
gloo over the lab's virtual links needs seconds per GiB). Every rank contributes tensors filled with its rank + 1, so
each size's sum is checkable exactly (world·(world+1)/2); the timing gives bus bandwidth as nccl-tests define it:
busbw = algbw · 2(n−1)/n. The floor applies to the largest size, where latency no longer hides bandwidth. Rank 0
prints one JSON line. NCCL on GPUs, gloo on CPU — the same choice the trainer makes (shardstack.accel): a node with
NVIDIA GPUs that cannot run CUDA exits 2 with the cause instead of measuring gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from shardstack.errors import ShardstackError

MAX_MB = {"nccl": 8192.0, "gloo": 16.0}
# `auto` floors, Gbit/s of bus bandwidth at the largest size. NCCL: NVLink inside a node and any InfiniBand or RoCE
# rail of 100 Gbit/s and up stay well above; NCCL fallen back to TCP sockets on a management link does not. gloo: a
# fifth of the slowest the lab's virtual links measure (5.6 Gbit/s at 16 MiB), so a real CPU cluster's network passes
# and a link that drops to 100 Mbit/s or a node swapping does not.
BUSBW_MIN_GBIT = {"nccl": 100.0, "gloo": 1.0}


def sizes(max_mb: float) -> list[int]:
    """Bytes per size: 1 MiB doubling up to max_mb (always including max_mb itself), whole float32 elements."""
    top = max(4, int(max_mb * 2**20) // 4 * 4)
    out, size = [], min(2**20, top)
    while size < top:
        out.append(size)
        size *= 2
    return [*out, top]


def busbw_floor(setting: str) -> float | None:
    """The --busbw-min setting: None for `auto` (per backend), else Gbit/s ≥ 0."""
    if setting == "auto":
        return None
    try:
        value = float(setting)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{setting!r}: want `auto` or Gbit/s ≥ 0 (0: no floor)")
    return value


def measure(max_mb: float | None, iters: int, busbw_min: float | None) -> dict:
    import torch
    import torch.distributed as dist

    from shardstack.accel import decide_device, probe

    choice = decide_device(probe(), "auto", setting="the all-reduce check's device")
    use_cuda, backend = choice.type == "cuda", choice.backend
    floor = BUSBW_MIN_GBIT[backend] if busbw_min is None else busbw_min
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    expected = world * (world + 1) / 2
    factor = 2 * (world - 1) / world if world > 1 else 1.0
    sweep = [_one_size(torch, dist, size, iters, rank, expected, factor, device, use_cuda)
             for size in sizes(max_mb if max_mb else MAX_MB[backend])]
    correct = all(row["correct"] for row in sweep)
    ok = torch.tensor([1 if correct else 0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    top = sweep[-1]
    return {
        "backend": backend, "world_size": world, "nodes": len(set(hosts)), "hosts": sorted(set(hosts)),
        "iters": iters, "sweep": sweep,
        # The largest size, the one the floor and the one-line summaries speak of.
        **{k: top[k] for k in ("bytes", "seconds_min", "seconds_mean", "algbw_gbps", "busbw_gbps")},
        "busbw_min_gbps": floor, "below_floor": top["busbw_gbps"] < floor,
        "correct": bool(ok.item()), "rank": rank,
    }


def _one_size(torch, dist, size: int, iters: int, rank: int, expected: float, factor: float, device,
              use_cuda: bool) -> dict:
    x = torch.empty(size // 4, dtype=torch.float32, device=device)

    def once() -> float:
        x.fill_(rank + 1)
        if use_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_reduce(x)
        if use_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    once()  # warm-up: connection setup and NCCL's channels for this size are not bandwidth
    times = [once() for _ in range(iters)]
    correct = bool(torch.all(x == expected).item())
    best = min(times)
    algbw = size / best * 8 / 1e9
    return {"bytes": size, "seconds_min": best, "seconds_mean": sum(times) / len(times), "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor, "correct": correct}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardstack.node.allreduce", description=__doc__.splitlines()[0])
    p.add_argument("--max-mb", type=float, default=None,
                   help="largest size of the sweep, MiB (default 8192 on NCCL, 16 on gloo)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per size (default 5)")
    p.add_argument("--busbw-min", default="auto",
                   help="bus bandwidth floor at the largest size, Gbit/s; auto: 100 on NCCL, 1 on gloo; 0: none")
    args = p.parse_args(argv)
    if (args.max_mb is not None and args.max_mb <= 0) or args.iters < 1:
        p.error("--max-mb and --iters must be positive")
    try:
        floor = busbw_floor(args.busbw_min)
    except ValueError as exc:
        p.error(f"--busbw-min {exc}")
    try:
        result = measure(args.max_mb, args.iters, floor)
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
