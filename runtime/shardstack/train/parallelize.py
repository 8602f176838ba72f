"""Wrap a model for one ZeRO stage with torch's own parallel wrappers (the stage map is in train/engine.py).

One transformer block is one FSDP unit; the root unit holds embeddings, final norm and the (tied) head. Activation
checkpointing and torch.compile apply per block, before any wrapping (as torchtitan orders them), so FSDP2's and
DDP's hooks stay outside the checkpointed and compiled region. With engine.tensor_parallel K, each block's projections
are split over the "tp" dimension of a 2-D mesh first, then FSDP2 shards over "dp" (torchtitan's order).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from shardstack.errors import ShardstackError
from shardstack.model.decoder import arch_spec
from shardstack.model.dtypes import to_dtype
from shardstack.train.config import EngineConfig
from shardstack.train.dist import DistInfo


def shard_units(model: nn.Module) -> Sequence[nn.Module]:
    """The FSDP units: the model's `blocks` (a ShardedModel's, checked when it was built)."""
    return model.blocks


def checkpointed_blocks(n_blocks: int, mode: str, every: int | None) -> list[int]:
    """Indices of the blocks whose activations are recomputed in backward: all (full), 0, N, 2N, … (every_n)."""
    if mode == "full":
        return list(range(n_blocks))
    if mode == "every_n":
        assert every is not None  # the config requires it
        return list(range(0, n_blocks, every))
    return []


@functools.cache
def inductor_problem(device_type: str) -> str | None:
    """Why torch.compile's default backend (inductor) cannot build kernels for `device_type` here, or None.

    torch.compile is lazy: without this probe a missing C++ compiler (CPU) or Triton (CUDA) would surface as a
    backend traceback at the first forward. Inductor's on-disk cache stays on: a cold probe builds a kernel (about a
    minute on 2 busy cores), a warm one costs nothing — and a cache warmed by a toolchain removed since would pass
    here and fail at the first step, the one case it does not catch.
    """
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(8, device=device_type))
    except Exception as exc:  # the backend raises whatever its toolchain raised
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return None


def prepare_blocks(blocks: Sequence[nn.Module], engine_cfg: EngineConfig, device: torch.device) -> None:
    """Activation checkpointing and torch.compile, per block, by replacing the block's `forward` on the instance.

    The blocks stay the same modules (no wrapper module), so parameter names, state_dict keys and checkpoints are
    identical with either option on or off. The hooks of `Module.__call__` (FSDP2's all-gather and reshard, DDP's)
    run around the new forward: FSDP2 gathers a checkpointed block before its forward and, in backward, before the
    recompute, which calls the original forward directly. Compile traces through the checkpoint (as a higher-order
    op), so the compiled backward recomputes inside one graph; identical blocks share one compiled graph.
    """
    engine_cfg = engine_cfg.for_device(device.type)
    if engine_cfg.compile:
        problem = inductor_problem(device.type)
        if problem:
            raise ShardstackError(
                f"config key 'engine.compile' is true, but torch.compile cannot build kernels on {device.type} "
                f"here ({problem})",
                hint="install a C++ compiler and the Python headers (Debian: apt-get install g++ python3-dev); on "
                     "CUDA, Triton — or set engine.compile: false")
    recompute = set(checkpointed_blocks(len(blocks), engine_cfg.activation_checkpointing,
                                        engine_cfg.activation_checkpointing_every))
    for i, block in enumerate(blocks):
        forward = block.forward
        if i in recompute:
            forward = functools.partial(checkpoint, forward, use_reentrant=False)
        if engine_cfg.compile:
            forward = torch.compile(forward)
        if i in recompute or engine_cfg.compile:
            block.forward = forward


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split each block's projections over `tp_mesh` as its architecture's tp_plan says (column- or row-wise), in
    place.

    Only the blocks are split; embeddings, norms and the head stay replicated across the "tp" ranks, whose inputs
    are identical. The styles return plain local tensors, so the block's own code runs unchanged on its heads.
    """
    k = tp_mesh.size()
    spec = arch_spec(model)
    if spec is None or spec.tp_plan is None:
        raise ShardstackError(f"{type(model).__name__} has no tensor-parallel plan: engine.tensor_parallel needs one",
                              hint="the Llama family supports tensor parallelism; set engine.tensor_parallel: 1")
    cfg = model.config
    for name, n in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head)):
        if n % k:  # a model from init_from, whose shape the config loader did not see
            raise ShardstackError(f"config key 'engine.tensor_parallel' is {k}, but the model's {name} ({n}) is "
                                  "not divisible by it")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in shard_units(model):
        parallelize_module(block, tp_mesh, {path: styles[style]() for path, style in spec.tp_plan.items()})


def parallelize(model: nn.Module, engine_cfg: EngineConfig, dist_info: DistInfo) -> nn.Module:
    """Wrap `model` for `engine_cfg.stage`: a DDP wrapper for stages 0/1 (the model, initialised identically on every
    rank, moves to the device), or the model itself, sharded in place by FSDP2, for 2/3 (still on the meta device
    when the trainer built it there: build_engine materialises the shards afterwards)."""
    engine_cfg = engine_cfg.for_device(dist_info.device.type)
    stage = engine_cfg.stage
    dev = dist_info.device
    prepare_blocks(shard_units(model), engine_cfg, dev)
    if stage <= 1:
        return DDP(
            model.to(dev),
            device_ids=[dev.index] if dev.type == "cuda" else None,
            bucket_cap_mb=engine_cfg.bucket_mb,
            gradient_as_bucket_view=True,  # grads are views into the buckets: no second copy of every gradient
        )
    tp = engine_cfg.tensor_parallel
    mesh = dist_info.mesh(tp)
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
        mesh = mesh["dp"]  # FSDP2 shards the (TP-sharded) parameters over the data-parallel ranks only
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
