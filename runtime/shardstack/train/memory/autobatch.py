"""`batch.micro_batch: auto`: the largest micro-batch that fits, keeping the global batch via accumulation.

Candidates are the divisors of the per-rank batch, largest first. On GPU each candidate runs one real
forward/backward; a CUDA out-of-memory backs off to the next, and the ranks agree on the outcome with an
all-reduce(MAX) of the failure flag, so they all pick the same size. (Ranks are assumed to have equal GPUs: an OOM
on one rank only, in the middle of a collective, would leave the others waiting.) On CPU there is nothing to catch
— the kernel's OOM killer does not raise — so the estimator's peak must fit a memory budget instead.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from shardstack.errors import ShardstackError
from shardstack.train.config import JobConfig
from shardstack.train.engine import Engine
from shardstack.train.memory.estimate import estimate_stage

log = logging.getLogger("shardstack.autobatch")


def divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def cpu_budget_bytes(cfg: JobConfig) -> int:
    """The configured budget, else half of MemAvailable shared by the ranks on this node."""
    if cfg.batch.cpu_memory_budget_mb:
        return cfg.batch.cpu_memory_budget_mb * 2**20
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return avail // 2 // local_world


def pick_cpu(cfg: JobConfig, engine: Engine, per_rank: int, seq_len: int, budget: int) -> int:
    for mb in divisors_desc(per_rank):
        est = estimate_stage(engine.module, engine.cfg, engine.stage, engine.dist.world_size, engine.dist.rank,
                             weight_decay=cfg.optimizer.weight_decay, micro_batch=mb, seq_len=seq_len,
                             accumulation=per_rank // mb, optimizer_impl=cfg.optimizer.impl)
        if est.peak <= budget:
            return mb
    raise_no_fit(budget)
    raise AssertionError


def raise_no_fit(budget: int) -> None:
    raise ShardstackError(f"not even micro_batch 1 fits the memory budget ({budget / 2**20:.0f} MiB per rank)",
                          hint="raise batch.cpu_memory_budget_mb, use a higher engine.stage, or a smaller model")


def pick_gpu(engine: Engine, per_rank: int, seq_len: int, vocab: int) -> int:
    dev = engine.dist.device
    for mb in divisors_desc(per_rank):
        failed = torch.zeros((), device=dev)
        try:
            x = torch.randint(0, vocab, (mb, seq_len), device=dev)
            engine.forward_backward([(x, x)])
        except torch.OutOfMemoryError:
            failed.fill_(1)
        engine.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if engine.dist.world_size > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not failed:
            return mb
        log.info("micro-batch %d does not fit on some rank; backing off", mb)
    raise_no_fit(torch.cuda.get_device_properties(dev).total_memory)
    raise AssertionError


def find_micro_batch(cfg: JobConfig, engine: Engine, seq_len: int, vocab: int) -> int:
    per_rank = cfg.batch.global_batch // engine.dist.world_size
    if engine.dist.device.type == "cuda":
        mb = pick_gpu(engine, per_rank, seq_len, vocab)
        how = "largest that ran without CUDA OOM"
    else:
        budget = cpu_budget_bytes(cfg)
        mb = pick_cpu(cfg, engine, per_rank, seq_len, budget)
        how = f"largest whose estimated peak fits {budget / 2**20:.0f} MiB per rank"
    log.info("micro_batch auto: %d (%s), accumulation %d", mb, how, per_rank // mb)
    return mb
