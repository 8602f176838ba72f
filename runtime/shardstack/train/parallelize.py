"""Wrap a model for one ZeRO stage with torch's own parallel wrappers (the stage map is in train/engine.py).

One transformer block is one FSDP unit; the root unit holds embeddings, final norm and the (tied) head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from shardstack.errors import ShardstackError
from shardstack.model.dtypes import to_dtype
from shardstack.train.config import EngineConfig
from shardstack.train.dist import DistInfo


def shard_units(model: nn.Module) -> Sequence[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList | list | tuple) or not blocks:
        raise ShardstackError(
            f"{type(model).__name__} has no `blocks` (a non-empty ModuleList of its layers)",
            hint="FSDP shards one block per unit; expose the transformer layers as `model.blocks`",
        )
    return blocks


def parallelize(model: nn.Module, engine_cfg: EngineConfig, dist_info: DistInfo) -> nn.Module:
    """Wrap `model` for `engine_cfg.stage`: a DDP wrapper for stages 0/1 (the model, initialised identically on every
    rank, moves to the device), or the model itself, sharded in place by FSDP2, for 2/3 (still on the meta device
    when the trainer built it there: build_engine materialises the shards afterwards)."""
    stage = engine_cfg.stage
    dev = dist_info.device
    if stage <= 1:
        return DDP(
            model.to(dev),
            device_ids=[dev.index] if dev.type == "cuda" else None,
            bucket_cap_mb=engine_cfg.bucket_mb,
            gradient_as_bucket_view=True,  # grads are views into the buckets: no second copy of every gradient
        )
    mesh = dist_info.mesh()
    compute = to_dtype(engine_cfg.precision)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute != torch.float32 \
        else MixedPrecisionPolicy()
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=dev.type == "cuda") if engine_cfg.offload == "cpu" \
        else OffloadPolicy()
    reshard: bool | int = stage == 3
    if stage == 3 and engine_cfg.reshard_group:
        reshard = engine_cfg.reshard_group
    blocks = shard_units(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    # The root unit (embeddings, final norm, tied head) is needed again first thing in backward: keep it gathered.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    if engine_cfg.prefetch > 1:
        k = engine_cfg.prefetch
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(list(blocks[i + 1: i + 1 + k]))
            block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - k): i])))
    return model
