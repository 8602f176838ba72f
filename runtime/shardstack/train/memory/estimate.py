"""Per-rank memory estimator: what each ZeRO stage keeps of parameters, gradients and optimizer states, plus a
working-set and activation estimate. The formulas (docs/runtime.md, "Memory estimator"):

  E = Σ elements of the parameters (tied weights once), T = number of parameter tensors, N = world size,
  shard_r(t) = elements of tensor t on rank r when split on dim 0 as FSDP2 does (torch.chunk: ⌈d0/N⌉ rows per rank)

  stage 0   params 4E            grads 4E             AdamW 8E + 4T (exp_avg, exp_avg_sq fp32; a step scalar each)
  stage 1   params 4E            grads 4E             AdamW over the tensors ZeroRedundancyOptimizer assigns to r
                                                       (its greedy largest-first partition, reproduced here)
  stage 2/3 params 4·Σ shard_r   grads 4·Σ shard_r    AdamW 8·Σ shard_r + 4T

Master params, gradients and states stay fp32 under every precision (bf16/fp16 only change the compute copies).
Beyond that persistent state, a step also needs the working parameters: stage 2 holds every block unsharded in
the compute dtype from forward to backward, stage 3 only (1 + prefetch) blocks plus the root; with
accumulation_sync "last" FSDP2 also holds unsharded fp32 gradients on non-final micro-batches. Activations per
micro-batch are approximated as L·b·s·d·(34·e/2) for the blocks plus b·s·V·(e + 8) for logits and the loss
(e = bytes of the compute dtype; Korthikanti et al. 2022 without the attention matrix, which SDPA never stores).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from shardstack.model.dtypes import to_dtype
from shardstack.model.factory import build_model
from shardstack.train.config import EngineConfig, JobConfig
from shardstack.train.optim import optimizer_param_groups
from shardstack.train.parallelize import shard_units

FP32 = 4


@dataclass
class StageEstimate:
    stage: int
    world_size: int
    rank: int
    params: int
    grads: int
    optimizer: int
    total: int  # params + grads + optimizer: what the local shards hold between steps
    working_params: int  # unsharded compute-dtype parameters resident during forward/backward
    accumulation_grads: int  # extra unsharded gradients held on non-final micro-batches ("last" sync, FSDP)
    activations: int  # per micro-batch, approximate
    peak: int  # total + working + accumulation + activations (host bytes when offloaded excluded)
    offloaded: int  # of `total`, what CPUOffloadPolicy keeps in host memory
    micro_batch: int


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    per = math.ceil(rows / world)
    return max(0, min(per, rows - rank * per))


def local_elements(t: torch.Tensor, world: int, rank: int) -> int:
    """Elements of `t` that FSDP2 places on `rank` (Shard(0), torch.chunk sizes)."""
    if t.dim() == 0:
        return t.numel() if rank == 0 else 0
    rest = t.numel() // t.shape[0] if t.shape[0] else 0
    return _chunk_rows(t.shape[0], world, rank) * rest


def zero_partition(groups: list[list[torch.Tensor]], world: int) -> list[list[torch.Tensor]]:
    """ZeroRedundancyOptimizer's partition: per group, largest tensors first, each to the least-loaded rank."""
    sizes = [0] * world
    owned: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for params in groups:
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            r = sizes.index(min(sizes))
            owned[r].append(p)
            sizes[r] += p.numel()
    return owned


def activation_bytes(model: nn.Module, micro_batch: int, seq_len: int, compute_bytes: int) -> int:
    cfg = getattr(model, "config", None)
    n_layer = getattr(cfg, "n_layer", len(getattr(model, "blocks", [])))
    d = getattr(cfg, "d_model", 0)
    vocab = getattr(cfg, "vocab_size", 0)
    blocks = n_layer * micro_batch * seq_len * d * 34 * compute_bytes // 2
    logits = micro_batch * seq_len * vocab * (compute_bytes + 8)
    return blocks + logits


def estimate_stage(model: nn.Module, engine: EngineConfig, stage: int, world: int, rank: int, *,
                   weight_decay: float, micro_batch: int, seq_len: int, accumulation: int = 1) -> StageEstimate:
    params = [p for p in model.parameters() if p.requires_grad]
    n_elem = sum(p.numel() for p in params)
    n_tensors = len(params)
    compute_bytes = torch.empty((), dtype=to_dtype(engine.precision)).element_size()
    units = shard_units(model)
    root_elem = n_elem - sum(p.numel() for u in units for p in u.parameters())
    accumulation_grads = 0
    if stage <= 1:
        p_b = g_b = FP32 * n_elem
        if stage == 0:
            o_b = 2 * FP32 * n_elem + FP32 * n_tensors
        else:
            groups = [g["params"] for g in optimizer_param_groups(model, weight_decay)]
            mine = zero_partition(groups, world)[rank]
            o_b = sum(2 * FP32 * p.numel() + FP32 for p in mine)
        working = 0 if engine.precision == "fp32" else compute_bytes * n_elem  # autocast's cached casts
    else:
        shard = sum(local_elements(p, world, rank) for p in params)
        p_b = g_b = FP32 * shard
        o_b = 2 * FP32 * shard + FP32 * n_tensors
        block_elem = max(sum(p.numel() for p in u.parameters()) for u in units)
        if stage == 2:
            working = compute_bytes * n_elem
        else:
            working = compute_bytes * (root_elem + min(len(units), 1 + engine.prefetch) * block_elem)
        if accumulation > 1 and engine.accumulation_sync == "last":
            accumulation_grads = FP32 * n_elem
    total = p_b + g_b + o_b
    offloaded = total if engine.offload == "cpu" else 0
    act = activation_bytes(model, micro_batch, seq_len, compute_bytes)
    return StageEstimate(stage=stage, world_size=world, rank=rank, params=p_b, grads=g_b, optimizer=o_b, total=total,
                         working_params=working, accumulation_grads=accumulation_grads, activations=act,
                         peak=total - offloaded + working + accumulation_grads + act, offloaded=offloaded,
                         micro_batch=micro_batch)


def estimate(cfg: JobConfig, world: int, *, stages: list[int] | None = None, rank: int | None = None,
             micro_batch: int | None = None) -> list[StageEstimate]:
    """One estimate per stage; `rank=None` reports the rank that holds the most (ranks differ only by rounding)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    seq_len = model.config.seq_len if hasattr(model, "config") else 0
    mb = micro_batch or (cfg.batch.micro_batch if isinstance(cfg.batch.micro_batch, int) else 1)
    accum = max(1, cfg.batch.global_batch // (mb * world))
    out = []
    for stage in stages if stages is not None else [0, 1, 2, 3]:
        eng = EngineConfig(**{**asdict(cfg.engine), "stage": stage,
                              "offload": cfg.engine.offload if stage >= 2 else "none"})
        ranks = [rank] if rank is not None else range(world)
        per_rank = [estimate_stage(model, eng, stage, world, r, weight_decay=cfg.optimizer.weight_decay,
                                   micro_batch=mb, seq_len=seq_len, accumulation=accum) for r in ranks]
        out.append(max(per_rank, key=lambda e: e.total))
    return out
