"""The optimizer and its learning-rate schedule: AdamW (plain, or partitioned by ZeroRedundancyOptimizer at
stage 1) with decay on matrices only, and linear warm-up into a cosine decay."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardstack.train.config import OptimizerConfig, ScheduleConfig


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


def make_optimizer(params: list[dict[str, Any]], cfg: OptimizerConfig, stage: int) -> torch.optim.Optimizer:
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
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
