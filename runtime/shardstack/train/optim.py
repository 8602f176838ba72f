"""The optimizer and its learning-rate schedule: AdamW (plain, or partitioned by ZeroRedundancyOptimizer at
stage 1) with decay on matrices only, and linear warm-up into a cosine decay.

`optimizer.impl` picks AdamW's kernels: `fused` (one kernel per tensor list, no temporaries), `foreach` (a handful
of multi-tensor ops; one temporary the size of a param group's parameters), `for_loop` (per tensor). The update is
the same up to rounding. `auto` takes fused where every parameter is on CUDA (torch itself defaults to foreach),
foreach elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardstack.errors import ShardstackError
from shardstack.train.config import OptimizerConfig, ScheduleConfig

FUSED_DEVICES = ("cpu", "cuda")  # the device types this runtime trains on; torch has fused AdamW for both


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices (≥ 2-D), none on norms and biases. Shared with the estimator, which must
    reproduce ZeroRedundancyOptimizer's partition from the same ordering."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def auto_impl(device_type: str) -> str:
    return "fused" if device_type == "cuda" else "foreach"


def resolve_impl(impl: str, params: list[torch.Tensor]) -> str:
    """`auto` made concrete for these parameters; `fused` checked up front, not at the first step."""
    if impl == "auto":
        return auto_impl("cuda" if params and all(p.device.type == "cuda" for p in params) else "cpu")
    if impl == "fused":
        bad = next((p for p in params if p.device.type not in FUSED_DEVICES or not torch.is_floating_point(p)),
                   None)
        if bad is not None:
            raise ShardstackError(
                f"config key 'optimizer.impl' is 'fused', but a parameter is {bad.dtype} on {bad.device.type}; fused "
                f"AdamW needs real floating-point parameters on {' or '.join(FUSED_DEVICES)}",
                hint="use optimizer.impl: foreach (or auto)")
    return impl


def make_optimizer(params: list[dict[str, Any]], cfg: OptimizerConfig, stage: int) -> torch.optim.Optimizer:
    impl = resolve_impl(cfg.impl, [p for g in params for p in g["params"]])
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
              "fused": impl == "fused", "foreach": impl == "foreach"}
    if stage == 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def lr_lambda(schedule_warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:  # LambdaLR calls it with the number of finished steps
        if step < schedule_warmup:
            return (step + 1) / (schedule_warmup + 1)
        progress = min(1.0, (step - schedule_warmup) / max(1, total - schedule_warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio))
